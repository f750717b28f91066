"""One set of generation settings: :class:`SamplingParams` and :class:`GenerationConfig`.

Both are frozen and validated at construction, so every path that decodes (``generate``, ``stream``,
``chat``, ``generate_batch``, the engine, the server, ``bastion run``) checks a request once, with the
same rules and the same messages. The keyword arguments of the pipeline's methods build these objects
(:meth:`GenerationConfig.merge`), so old call sites keep working.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import attrs
from attrs import field, frozen

from bastion.utils.checks import SEED_LIMIT, check_int, check_seed
from bastion.contract.errors import InvalidInputError, InvalidOptionError
from bastion.utils.text import check_stop_strings
from bastion.contract.types import SamplingConfig

__all__ = ["GenerationConfig", "SamplingParams", "SAMPLING_SETTINGS", "SETTINGS", "check_setting", "derived_seed", "generation_config"]

#: the settings of :class:`SamplingParams`
SAMPLING_SETTINGS = ("temperature", "top_p", "top_k", "seed")
#: every setting a generation takes (:class:`GenerationConfig`'s own fields and the sampling ones)
SETTINGS = ("max_new_tokens", *SAMPLING_SETTINGS, "stop", "stop_on_eos")


def _seed(value: object) -> int | None:
    return None if value is None else check_seed(value)


def _stops(value: object) -> tuple[str, ...]:
    return check_stop_strings(value)  # type: ignore[arg-type]


def _max_new_tokens(value: object) -> int:
    return int(check_int("max_new_tokens", value))  # the rule of every count: an int >= 1, numpy ints too


def _flag(name: str):  # type: ignore[no-untyped-def]
    def convert(value: object) -> bool:
        if not isinstance(value, bool):
            raise InvalidInputError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
        return value

    return convert


@frozen
class SamplingParams:
    """How a request samples: ``temperature`` 0 is greedy; ``top_p`` 1 and ``top_k`` 0 switch those
    filters off; ``seed`` (an int in [0, 2**64) or None) makes sampling repeatable: the same seed
    and trees give the same tokens in every dtype, and in float32 whatever the batch, the trees or the
    timings (lower precisions round forwards of other widths differently: docs/verification.md)."""

    temperature: float = field(default=0.0)
    top_p: float = field(default=1.0)
    top_k: int = field(default=0)
    seed: int | None = field(default=None, converter=_seed)
    #: the checked sampling rule the verifier applies (temperature, top_p, top_k)
    rule: SamplingConfig = field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        rule = SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)  # validates
        object.__setattr__(self, "temperature", rule.temperature)
        object.__setattr__(self, "top_p", rule.top_p)
        object.__setattr__(self, "top_k", rule.top_k)
        object.__setattr__(self, "rule", rule)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self, seed: int | None) -> "SamplingParams":
        """A copy with another seed. The pipeline derives row seeds with it (``seed + i`` for row i of a
        batch): a derived seed at or past 2**64 wraps around modulo 2**64 (:func:`derived_seed`), so the
        largest seed is valid for a batch too; negative seeds, floats and bools are still refused."""
        if seed is not None and isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and int(seed) >= 0:
            seed = derived_seed(seed)
        return attrs.evolve(self, seed=seed)


def derived_seed(seed: object, offset: int = 0) -> int:
    """``seed + offset`` modulo 2**64: the seed of row ``offset`` of a batch seeded with ``seed``, or of
    input line ``offset`` of a ``bastion run`` seeded with ``--seed``. Every seed a caller may pass
    (an int in [0, 2**64)) gives seeds in that range, so ``seed=2**64 - 1`` is valid on every path."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InvalidInputError(f"seed must be an int in [0, 2**64), got {seed!r} ({type(seed).__name__})")
    return (int(seed) + int(offset)) % SEED_LIMIT


