"""Per-row decode settings of ``bastion run``: what a row may ask for, checked with the pipeline's rules.

A row may set ``max_new_tokens`` (or its OpenAI spellings ``max_tokens`` / ``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop``; what it leaves out comes from the command
line (:class:`Decode` is the result). Each value is checked with the same rule as
``Pipeline.generate`` (:class:`bastion.core.types.SamplingConfig`, :func:`bastion.core.checks.check_seed`,
:func:`bastion.core.text.check_stop_strings`), and a bad value is reported with the field's name.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

from attrs import frozen

from bastion.core.checks import check_seed
from bastion.core.errors import InvalidInputError
from bastion.core.text import check_stop_strings
from bastion.core.types import SamplingConfig

__all__ = ["RowSettings", "Decode", "SETTING_KEYS", "MAX_TOKENS_KEYS", "parse_settings", "resolve"]

#: the spellings of a row's new-token limit (one of them at most)
MAX_TOKENS_KEYS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
#: every key :func:`parse_settings` reads
SETTING_KEYS = frozenset({*MAX_TOKENS_KEYS, "temperature", "top_p", "top_k", "seed", "stop"})


@frozen
class RowSettings:
    """The settings one row asks for; ``None``: not given (the command line's value applies)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None


@frozen
class Decode:
    """The settings a row is decoded with: its own, else the command line's. ``seed`` is the row's own
    seed, or ``--seed`` plus its input line."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...] = ()

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def group(self) -> tuple[Any, ...]:
        """What rows must share to be decoded by one ``generate_batch`` call (the seed aside: see
        :func:`bastion.run.runner._seed_runs`)."""
        return (self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.stop)

    def as_json(self) -> dict[str, Any]:
        """The settings as a JSON object; the seed only where it matters (temperature > 0)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed if self.sampled else None,
            "stop": list(self.stop),
        }


def _max_new_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise InvalidInputError(f"must be a positive integer, got {value!r}")
    return int(value)


def _checked(key: str, value: Any) -> Any:
    if key in MAX_TOKENS_KEYS:
        return _max_new_tokens(value)
    if key == "temperature":
        return SamplingConfig(temperature=value).temperature
    if key == "top_p":
        return SamplingConfig(top_p=value).top_p
    if key == "top_k":
        return SamplingConfig(top_k=value).top_k
    if key == "seed":
        return check_seed(value)
    if not isinstance(value, (str, list)):
        raise InvalidInputError(f"stop must be a string or a list of strings, got {value!r}")
    return check_stop_strings(value)


def parse_settings(obj: Mapping[str, Any]) -> RowSettings:
    """The settings keys of ``obj`` (a row, or an OpenAI request body) as :class:`RowSettings`; a JSON
    ``null`` means not given. A bad value raises :class:`InvalidInputError` naming the field."""
    limits = [k for k in MAX_TOKENS_KEYS if obj.get(k) is not None]
    if len(limits) > 1:
        raise InvalidInputError(f"give one of {limits}, not several")
    values: dict[str, Any] = {}
    for key in SETTING_KEYS:
        if obj.get(key) is None:
            continue
        try:
            values["max_new_tokens" if key in MAX_TOKENS_KEYS else key] = _checked(key, obj[key])
        except InvalidInputError as exc:
            raise InvalidInputError(f"field '{key}': {exc}") from None
    return RowSettings(**values)


def resolve(settings: RowSettings, defaults: Decode, line: int) -> Decode:
    """The :class:`Decode` of a row on input line ``line``: its own settings over ``defaults`` (the
    command line's), its seed its own or ``defaults.seed + line``. A seed past 2**64 - 1 raises
    :class:`InvalidInputError`."""
    seed = settings.seed if settings.seed is not None else check_seed(defaults.seed + line, name="--seed plus the input line")
    return Decode(
        max_new_tokens=defaults.max_new_tokens if settings.max_new_tokens is None else settings.max_new_tokens,
        temperature=defaults.temperature if settings.temperature is None else settings.temperature,
        top_p=defaults.top_p if settings.top_p is None else settings.top_p,
        top_k=defaults.top_k if settings.top_k is None else settings.top_k,
        seed=seed,
        stop=defaults.stop if settings.stop is None else settings.stop,
    )
