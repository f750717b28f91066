"""Parsing comma-separated command-line values (``--budgets 8,32``, ``--sizes 1,4,16``)."""

from __future__ import annotations

import argparse

from bastion.contract.errors import InvalidInputError

__all__ = ["csv_list", "float_list", "int_list", "parse_int_list", "positive_int_list"]


def csv_list(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_int_list(text: str, *, what: str = "the value", low: int | None = None) -> tuple[int, ...]:
    """Comma-separated integers (each >= ``low`` when given); raises :class:`InvalidInputError`."""
    try:
        values = tuple(int(t) for t in csv_list(text))
    except ValueError:
        raise InvalidInputError(f"{what} takes comma-separated integers, got {text!r}") from None
    if low is not None and (not values or min(values) < low):
        raise InvalidInputError(f"{what} takes comma-separated integers >= {low}, got {text!r}")
    return values


def int_list(text: str) -> tuple[int, ...]:
    """argparse ``type=``: comma-separated integers."""
    try:
        return parse_int_list(text)
    except InvalidInputError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def positive_int_list(text: str) -> tuple[int, ...]:
    """argparse ``type=``: a non-empty list of comma-separated integers >= 1."""
    try:
        return parse_int_list(text, low=1)
    except InvalidInputError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}") from None


def float_list(text: str) -> tuple[float, ...]:
    """argparse ``type=``: a non-empty list of comma-separated numbers."""
    try:
        values = tuple(float(t) for t in csv_list(text))
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values
