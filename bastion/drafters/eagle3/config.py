"""EAGLE-3 drafter configuration: the ``config.json`` of an EAGLE-3 checkpoint as a typed, validated object.

EAGLE-3 checkpoints (SafeAILab/EAGLE, SpecForge, AngelSlim; read by vLLM and SGLang) store a Llama-style
config of ONE decoder layer (architecture ``LlamaForCausalLMEagle3`` or similar) plus:

- ``draft_vocab_size``: rows of the draft lm head (the draft vocabulary, often smaller than the target's);
- ``target_hidden_size`` (optional): the target's hidden width when it differs from the draft's;
- ``norm_before_residual`` (optional, default false): the residual of the first block is the normalised
  projected feature instead of the raw one;
- ``eagle_config.eagle_aux_hidden_state_layer_ids`` (optional): the target layers whose OUTPUTS form the
  features (Hugging Face ``hidden_states[i + 1]``). Without it EAGLE-3 reads the hidden states entering
  target layers 2, L // 2 and L - 3, i.e. the outputs of layers 1, L // 2 - 1 and L - 4.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from attrs import field, frozen

from bastion.contract.errors import InvalidFileError, InvalidInputError

__all__ = ["Eagle3Config", "default_feature_layers", "CONFIG_NAME"]

CONFIG_NAME = "config.json"


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """Target layer ids (outputs, HF ``hidden_states[i + 1]``) EAGLE-3 reads by default: the hidden states
    entering layers 2, L // 2 and L - 3 of an L-layer target."""
    n = int(num_target_layers)
    return (1, n // 2 - 1, n - 4)


def _int(data: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise InvalidFileError(f"{source}: field {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidFileError(f"{source}: field {key} must be an int >= 1, got {value!r}")
    return value


def _float(data: Mapping[str, Any], key: str, source: str, default: float) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidFileError(f"{source}: field {key} must be a finite number, got {value!r}")
    return float(value)


def _rope(data: Mapping[str, Any]) -> dict[str, Any]:
    """Rope settings of a 4.x-style (``rope_theta`` + ``rope_scaling``) or 5.x-style (``rope_parameters``)
    config as one dict with ``rope_type`` and ``rope_theta`` (Llama's default theta 10000 when absent)."""
    params = data.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:
        rope = dict(params)
    else:
        rope = dict(data.get("rope_scaling") or {})
        theta = data.get("rope_theta")
        rope["rope_theta"] = 10000.0 if theta is None else theta
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope["rope_theta"] = float(rope["rope_theta"])
    return rope


@frozen
class Eagle3Config:
    """The shape and options of an EAGLE-3 draft network (one decoder layer)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary (rows of the token embedding)
    draft_vocab_size: int  # rows of the draft lm head
    target_hidden_size: int  # width of one target hidden state (fc reads 3 of them)
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    norm_before_residual: bool = False
    #: target layers whose outputs form the features, in order (None: EAGLE-3's default for the target)
    feature_layer_ids: tuple[int, ...] | None = None
    max_position_embeddings: int = 2048
    rope_parameters: Mapping[str, Any] = field(factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}, converter=dict)

    @property
    def feature_size(self) -> int:
        """Width of the fc input: three target hidden states side by side."""
        return 3 * self.target_hidden_size

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | Path = "config.json") -> "Eagle3Config":
        """Parse a ``config.json`` object; a missing or malformed field raises :class:`InvalidFileError`
        naming ``source`` and the field."""
        src = str(source)
        layers = data.get("num_hidden_layers", 1)
        if layers != 1:
            raise InvalidFileError(f"{src}: field num_hidden_layers is {layers!r}; an EAGLE-3 drafter has one decoder layer")
        hidden = _int(data, "hidden_size", src)
        heads = _int(data, "num_attention_heads", src)
        head_dim = data.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise InvalidFileError(f"{src}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
            head_dim = hidden // heads
        head_dim = _int({"head_dim": head_dim}, "head_dim", src)
        kv_heads = _int(data, "num_key_value_heads", src, heads)
        if heads % kv_heads:
            raise InvalidFileError(f"{src}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        vocab = _int(data, "vocab_size", src)
        eagle = data.get("eagle_config")
        ids = None
        if eagle is not None:
            if not isinstance(eagle, Mapping):
                raise InvalidFileError(f"{src}: field eagle_config must be an object, got {eagle!r}")
            raw = eagle.get("eagle_aux_hidden_state_layer_ids")
            if raw is not None:
                if (
                    not isinstance(raw, list)
                    or len(raw) != 3
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw)
                ):
                    raise InvalidFileError(
                        f"{src}: field eagle_config.eagle_aux_hidden_state_layer_ids must list three layer ids, got {raw!r}"
                    )
                ids = tuple(raw)
        act = data.get("hidden_act", "silu")
        if act not in ("silu", "gelu", "relu"):
            raise InvalidFileError(f"{src}: field hidden_act {act!r} is not one of silu, gelu, relu")
        return cls(
            hidden_size=hidden,
            intermediate_size=_int(data, "intermediate_size", src),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            draft_vocab_size=_int(data, "draft_vocab_size", src, vocab),
            target_hidden_size=_int(data, "target_hidden_size", src, hidden),
            rms_norm_eps=_float(data, "rms_norm_eps", src, 1e-6),
            hidden_act=act,
            attention_bias=bool(data.get("attention_bias", False)),
            mlp_bias=bool(data.get("mlp_bias", False)),
            norm_before_residual=bool(data.get("norm_before_residual", False)),
            feature_layer_ids=ids,
            max_position_embeddings=_int(data, "max_position_embeddings", src, 2048),
            rope_parameters=_rope(data),
        )

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` object in the SafeAILab / SpecForge layout that :meth:`from_dict` reads back."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "norm_before_residual": self.norm_before_residual,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_parameters["rope_theta"],
        }
        scaling = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
        out["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        if self.feature_layer_ids is not None:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layer_ids)}
        return out

    def feature_layers_for(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layer ids (outputs) this drafter reads from an ``num_target_layers``-layer target."""
        return self.feature_layer_ids if self.feature_layer_ids is not None else default_feature_layers(num_target_layers)


def check_positive(name: str, value: object) -> int:
    """``value`` as an option that must be an int >= 1 (:class:`InvalidInputError` naming it otherwise)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
    return value
