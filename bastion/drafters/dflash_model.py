"""The DFlash block-diffusion draft network, its config, and checkpoint I/O in the DFlash format.

A DFlash drafter is a small stack of Qwen3-style decoder layers that never embeds tokens or computes
logits itself: it borrows the target's token embedding and lm head. What it reads from the target is a
*feature* per committed position: the concatenation of the outputs of the target decoder layers
``target_layer_ids`` (Hugging Face ``hidden_states[i + 1]``), ``[.., F]`` with
``F = len(target_layer_ids) * hidden_size``. Those features are projected (``fc``) and normalised
(``hidden_norm``) into context vectors ``[.., H]``, and every draft layer uses them as extra keys and
values (through its own ``k_proj`` / ``v_proj``). A block ``[anchor token, MASK x (B - 1)]`` at positions
``p, p + 1, .., p + B - 1`` attends bidirectionally to itself and to the visible context; slot ``j``
(``j >= 1``) predicts the token at position ``p + j``.

Checkpoint format (what ``z-lab/*-DFlash-*`` repositories hold, and what :meth:`save_pretrained` writes):

* ``config.json``: a Qwen3 config (``hidden_size``, ``num_hidden_layers``, heads, ``head_dim``,
  ``intermediate_size``, ``rms_norm_eps``, rope settings, ``vocab_size``...) plus top-level
  ``block_size`` and ``num_target_layers`` and ``dflash_config = {"mask_token_id", "target_layer_ids"}``.
* ``model.safetensors`` (or shards with ``model.safetensors.index.json``): ``fc.weight``,
  ``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
  mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm}.weight``. No embedding, no lm head.

Training-facing API
-------------------
Build a fresh drafter for a target (an HF config object or a dict)::

    from bastion.drafters.dflash_model import DFlashConfig, DFlashDraftModel, make_training_blocks

    cfg = DFlashConfig.for_target(target.config, num_layers=2, block_size=8,
                                  target_layer_ids=(0, 2, 4), mask_token_id=mask_id)
    model = DFlashDraftModel(cfg)            # random init; model.feature_layers == cfg.target_layer_ids

Target features for training come from the frozen target: ``out = target(ids, output_hidden_states=True)``
then ``feats = torch.cat([out.hidden_states[i + 1] for i in cfg.target_layer_ids], -1)  # [1, C, F]``.
Teacher-forced blocks for a batch of anchor positions of one sequence ``ids`` [C]::

    blocks = make_training_blocks(ids, anchors, cfg.block_size, cfg.mask_token_id)
    logits = model.block_logits(
        feats,                                # [1 or N, C, F] target features (shared or per block)
        blocks.block_ids,                     # [N, B]  [anchor, MASK x (B-1)]
        embed=target.get_input_embeddings(), head=target.get_output_embeddings(),
        block_positions=blocks.block_positions,       # [N, B]
        context_mask=blocks.context_mask,              # [N, C]  position < anchor
    )                                         # [N, B - 1, V]: slots 1..B-1
    loss = F.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), ignore_index=-100)

``forward(...)`` is the same computation returning final (normed) hidden states ``[N, B, H]`` for callers
that apply the head themselves (e.g. chunked losses). Persist with ``model.save_pretrained(dir)`` and load
with ``DFlashDraftModel.from_pretrained(dir_or_hub_id)``; both use the format above, so checkpoints
round-trip with other DFlash-compatible tools.

Inference uses :meth:`DFlashDraftModel.context_kv` to turn committed features into per-layer keys/values
once, and passes them back as ``past_context`` so each step only projects the newly committed positions
(see :class:`bastion.drafters.dflash.DFlashDrafter`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F
from attrs import field, frozen
from torch import nn

from bastion.core.errors import IncompatibleComponentsError, InvalidInputError

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "ContextKV",
    "TrainingBlocks",
    "make_training_blocks",
    "default_target_layer_ids",
    "load_dflash_state_dict",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ARCHITECTURE = "DFlashDraftModel"

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


def _positive(_inst: object, attribute: attrs.Attribute, value: int) -> None:
    if not (isinstance(value, int) and value >= 1):
        raise InvalidInputError(f"DFlashConfig.{attribute.name} must be an int >= 1, got {value!r}")


def _to_int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@frozen
class DFlashConfig:
    """Architecture of a DFlash drafter (the fields of a DFlash ``config.json``)."""

    hidden_size: int = field(validator=_positive)
    intermediate_size: int = field(validator=_positive)
    num_hidden_layers: int = field(validator=_positive)
    num_attention_heads: int = field(validator=_positive)
    num_key_value_heads: int = field(validator=_positive)
    head_dim: int = field(validator=_positive)
    vocab_size: int = field(validator=_positive)
    block_size: int = field(validator=_positive)
    num_target_layers: int = field(validator=_positive)
    target_layer_ids: tuple[int, ...] = field(converter=_to_int_tuple)
    mask_token_id: int = field(converter=int)
    rms_norm_eps: float = field(default=1e-6, converter=float)
    #: normalised rope settings: {"rope_type": ..., "rope_theta": ..., plus type-specific keys}
    rope_parameters: Mapping[str, Any] = field(
        factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}, converter=dict
    )
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = field(default=40960, validator=_positive)
    #: other config.json keys (dtype, token ids, auto_map...), written back unchanged on save
    extra: Mapping[str, Any] = field(factory=dict, converter=dict, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.block_size < 2:
            raise InvalidInputError(f"DFlashConfig.block_size must be >= 2 (anchor + masks), got {self.block_size}")
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
        get = (lambda k, d=None: target_config.get(k, d)) if isinstance(target_config, Mapping) else (
            lambda k, d=None: getattr(target_config, k, d)
        )
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        n_target = int(get("num_hidden_layers"))
        vocab = int(get("vocab_size"))
        layer_ids = tuple(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(n_target, num_layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or get("intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            vocab_size=vocab,
            block_size=block_size,
            num_target_layers=n_target,
            target_layer_ids=layer_ids,
            mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6) or 1e-6),
            rope_parameters=_rope_from_dict(_config_as_dict(target_config)),
            hidden_act=str(get("hidden_act", "silu") or "silu"),
            max_position_embeddings=int(get("max_position_embeddings", 40960) or 40960),
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DFlashConfig":
        """Parse a DFlash ``config.json`` dict. Missing required keys raise :class:`InvalidInputError`
        naming them."""
        data = dict(data)
        dflash = dict(data.get("dflash_config") or {})
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
        layer_types = data.get("layer_types") or []
        if data.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise InvalidInputError("DFlash drafters with sliding-window attention layers are not supported")
        heads = int(data["num_attention_heads"])
        n_layers = int(data["num_hidden_layers"])
        layer_ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        if layer_ids is None:
            layer_ids = default_target_layer_ids(int(data["num_target_layers"]), n_layers)
        return cls(
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
            vocab_size=int(data["vocab_size"]),
            block_size=int(data["block_size"]),
            num_target_layers=int(data["num_target_layers"]),
            target_layer_ids=layer_ids,
            mask_token_id=int(mask_id),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_parameters=_rope_from_dict(data),
            hidden_act=str(data.get("hidden_act", "silu")),
            attention_bias=bool(data.get("attention_bias", False)),
            max_position_embeddings=int(data.get("max_position_embeddings", 40960)),
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
        return cls.from_dict(json.loads((directory / CONFIG_NAME).read_text()))

    def save_pretrained(self, path: str | Path) -> Path:
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return directory


def _config_as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return dict(vars(config))


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
class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight (Qwen3 convention)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos / sin tables of rotary position embedding at arbitrary integer positions."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        with torch.device("cpu"):
            inv_freq, scale = _rope_inv_freq(config)
        # kept in fp32 outside the module's buffers, so casting the model to bf16 never rounds it
        self.inv_freq = inv_freq.float()  # [D / 2]
        self._per_device: dict[torch.device, torch.Tensor] = {}
        self.scale = scale

    def _freqs_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._per_device:
            self._per_device[device] = self.inv_freq.to(device)
        return self._per_device[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self._freqs_on(positions.device)  # [..., S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., S, D]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def _rope_inv_freq(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    rope = dict(config.rope_parameters)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        dim = config.head_dim
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if kind == "dynamic":
        raise InvalidInputError("dynamic rope scaling is not supported by the DFlash drafter")
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise InvalidInputError(f"unknown rope_type {kind!r}")
    hf = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=rope,
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, None)
    return inv_freq.float(), float(scale)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, h, S, D]; cos/sin [N, S, D]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@frozen
class ContextKV:
    """Per-layer keys/values of context positions (rope applied): what an inference cache stores."""

    keys: tuple[torch.Tensor, ...] = field(converter=tuple, eq=False)  # per layer [N, h_kv, C, D]
    values: tuple[torch.Tensor, ...] = field(converter=tuple, eq=False)  # per layer [N, h_kv, C, D]

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    def append(self, other: "ContextKV") -> "ContextKV":
        if not self.keys:
            return other
        return ContextKV(
            tuple(torch.cat([a, b], dim=2) for a, b in zip(self.keys, other.keys)),
            tuple(torch.cat([a, b], dim=2) for a, b in zip(self.values, other.values)),
        )


class DFlashAttention(nn.Module):
    """Block queries attend to context keys/values (from projected target features) and to the block's
    own keys/values, with no causal mask inside the block."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, hk, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.n_heads, self.n_kv, self.head_dim = h, hk, d
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, hk * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, hk * d, bias=bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of inputs ``x`` [N, S, H] -> two [N, h_kv, S, D]."""
        n, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, s, self.n_kv, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [N, S, H] block hidden states
        cos: torch.Tensor,  # [N, S, D] at block positions
        sin: torch.Tensor,
        ctx_k: torch.Tensor,  # [Nc, h_kv, C, D], Nc in {1, N}
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,  # [N, 1, S, C + S] bool (True = visible) or None
    ) -> torch.Tensor:
        n, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, s, self.n_heads, self.head_dim)).transpose(1, 2)  # [N, h, S, D]
        q = _apply_rope(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)  # [N, h_kv, S, D]
        k = torch.cat([ctx_k.expand(n, -1, -1, -1), k_blk], dim=2)  # [N, h_kv, C + S, D]
        v = torch.cat([ctx_v.expand(n, -1, -1, -1), v_blk], dim=2)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)  # [N, h, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(n, s, self.n_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


@frozen
class TrainingBlocks:
    """Teacher-forced blocks for a batch of anchors of one sequence (see :func:`make_training_blocks`)."""

    block_ids: torch.Tensor = field(eq=False)  # [N, B] long: [token at anchor, MASK x (B - 1)]
    block_positions: torch.Tensor = field(eq=False)  # [N, B] long: anchor .. anchor + B - 1
    labels: torch.Tensor = field(eq=False)  # [N, B - 1] long: tokens at anchor + 1 .., -100 past the end
    context_mask: torch.Tensor = field(eq=False)  # [N, C] bool: context position < anchor


def make_training_blocks(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> TrainingBlocks:
    """Build ``[anchor, MASK x (B - 1)]`` blocks for anchors (positions into ``input_ids`` [C]) with
    their positions, labels (the true next tokens; ``-100`` beyond the sequence) and the context mask that
    lets each block see the target features of positions strictly before its anchor, exactly what the
    drafter sees at inference (the anchor is the not-yet-verified root)."""
    if input_ids.dim() != 1:
        raise InvalidInputError(f"input_ids must be 1-D [C], got shape {tuple(input_ids.shape)}")
    anchors = anchors.to(device=input_ids.device, dtype=torch.long).reshape(-1)  # [N]
    c = input_ids.shape[0]
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= c):
        raise InvalidInputError(f"anchors must lie in [0, {c})")
    offsets = torch.arange(block_size, device=input_ids.device)  # [B]
    positions = anchors[:, None] + offsets  # [N, B]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, 0] = input_ids[anchors]
    inside = positions[:, 1:] < c  # [N, B - 1]
    labels = torch.where(inside, input_ids[positions[:, 1:].clamp(max=c - 1)], torch.full_like(positions[:, 1:], -100))
    context_mask = torch.arange(c, device=input_ids.device)[None, :] < anchors[:, None]  # [N, C]
    return TrainingBlocks(block_ids, positions, labels, context_mask)


class DFlashDraftModel(nn.Module):
    """The DFlash draft network (no embedding, no lm head; both come from the target)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.reset_parameters()

    # ---------------------------------------------------------------- parameters
    def reset_parameters(self, std: float = 0.02) -> None:
        """Random init (normal linear weights, unit norm weights), as a fresh drafter starts."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    # ---------------------------------------------------------------- computation
    def project_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features ``[.., C, F]`` -> context vectors ``[.., C, H]`` (``fc`` then ``hidden_norm``)."""
        if target_features.shape[-1] != self.config.feature_size:
            raise InvalidInputError(
                f"target features have width {target_features.shape[-1]}, expected {self.config.feature_size} "
                f"({len(self.config.target_layer_ids)} layers x hidden {self.config.hidden_size})"
            )
        return self.hidden_norm(self.fc(target_features.to(self.dtype)))

    def context_kv(self, target_features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Per-layer keys/values for context features ``[N, C, F]`` at ``positions`` [N, C] (or [C])."""
        ctx = self.project_features(target_features)  # [N, C, H]
        positions = _batch_positions(positions, ctx.shape[0])
        cos, sin = self.rotary(positions, ctx.dtype)  # [N, C, D]
        pairs = [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]
        return ContextKV(tuple(k for k, _ in pairs), tuple(v for _, v in pairs))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        target_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        past_context: ContextKV | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states ``[N, S, H]`` of blocks.

        ``block_embeds`` [N, S, H]: target embeddings of the block tokens; ``block_positions`` [N, S] or
        [S]. Context = ``past_context`` (cached keys/values, shared) followed by ``target_features``
        [Nc, C, F] (Nc = 1 shares one context across all blocks) at ``context_positions`` [Nc, C] or [C]
        (default: right after ``past_context``). ``context_mask`` [N, C_total] or [N, S, C_total] bool marks
        visible context positions (default: all). The block always sees all of itself.
        """
        if block_embeds.dim() != 3:
            raise InvalidInputError(f"block_embeds must be [N, S, H], got shape {tuple(block_embeds.shape)}")
        n, s, _ = block_embeds.shape
        x = block_embeds.to(self.dtype)
        ctx = past_context if past_context is not None else ContextKV((), ())
        if target_features is not None:
            if target_features.dim() == 2:
                target_features = target_features[None]
            if context_positions is None:
                context_positions = torch.arange(
                    ctx.length, ctx.length + target_features.shape[1], device=target_features.device
                )
            ctx = ctx.append(self.context_kv(target_features, context_positions))
        if not ctx.keys:
            shape = (1, self.config.num_key_value_heads, 0, self.config.head_dim)
            empty = x.new_zeros(shape)
            ctx = ContextKV((empty,) * len(self.layers), (empty,) * len(self.layers))
        cos, sin = self.rotary(_batch_positions(block_positions, n), x.dtype)  # [N, S, D]
        mask = _attention_mask(context_mask, n, s, ctx.length, x.device)
        for layer, k, v in zip(self.layers, ctx.keys, ctx.values):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x)

    def block_logits(
        self,
        target_features: torch.Tensor | None,
        block_ids: torch.Tensor,
        *,
        embed: nn.Module,
        head: nn.Module,
        block_positions: torch.Tensor,
        context_positions: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        past_context: ContextKV | None = None,
    ) -> torch.Tensor:
        """Logits ``[N, B - 1, V]`` for mask slots 1..B-1 of blocks ``block_ids`` [N, B], using the
        target's embedding ``embed`` and lm head ``head`` (see :meth:`forward` for the other arguments)."""
        emb = embed(block_ids)  # [N, B, H]
        hidden = self(emb, block_positions, target_features, context_positions, context_mask, past_context)
        head_dtype = _module_dtype(head, hidden.dtype)
        return head(hidden[:, 1:].to(head_dtype))

    # ---------------------------------------------------------------- persistence
    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the DFlash checkpoint format."""
        from safetensors.torch import save_file

        directory = self.config.save_pretrained(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
        return directory

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = torch.float32,
    ) -> "DFlashDraftModel":
        """Load a DFlash checkpoint from a local directory or a hub id (``dtype=None`` keeps the stored
        dtype). Missing or unexpected weight keys raise :class:`IncompatibleComponentsError` listing them."""
        directory = resolve_checkpoint_dir(path)
        config = DFlashConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
        with torch.device("meta"):
            model = cls(config)
        state = load_dflash_state_dict(directory)
        expected = set(model.state_dict())
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing weights: {', '.join(missing)}")
            if unexpected:
                parts.append(f"unexpected weights: {', '.join(unexpected)}")
            raise IncompatibleComponentsError(f"DFlash checkpoint {path} does not match its config; " + "; ".join(parts))
        shapes = [
            f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(t.shape)}"
            for k, t in model.state_dict().items()
            if tuple(state[k].shape) != tuple(t.shape)
        ]
        if shapes:
            raise IncompatibleComponentsError(f"DFlash checkpoint {path} has weights of the wrong shape: " + "; ".join(shapes))
        model = model.to_empty(device=device).to(dtype=dtype or state["fc.weight"].dtype)
        model.load_state_dict(state, strict=True)
        return model.eval()


def _module_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    for p in module.parameters():
        return p.dtype
    return default


def _batch_positions(positions: torch.Tensor, n: int) -> torch.Tensor:
    if positions.dim() == 1:
        positions = positions[None]
    if positions.shape[0] not in (1, n):
        raise InvalidInputError(f"positions have batch {positions.shape[0]}, expected 1 or {n}")
    return positions.expand(n, -1) if positions.shape[0] != n else positions


def _attention_mask(
    context_mask: torch.Tensor | None, n: int, s: int, c: int, device: torch.device
) -> torch.Tensor | None:
    """[N, 1, S, C + S] bool: the given context visibility, and the whole block always visible."""
    if context_mask is None:
        return None
    m = context_mask.to(device=device, dtype=torch.bool)
    if m.dim() == 2:
        m = m[:, None, :].expand(-1, s, -1)  # [N, S, C]
    if m.shape[0] == 1 and n > 1:
        m = m.expand(n, -1, -1)
    if tuple(m.shape) != (n, s, c):
        raise InvalidInputError(f"context_mask must be [N, C] or [N, S, C] = [{n}, {s}, {c}], got {tuple(context_mask.shape)}")
    full = torch.cat([m, torch.ones(n, s, s, dtype=torch.bool, device=device)], dim=-1)  # [N, S, C + S]
    return full[:, None]


# ===================================================================== checkpoint files
def resolve_checkpoint_dir(path: str | Path, *, config_only: bool = False) -> Path:
    """A local checkpoint directory for ``path``: itself when it exists, else a hub snapshot."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / CONFIG_NAME).is_file():
            raise InvalidInputError(f"{local} is not a DFlash checkpoint: it has no {CONFIG_NAME}")
        return local
    if local.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        raise InvalidInputError(f"DFlash checkpoint {path} is neither a local directory nor a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on huggingface_hub
        raise InvalidInputError(f"loading {path} from the hub needs huggingface_hub") from exc
    patterns = [CONFIG_NAME] if config_only else [CONFIG_NAME, "*.safetensors", WEIGHTS_INDEX_NAME]
    try:
        return Path(snapshot_download(str(path), allow_patterns=patterns))
    except Exception as exc:
        raise InvalidInputError(f"could not fetch DFlash checkpoint {path!r} from the hub: {exc}") from exc


def load_dflash_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or shards), rotary buffers left out."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise InvalidInputError(f"DFlash checkpoint {directory} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
