"""Per-row decode settings of ``bastion run``: what a row may ask for, checked with the pipeline's rules.

A row may set ``max_new_tokens`` (or its OpenAI spellings ``max_tokens`` / ``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop``; what it leaves out comes from the command
line (:class:`Decode` is the result). Each value is checked by the one rule every path applies
(:func:`bastion.engine.params.check_setting`, the rule of :class:`~bastion.GenerationConfig`), and a bad
value is reported with the field's name.
"""

from __future__ import annotations

from typing import Any, Mapping

from attrs import frozen

from bastion.contract.errors import InvalidInputError
from bastion.engine.params import check_setting, derived_seed

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
        :func:`bastion.run.job._seed_runs`)."""
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


def _checked(key: str, value: Any) -> Any:
    return check_setting("max_new_tokens" if key in MAX_TOKENS_KEYS else key, value)


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
    command line's), its seed its own or ``defaults.seed + line`` modulo 2**64
    (:func:`bastion.engine.params.derived_seed`, the rule of a batch's row seeds)."""
    seed = settings.seed if settings.seed is not None else derived_seed(defaults.seed, line)
    return Decode(
        max_new_tokens=defaults.max_new_tokens if settings.max_new_tokens is None else settings.max_new_tokens,
        temperature=defaults.temperature if settings.temperature is None else settings.temperature,
        top_p=defaults.top_p if settings.top_p is None else settings.top_p,
        top_k=defaults.top_k if settings.top_k is None else settings.top_k,
        seed=seed,
        stop=defaults.stop if settings.stop is None else settings.stop,
    )
