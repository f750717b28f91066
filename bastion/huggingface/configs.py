"""Reading Hugging Face model configs (config objects or plain dicts) in one place."""

from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping

from attrs import frozen

from bastion.contract.errors import InvalidFileError, InvalidInputError

__all__ = [
    "DecoderShape",
    "config_dict",
    "config_dtype",
    "config_value",
    "check_size_fields",
    "check_model_size",
    "decoder_parameters",
    "physical_memory",
]

_REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for a dict, ``config.key`` for a config object; ``default`` when absent or None."""
    value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
    return default if value is None else value


def config_dtype(config: Any) -> Any:
    """The dtype a config states (a dtype or its name), or None: its ``dtype``, else the older
    ``torch_dtype`` key of a plain dict or a config object that stores one itself. A Hugging Face
    config's ``torch_dtype`` attribute is only a deprecated alias of ``dtype`` (reading it logs
    transformers' deprecation warning), so it is never read."""
    value = config_value(config, "dtype")
    if value is not None:
        return value
    if isinstance(config, Mapping):
        return config.get("torch_dtype")
    return getattr(config, "__dict__", {}).get("torch_dtype")


def config_dict(config: Any) -> dict[str, Any]:
    """A config object (``to_dict``) or mapping as a plain dict."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(vars(config))


@frozen
class DecoderShape:
    """The shape of a dense decoder-only transformer (Llama / Qwen3 family) as its config states it."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int  # the config's num_key_value_heads, else num_heads
    head_dim: int  # the config's head_dim, else hidden_size // num_heads
    intermediate_size: int
    vocab_size: int
    dtype: Any  # the config's dtype / torch_dtype (a dtype or its name), or None
    model_type: str

    @classmethod
    def from_config(cls, config: Any, *, purpose: str = "bastion") -> "DecoderShape":
        """Read the shape; missing required keys raise :class:`InvalidInputError` naming them and
        ``purpose`` (what needed them)."""
        missing = [k for k in _REQUIRED if config_value(config, k) is None]
        if missing:
            raise InvalidInputError(
                f"model config lacks {', '.join(missing)}; {purpose} needs a dense decoder config (Llama / Qwen3 style)"
            )
        heads = int(config_value(config, "num_attention_heads"))
        hidden = int(config_value(config, "hidden_size"))
        return cls(
            num_layers=int(config_value(config, "num_hidden_layers")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config_value(config, "num_key_value_heads", heads)),
            head_dim=int(config_value(config, "head_dim", hidden // heads)),
            intermediate_size=int(config_value(config, "intermediate_size")),
            vocab_size=int(config_value(config, "vocab_size")),
            dtype=config_dtype(config),
            model_type=str(config_value(config, "model_type", "decoder")),
        )


#: config fields that, when present, must be ints >= 1 (a zero or negative size fails deep inside a
#: model's constructor, e.g. a ZeroDivisionError for zero attention heads)
SIZE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)

_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def check_size_fields(raw: Mapping[str, Any], source: Any, fields: tuple[str, ...] = SIZE_FIELDS) -> None:
    """Every field of ``fields`` present (and not null) in the config dict ``raw`` must be an int >= 1;
    else :class:`InvalidFileError` naming ``source`` and the field."""
    for key in fields:
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidFileError(f"{source}: {key} must be an int >= 1, got {value!r} ({type(value).__name__})")


def decoder_parameters(shape: DecoderShape, *, tied: bool) -> dict[str, int]:
    """Parameters a dense decoder of ``shape`` holds, by the config field that scales them: the
    embedding (and head) by ``vocab_size``, the layers' MLPs by ``intermediate_size``, the rest of the
    layers by ``hidden_size``; the whole stack by ``num_hidden_layers`` (key ``num_hidden_layers``)."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    attention = h * q * 2 + h * kv * 2 + 2 * h
    mlp = 3 * h * shape.intermediate_size
    return {
        "vocab_size": shape.vocab_size * h * (1 if tied else 2),
        "intermediate_size": shape.num_layers * mlp,
        "hidden_size": shape.num_layers * attention + h,
        "num_hidden_layers": shape.num_layers * (attention + mlp),
    }


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.3g} GB"


def check_model_size(
    raw: Mapping[str, Any],
    source: Any,
    *,
    stored: Mapping[str, tuple[int, ...]] | None = None,
    bytes_per_param: int = 4,
    limit_bytes: int | None = None,
) -> None:
    """Refuse, before a model is built, a config that describes a model far larger than its weights
    (``stored``: tensor name -> shape from the safetensors headers; a model built from such a config
    would be mostly random, and building it can take minutes and gigabytes) or than ``limit_bytes``
    (the memory it loads into). The :class:`InvalidFileError` names ``source``, the field at fault and
    the memory the model would need. Configs that are not a dense decoder's are not sized."""
    check_size_fields(raw, source)
    try:
        shape = DecoderShape.from_config(raw)
    except (InvalidInputError, TypeError, ValueError, ZeroDivisionError):
        return
    parts = decoder_parameters(shape, tied=bool(raw.get("tie_word_embeddings", False)))
    total = parts["vocab_size"] + parts["num_hidden_layers"] + shape.hidden_size
    need = total * bytes_per_param
    largest = max(("vocab_size", "intermediate_size", "hidden_size"), key=lambda k: parts[k])
    if stored is not None:
        held = sum(math.prod(s) for s in stored.values())
        if total > 2 * held + 2**20:
            layers = {int(m.group(1)) for name in stored for m in [_LAYER_INDEX.search(name)] if m}
            field = "num_hidden_layers" if layers and shape.num_layers > len(layers) else largest
            held_layers = f" in {len(layers)} layers" if layers else ""
            raise InvalidFileError(
                f"{source}: {field}={raw.get(field)} describes a model of {total:.3g} parameters ({_gb(need)} at "
                f"{bytes_per_param} bytes each) but the weights hold {held:.3g}{held_layers}; refused before "
                "building it"
            )
    if limit_bytes is not None and need > limit_bytes:
        field = "num_hidden_layers" if parts["num_hidden_layers"] >= parts["vocab_size"] and shape.num_layers > 1 else largest
        raise InvalidFileError(
            f"{source}: {field}={raw.get(field)} describes a model of {total:.3g} parameters, {_gb(need)} at "
            f"{bytes_per_param} bytes each, more than the {_gb(limit_bytes)} of memory it would load into"
        )


def physical_memory() -> int | None:
    """This machine's memory in bytes, or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX systems
        return None
