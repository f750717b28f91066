"""Reading Hugging Face model configs (config objects or plain dicts) in one place."""

from __future__ import annotations

from typing import Any, Mapping

from attrs import frozen

from bastion.core.errors import InvalidInputError

__all__ = ["DecoderShape", "config_dict", "config_dtype", "config_value"]

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