def _sampling(value: object) -> SamplingParams:
    if isinstance(value, SamplingParams):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in SAMPLING_SETTINGS)
        if unknown:
            raise InvalidOptionError(f"sampling: unknown setting(s) {unknown}; SamplingParams takes {list(SAMPLING_SETTINGS)}")
        return SamplingParams(**value)
    raise InvalidInputError(f"sampling must be a SamplingParams or a mapping of its fields, got {type(value).__name__}")


@frozen
class GenerationConfig:
    """What one generation asks for: how many new tokens at most, how to sample, where to stop.

    ``stop``: stop strings (the text ends right before the first to appear; needs a tokenizer).
    ``stop_on_eos``: end at the target's end-of-sequence tokens (False: decode to ``max_new_tokens``)."""

    max_new_tokens: int = field(default=64, converter=_max_new_tokens)
    sampling: SamplingParams = field(factory=SamplingParams, converter=_sampling)
    stop: tuple[str, ...] = field(default=(), converter=_stops)
    stop_on_eos: bool = field(default=True, converter=_flag("stop_on_eos"))

    def merge(self, **overrides: Any) -> "GenerationConfig":
        """A copy with some fields replaced: ``max_new_tokens``, ``stop``, ``stop_on_eos`` and the
        sampling fields ``temperature``, ``top_p``, ``top_k``, ``seed`` (None values are left out)."""
        sampling_keys = {"temperature", "top_p", "top_k", "seed"}
        unknown = set(overrides) - sampling_keys - {"max_new_tokens", "stop", "stop_on_eos"}
        if unknown:
            raise InvalidOptionError(f"unknown generation settings {sorted(unknown)}; the settings are {list(SETTINGS)}")
        sampling = {k: v for k, v in overrides.items() if k in sampling_keys and v is not None}
        top = {k: v for k, v in overrides.items() if k not in sampling_keys and v is not None}
        if sampling:
            top["sampling"] = attrs.evolve(self.sampling, **sampling)
        return attrs.evolve(self, **top) if top else self


#: the pipeline's keyword defaults (``generate(ids, 64, 0.0, None, top_p=1.0, top_k=0, ...)``)
_DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0, "seed": None, "top_p": 1.0, "top_k": 0, "stop": None, "stop_on_eos": True}


def generation_config(config: GenerationConfig | None = None, **kwargs: Any) -> GenerationConfig:
    """One :class:`GenerationConfig` from a config and/or the pipeline's keyword arguments.

    With ``config`` given, keyword arguments left at their defaults do not override it; any other
    keyword replaces the config's field. Without it, the keywords build a new config."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise InvalidInputError(f"config must be a bastion.GenerationConfig, got {type(config).__name__}")
    if config is None:
        stop = kwargs.get("stop")
        return GenerationConfig(
            max_new_tokens=kwargs.get("max_new_tokens", 64),
            sampling=SamplingParams(
                temperature=kwargs.get("temperature", 0.0),
                top_p=kwargs.get("top_p", 1.0),
                top_k=kwargs.get("top_k", 0),
                seed=kwargs.get("seed"),
            ),
            stop=() if stop is None else stop,
            stop_on_eos=kwargs.get("stop_on_eos", True),
        )
    changed = {k: v for k, v in kwargs.items() if k in _DEFAULTS and not _same(v, _DEFAULTS[k])}
    return config.merge(**changed)


def check_setting(name: str, value: object) -> Any:
    """One generation setting checked by the very rule :class:`GenerationConfig` and
    :class:`SamplingParams` apply to it (the same on every path: the pipeline's keywords, the engine, the
    server, ``bastion run`` rows and options, the command lines, the Hugging Face drop-in). Returns the
    value as the config holds it (``stop`` as a tuple, numpy numbers as Python ones); a bad value raises
    :class:`InvalidInputError` naming the setting."""
    if name in SAMPLING_SETTINGS:
        return getattr(SamplingParams(**{name: value}), name)
    if name in ("max_new_tokens", "stop", "stop_on_eos"):
        return getattr(GenerationConfig(**{name: value}), name)
    raise InvalidOptionError(f"unknown generation setting {name!r}; the settings are {list(SETTINGS)}")


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b
