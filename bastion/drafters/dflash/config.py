"""DFlash drafter configuration: the ``config.json`` of a DFlash checkpoint as a typed, validated object."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence


import torch.nn.functional as F
from attrs import field, frozen

from bastion.utils.checks import positive_int
from bastion.contract.errors import InvalidFileError, InvalidInputError
from bastion.utils.files import read_json_object
from bastion.huggingface.configs import DecoderShape, config_dict, config_value
from bastion.drafters.dflash.checkpoint import CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME, resolve_checkpoint_dir

__all__ = ["DFlashConfig", "MAX_BLOCK_SIZE", "default_target_layer_ids", "CONFIG_NAME", "WEIGHTS_NAME", "WEIGHTS_INDEX_NAME"]

ARCHITECTURE = "DFlashDraftModel"

#: the largest block a DFlash config may declare (published drafters use 8 to 16): a larger one is a
#: corrupt config, and drafting it would allocate block_size x (hidden + vocab) activations per step
MAX_BLOCK_SIZE = 1024

#: keys of config.json that map to DFlashConfig fields (everything else is kept verbatim in ``extra``)
_HANDLED_KEYS = frozenset(
    {
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "block_size",
        "num_target_layers",
        "dflash_config",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "hidden_act",
        "attention_bias",
        "max_position_embeddings",
        "architectures",
        "model_type",
        "layer_types",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "mask_token_id",
        "target_layer_ids",
    }
)

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The layer choice DFlash uses when a config gives none: one target layer per draft layer, spread
    evenly from layer 1 to layer ``num_target_layers - 3`` (the middle layer for a one-layer drafter)."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise InvalidInputError("num_target_layers and num_draft_layers must be >= 1")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    lo, hi = 1, num_target_layers - 3
    return tuple(int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def _to_int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@frozen
class DFlashConfig:
    """Architecture of a DFlash drafter (the fields of a DFlash ``config.json``)."""

    hidden_size: int = field(validator=positive_int)
    intermediate_size: int = field(validator=positive_int)
    num_hidden_layers: int = field(validator=positive_int)
    num_attention_heads: int = field(validator=positive_int)
    num_key_value_heads: int = field(validator=positive_int)
    head_dim: int = field(validator=positive_int)
    vocab_size: int = field(validator=positive_int)
    block_size: int = field(validator=positive_int)
    num_target_layers: int = field(validator=positive_int)
    target_layer_ids: tuple[int, ...] = field(converter=_to_int_tuple)
    mask_token_id: int = field(converter=int)
    rms_norm_eps: float = field(default=1e-6, converter=float)
    #: normalised rope settings: {"rope_type": ..., "rope_theta": ..., plus type-specific keys}
    rope_parameters: Mapping[str, Any] = field(
        factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}, converter=dict
    )
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = field(default=40960, validator=positive_int)
    #: other config.json keys (dtype, token ids, auto_map...), written back unchanged on save
    extra: Mapping[str, Any] = field(factory=dict, converter=dict, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.block_size < 2:
            raise InvalidInputError(f"DFlashConfig.block_size must be >= 2 (anchor + masks), got {self.block_size}")
        if self.block_size > min(MAX_BLOCK_SIZE, self.max_position_embeddings):
            step = self.block_size * (self.hidden_size + self.vocab_size) * 4  # a block's hidden states and logits
            raise InvalidInputError(
                f"block_size={self.block_size} is more than the {min(MAX_BLOCK_SIZE, self.max_position_embeddings)} "
                f"positions a block may span (max_position_embeddings={self.max_position_embeddings}, at most "
                f"{MAX_BLOCK_SIZE}): one draft step would need {step / 1e9:.3g} GB of float32 activations "
                f"(block_size x (hidden_size + vocab_size) x 4 bytes)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidInputError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise InvalidInputError("DFlashConfig.target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise InvalidInputError(
                f"target_layer_ids {bad} lie outside the target's layers [0, {self.num_target_layers})"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise InvalidInputError(f"mask_token_id {self.mask_token_id} lies outside the vocabulary [0, {self.vocab_size})")
        if self.hidden_act not in _ACTIVATIONS:
            raise InvalidInputError(f"hidden_act {self.hidden_act!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
        if "rope_theta" not in self.rope_parameters:
            raise InvalidInputError("rope_parameters needs a rope_theta")
        # a norm's epsilon <= 0 (or NaN) turns a zero row into NaN drafts far from the config that caused them
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise InvalidInputError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps!r}")
        theta = self.rope_parameters["rope_theta"]
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
            raise InvalidInputError(f"rope_theta must be a finite number > 0, got {theta!r}")

    # ---------------------------------------------------------------- derived
    @property
    def feature_size(self) -> int:
        """F: width of the concatenated target features the drafter reads."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def num_draft_tokens(self) -> int:
        """K = B - 1, the depths one forward proposes."""
        return self.block_size - 1

    # ---------------------------------------------------------------- construction
    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: Sequence[int] | None = None,
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
    ) -> "DFlashConfig":
        """A drafter config matching ``target_config`` (HF config object or dict): same hidden size,
        heads, head_dim, vocabulary, norm eps and rope; ``num_layers`` draft layers. ``mask_token_id``
        defaults to the last vocabulary id; ``target_layer_ids`` to :func:`default_target_layer_ids`."""
        shape = DecoderShape.from_config(target_config, purpose="a DFlash drafter config")
        hidden, heads, n_target, vocab = shape.hidden_size, shape.num_heads, shape.num_layers, shape.vocab_size

        def get(key: str, default: Any = None) -> Any:
            return config_value(target_config, key, default)

        layer_ids = tuple(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(n_target, num_layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or shape.intermediate_size),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            vocab_size=vocab,
            block_size=block_size,
            num_target_layers=n_target,
            target_layer_ids=layer_ids,
            mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6) or 1e-6),
            rope_parameters=_rope_from_dict(config_dict(target_config)),
            hidden_act=str(get("hidden_act", "silu") or "silu"),
            max_position_embeddings=int(get("max_position_embeddings", 40960) or 40960),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DFlashConfig":
        """Parse a DFlash ``config.json`` dict. Missing or wrongly typed keys raise
        :class:`InvalidInputError` naming them."""
        if not isinstance(data, Mapping):
            raise InvalidInputError(f"a DFlash config is a JSON object, got {type(data).__name__}")
        data = dict(data)
        dflash = data.get("dflash_config") or {}
        if not isinstance(dflash, Mapping):
            raise InvalidInputError(f"dflash_config must be an object, got {type(dflash).__name__}")
        required = [
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "block_size",
            "num_target_layers",
        ]
        missing = [k for k in required if data.get(k) is None]
        mask_id = dflash.get("mask_token_id", data.get("mask_token_id"))
        if mask_id is None:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise InvalidInputError(f"DFlash config is missing {', '.join(missing)}")
        ints = {k: _int_field(data, k) for k in required}
        for key in ("num_attention_heads", "hidden_size"):  # divided by below: refuse 0 before dividing
            if ints[key] < 1:
                raise InvalidInputError(f"{key} must be an int >= 1, got {ints[key]}")
        layer_types = data.get("layer_types") or []
        if not isinstance(layer_types, list):
            raise InvalidInputError(f"layer_types must be a list, got {type(layer_types).__name__}")
        if data.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise InvalidInputError("DFlash drafters with sliding-window attention layers are not supported")
        heads, n_layers = ints["num_attention_heads"], ints["num_hidden_layers"]
        layer_ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        if layer_ids is None:
            layer_ids = default_target_layer_ids(ints["num_target_layers"], n_layers)
        elif not isinstance(layer_ids, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in layer_ids):
            raise InvalidInputError(f"dflash_config.target_layer_ids must be a list of ints, got {layer_ids!r}")
        return cls(
            hidden_size=ints["hidden_size"],
            intermediate_size=ints["intermediate_size"],
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=_int_field(data, "num_key_value_heads", heads),
            head_dim=_int_field(data, "head_dim", ints["hidden_size"] // heads),
            vocab_size=ints["vocab_size"],
            block_size=ints["block_size"],
            num_target_layers=ints["num_target_layers"],
            target_layer_ids=layer_ids,
            mask_token_id=_int_field({"dflash_config.mask_token_id": mask_id}, "dflash_config.mask_token_id"),
            rms_norm_eps=_float_field(data, "rms_norm_eps", 1e-6),
            rope_parameters=_rope_from_dict(data),
            hidden_act=str(data.get("hidden_act", "silu")),
            attention_bias=bool(data.get("attention_bias", False)),
            max_position_embeddings=_int_field(data, "max_position_embeddings", 40960),
            extra={k: v for k, v in data.items() if k not in _HANDLED_KEYS},
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` dict in the DFlash checkpoint format."""
        rope = dict(self.rope_parameters)
        legacy_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out: dict[str, Any] = dict(self.extra)
        out.update(
            {
                "architectures": [ARCHITECTURE],
                "model_type": "qwen3",
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "vocab_size": self.vocab_size,
                "hidden_act": self.hidden_act,
                "attention_bias": self.attention_bias,
                "rms_norm_eps": self.rms_norm_eps,
                "max_position_embeddings": self.max_position_embeddings,
                "rope_theta": rope["rope_theta"],
                "rope_scaling": None if legacy_scaling.get("rope_type", "default") == "default" else legacy_scaling,
                "rope_parameters": rope,
                "use_sliding_window": False,
                "layer_types": ["full_attention"] * self.num_hidden_layers,
                "tie_word_embeddings": False,
                "block_size": self.block_size,
                "num_target_layers": self.num_target_layers,
                "dflash_config": {
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": list(self.target_layer_ids),
                },
            }
        )
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DFlashConfig":
        """Read ``config.json`` from a local directory or a hub id."""
        directory = resolve_checkpoint_dir(path, config_only=True)
        return cls.from_file_dict(read_json_object(directory / CONFIG_NAME), directory / CONFIG_NAME)

    @classmethod
    def from_file_dict(cls, data: Mapping[str, Any], source: str | Path) -> "DFlashConfig":
        """:meth:`from_dict` for the contents of the file ``source``: errors name the file."""
        try:
            return cls.from_dict(data)
        except InvalidFileError:
            raise
        except (InvalidInputError, TypeError, ValueError) as exc:
            raise InvalidFileError(f"{source}: {exc}") from exc

    def save_pretrained(self, path: str | Path) -> Path:
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return directory


def _int_field(data: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """``data[key]`` as an int (``default`` when absent or null); other types name the key."""
    value = data.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{key} must be an integer, got {value!r} ({type(value).__name__})")
    return value


def _float_field(data: Mapping[str, Any], key: str, default: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInputError(f"{key} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def _rope_from_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    """Normalise rope settings of a 4.x-style (``rope_theta`` + ``rope_scaling``) or 5.x-style
    (``rope_parameters``) config into one dict with ``rope_type`` and ``rope_theta``."""
    params = data.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        rope = dict(params)
    else:
        rope = dict(data.get("rope_scaling") or {})
        rope["rope_theta"] = float(data.get("rope_theta", 1_000_000.0) if data.get("rope_theta") is not None else 1_000_000.0)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(rope["rope_theta"])
    return rope


# ===================================================================== network
