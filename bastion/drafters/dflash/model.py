"""The DFlash block-diffusion draft network (its config lives in :mod:`.config`, checkpoint reading in
:mod:`.checkpoint`; :meth:`DFlashDraftModel.save_pretrained` / ``from_pretrained`` use both).

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

    from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel
    from bastion.training.blocks import make_training_blocks

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

from pathlib import Path

import torch
from attrs import field, frozen
from torch import nn

from bastion.contract.errors import CheckpointMismatchError, InvalidInputError
from bastion.utils.files import read_json_object
from bastion.drafters.dflash.checkpoint import load_dflash_state_dict, read_weight_shapes, resolve_checkpoint_dir
from bastion.drafters.dflash.config import _ACTIVATIONS, CONFIG_NAME, WEIGHTS_NAME, DFlashConfig
from bastion.drafters.dflash.decode import DecodePlan, decode_layers
from bastion.drafters.dflash.fused import FusedLinears
from bastion.drafters.dflash.ops import grouped_attention, signed_sin
from bastion.drafters.network import DraftNetwork, RMSNorm, rope_inv_freq

__all__ = ["DFlashDraftModel", "ContextKV", "expected_weight_shapes"]


class RotaryEmbedding(nn.Module):
    """cos / sin tables of rotary position embedding at arbitrary integer positions."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(config, "DFlash")
        # kept in fp32 outside the module's buffers, so casting the model to bf16 never rounds it
        self.inv_freq = inv_freq.float()  # [D / 2]
        self._per_device: dict[torch.device, torch.Tensor] = {}
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.scale = scale

    def _freqs_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._per_device:
            self._per_device[device] = self.inv_freq.to(device)
        return self._per_device[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self._freqs_on(positions.device)  # [..., S, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [..., S, D]
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)

    def span(
        self, start: int, length: int, dtype: torch.dtype, device: torch.device, *, signed: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` at the contiguous positions ``start .. start + length - 1`` -> two [1, length, D],
        sliced from a table of every position so far (per device and dtype, grown by doubling): the same
        values, without the per-step trigonometry. ``signed``: the sin table as :func:`signed_sin` gives it."""
        end = start + length
        table = self._tables.get((device, dtype))
        if table is None or table[0].shape[0] < end:
            size = max(256, 1 << (end - 1).bit_length())
            cos, sin = self(torch.arange(size, device=device), dtype)  # two [size, D]
            table = self._tables[(device, dtype)] = (cos, sin, signed_sin(sin))
        return table[0][None, start:end], table[2 if signed else 1][None, start:end]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, h, S, D]; cos/sin [N, S, D]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


@frozen
class ContextKV:
    """Per-layer keys/values of context positions (rope applied): what an inference cache stores.

    ``tail`` > 0 marks preallocated storage: each tensor holds ``C + tail`` slots of which the last
    ``tail`` are scratch. A forward whose block fits there writes the block's keys/values into those
    slots in place and attends over the first ``C + S``, so no step concatenates or copies the context.
    """

    keys: tuple[torch.Tensor, ...] = field(converter=tuple, eq=False)  # per layer [N, h_kv, C (+ tail), D]
    values: tuple[torch.Tensor, ...] = field(converter=tuple, eq=False)  # per layer [N, h_kv, C (+ tail), D]
    tail: int = 0

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) - self.tail if self.keys else 0

    def without_tail(self) -> "ContextKV":
        if not self.tail:
            return self
        c = self.length
        return ContextKV(tuple(k[:, :, :c] for k in self.keys), tuple(v[:, :, :c] for v in self.values))

    def append(self, other: "ContextKV") -> "ContextKV":
        if not self.keys:
            return other
        if self.tail:
            return self.without_tail().append(other)
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
        self._qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)  # one product at inference
        self._kv = FusedLinears(self.k_proj, self.v_proj)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of inputs ``x`` [N, S, H] -> two [N, h_kv, S, D]."""
        return self._keys_values(*self._kv(x), cos, sin)

    def _keys_values(
        self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected keys / values [N, S, h_kv * D] -> normed, rotated keys and values, two [N, h_kv, S, D]."""
        n, s, _ = k.shape
        k = self.k_norm(k.view(n, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = v.view(n, s, self.n_kv, self.head_dim).transpose(1, 2)
        return _apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,  # [N, S, H] block hidden states
        cos: torch.Tensor,  # [N, S, D] at block positions
        sin: torch.Tensor,
        ctx_k: torch.Tensor,  # [Nc, h_kv, C + tail, D], Nc in {1, N}
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,  # [N, 1, S, C + S] bool (True = visible) or None
        tail: int = 0,  # scratch slots after the C context slots of ctx_k / ctx_v (left out)
    ) -> torch.Tensor:
        n, s, _ = x.shape
        q, k_lin, v_lin = self._qkv(x)  # [N, S, h * D], two [N, S, h_kv * D]
        q = self.q_norm(q.view(n, s, self.n_heads, self.head_dim)).transpose(1, 2)  # [N, h, S, D]
        q = _apply_rope(q, cos, sin)
        k_blk, v_blk = self._keys_values(k_lin, v_lin, cos, sin)  # [N, h_kv, S, D]
        c = ctx_k.shape[2] - tail
        k = torch.cat([ctx_k[:, :, :c].expand(n, -1, -1, -1), k_blk], dim=2)  # [N, h_kv, C + S, D]
        v = torch.cat([ctx_v[:, :, :c].expand(n, -1, -1, -1), v_blk], dim=2)
        out = grouped_attention(q, k, v, mask, self.head_dim**-0.5)  # [N, h, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(n, s, self.n_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = _ACTIVATIONS[config.hidden_act]
        self._gate_up = FusedLinears(self.gate_proj, self.up_proj)  # one product at inference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x)
        return self.down_proj(self.act(gate) * up)


class DFlashLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, tail=0):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask, tail)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(DraftNetwork):
    """The DFlash draft network (no embedding, no lm head; both come from the target)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self._plan: DecodePlan | None = None  # the decode pass's gathered weights (see decode.py)
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

    # ---------------------------------------------------------------- computation
    def project_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features ``[.., C, F]`` -> context vectors ``[.., C, H]`` (``fc`` then ``hidden_norm``)."""
        self._check_feature_width(target_features)
        return self.hidden_norm(self.fc(target_features.to(self.dtype)))

    def _check_feature_width(self, target_features: torch.Tensor) -> None:
        if target_features.shape[-1] != self.config.feature_size:
            raise InvalidInputError(
                f"target features have width {target_features.shape[-1]}, expected {self.config.feature_size} "
                f"({len(self.config.target_layer_ids)} layers x hidden {self.config.hidden_size})"
            )

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
        block_positions: torch.Tensor | int,
        target_features: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        past_context: ContextKV | None = None,
        fresh_context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final (normed) hidden states ``[N, S, H]`` of blocks.

        ``block_embeds`` [N, S, H]: target embeddings of the block tokens; ``block_positions`` [N, S] or
        [S], or an int: the first of S contiguous positions shared by every block (rotary tables are then
        read from a cached table). Context = ``past_context`` (cached keys/values, shared) followed by ``target_features``
        [Nc, C, F] (Nc = 1 shares one context across all blocks) at ``context_positions`` [Nc, C] or [C]
        (default: right after ``past_context``). ``context_mask`` [N, C_total] or [N, S, C_total] bool marks
        visible context positions (default: all). The block always sees all of itself.

        ``fresh_context`` [1, P, F] (one block, no ``target_features`` or ``context_mask``): context
        features right after ``past_context``, projected in this same pass; ``past_context`` must have
        at least P + S scratch slots, and the first P of them receive those positions' keys/values (the
        caller then counts them as cached). Same result as caching them first, fewer operations.
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
        if fresh_context is not None:
            return self._forward_fresh(x, block_positions, fresh_context, ctx, target_features, context_mask)
        if n == 1 and ctx.tail >= s and context_mask is None and ctx.keys[0].shape[0] == 1 and not torch.is_grad_enabled():
            return self._decode(x, block_positions, None, ctx)  # a decode step: the lean pass
        if isinstance(block_positions, int):  # one contiguous block shared by every row
            cos, sin = self.rotary.span(block_positions, s, x.dtype, x.device)  # [1, S, D]
        else:
            cos, sin = self.rotary(_batch_positions(block_positions, n), x.dtype)  # [N, S, D]
        mask = _attention_mask(context_mask, n, s, ctx.length, x.device)
        for layer, k, v in zip(self.layers, ctx.keys, ctx.values):
            x = layer(x, cos, sin, k, v, mask, ctx.tail)
        return self.norm(x)

    def _forward_fresh(
        self,
        x: torch.Tensor,  # [1, S, H]
        block_positions: torch.Tensor | int,
        fresh_context: torch.Tensor,  # [1, P, F] or [P, F]
        ctx: ContextKV,
        target_features: torch.Tensor | None,
        context_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """:meth:`forward` with ``fresh_context`` (see there)."""
        feats = fresh_context[None] if fresh_context.dim() == 2 else fresh_context
        n, s, _ = x.shape
        p = feats.shape[1]
        if n != 1 or feats.shape[0] != 1 or target_features is not None or context_mask is not None:
            raise InvalidInputError("fresh_context takes one block and no target_features or context_mask")
        if not ctx.keys or ctx.tail < p + s:
            raise InvalidInputError(f"fresh_context needs past_context with at least {p + s} scratch slots, got {ctx.tail}")
        self._check_feature_width(feats)
        return self._decode(x, block_positions, feats, ctx)

    def _decode(
        self,
        x: torch.Tensor,  # [1, S, H]
        block_positions: torch.Tensor | int,
        features: torch.Tensor | None,  # [1, P, F] target features of the positions after the cached ones
        ctx: ContextKV,  # cached keys/values with >= P + S scratch slots
    ) -> torch.Tensor:
        """One block over the cached context (and the P positions of ``features``, projected in the
        same pass), through :func:`decode_layers`: the module path's numbers in fewer operations; the P
        positions' keys/values fill the first scratch slots."""
        s, c = x.shape[1], ctx.length
        p = 0 if features is None else features.shape[1]
        if isinstance(block_positions, int) and block_positions == c + p:  # the block right after them
            cos, sin = self.rotary.span(c, p + s, x.dtype, x.device, signed=True)  # [1, P + S, D]
        else:
            block = torch.arange(block_positions, block_positions + s, device=x.device) if isinstance(block_positions, int) else block_positions
            positions = torch.cat([torch.arange(c, c + p, device=x.device), _batch_positions(block, 1)[0].to(x.device)])
            cos, sin = self.rotary(positions[None], x.dtype)  # [1, P + S, D]
            sin = signed_sin(sin)
        self._plan = plan = DecodePlan.current(self, self._plan)
        context = None if features is None else plan.project(features)  # [1, P, H]
        return decode_layers(plan, x, cos[:, None], sin[:, None], context, ctx.keys, ctx.values, c)

    def block_logits(
        self,
        target_features: torch.Tensor | None,
        block_ids: torch.Tensor,
        *,
        embed: nn.Module,
        head: nn.Module,
        block_positions: torch.Tensor | int,
        context_positions: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        past_context: ContextKV | None = None,
        depths: int | None = None,
        fresh_context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[N, B - 1, V]`` for mask slots 1..B-1 of blocks ``block_ids`` [N, B], using the
        target's embedding ``embed`` and lm head ``head`` (see :meth:`forward` for the other arguments).
        ``depths`` (default all): run the head on slots 1..depths only -> ``[N, depths, V]`` (the block
        still attends over all its slots, so those logits are unchanged; the head is most of a draft)."""
        home = block_ids.device  # the target's embedding and head may sit on other devices (device_map)
        emb = embed(block_ids.to(_module_device(embed, home))).to(home)  # [N, B, H]
        hidden = self(emb, block_positions, target_features, context_positions, context_mask, past_context, fresh_context)
        head_dtype = _module_dtype(head, hidden.dtype)
        end = hidden.shape[1] if depths is None else 1 + max(1, min(int(depths), hidden.shape[1] - 1))
        rows = hidden[:, 1:end].to(device=_module_device(head, home), dtype=head_dtype)  # [N, depths, H]
        # the head runs on a 2-D input: CPU kernels take a much slower path for 3-D bfloat16 inputs
        return head(rows.reshape(-1, rows.shape[-1])).view(rows.shape[0], rows.shape[1], -1)

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
        dtype). Missing, unexpected or wrongly shaped weights raise :class:`CheckpointMismatchError` (an
        ``InvalidFileError`` and an ``IncompatibleComponentsError``) listing them; integer or bool weights
        raise :class:`InvalidFileError` naming the file and tensor; all before a module is built."""
        directory = resolve_checkpoint_dir(path)
        config_path = directory / CONFIG_NAME
        raw = read_json_object(config_path)
        # everything below is checked against the weights' headers before a single module is built
        shapes = read_weight_shapes(directory)
        _check_layer_count(raw, shapes, path)
        config = DFlashConfig.from_file_dict(raw, config_path)
        _check_weight_shapes(expected_weight_shapes(config), shapes, path)
        with torch.device("meta"):
            model = cls(config)
        state = load_dflash_state_dict(directory)
        model = model.to_empty(device=device).to(dtype=dtype or state["fc.weight"].dtype)
        model.load_state_dict(state, strict=True)
        return model.eval()


def expected_weight_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the weights a :class:`DFlashDraftModel` with ``config`` holds, computed from
    the config alone (nothing is built), in ``state_dict`` order."""
    hid, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    bias = config.attention_bias
    out: dict[str, tuple[int, ...]] = {}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        for proj, rows, cols in (("q_proj", q, hid), ("k_proj", kv, hid), ("v_proj", kv, hid), ("o_proj", hid, q)):
            out[f"{p}self_attn.{proj}.weight"] = (rows, cols)
            if bias:
                out[f"{p}self_attn.{proj}.bias"] = (rows,)
        out[f"{p}self_attn.q_norm.weight"] = (d,)
        out[f"{p}self_attn.k_norm.weight"] = (d,)
        out[f"{p}mlp.gate_proj.weight"] = (inter, hid)
        out[f"{p}mlp.up_proj.weight"] = (inter, hid)
        out[f"{p}mlp.down_proj.weight"] = (hid, inter)
        out[f"{p}input_layernorm.weight"] = (hid,)
        out[f"{p}post_attention_layernorm.weight"] = (hid,)
    out["norm.weight"] = (hid,)
    out["fc.weight"] = (hid, config.feature_size)
    out["hidden_norm.weight"] = (hid,)
    return out


def _check_layer_count(raw: dict, shapes: dict[str, tuple[int, ...]], path: object) -> None:
    """The config's ``num_hidden_layers`` must equal the layers the weights hold (checked first: an
    absurd count must never reach the code that builds layers)."""
    stored = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()}
    count = raw.get("num_hidden_layers")
    if isinstance(count, int) and not isinstance(count, bool) and count != len(stored):
        raise CheckpointMismatchError(
            f"DFlash checkpoint {path}: config.json says num_hidden_layers={count} but the weights hold "
            f"{len(stored)} layers"
        )


def _check_weight_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], path: object) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing weights: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected weights: {', '.join(unexpected)}")
        raise CheckpointMismatchError(f"DFlash checkpoint {path} does not match its config; " + "; ".join(parts))
    wrong = [f"{k}: checkpoint {found[k]} vs config {shape}" for k, shape in expected.items() if found[k] != shape]
    if wrong:
        raise CheckpointMismatchError(f"DFlash checkpoint {path} has weights of the wrong shape: " + "; ".join(wrong))


def _weight_of(module: nn.Module) -> torch.Tensor | None:
    """The module's first parameter: its ``weight`` where it has one (an embedding, a linear head),
    read without walking its parameters."""
    weight = module.__dict__.get("_parameters", {}).get("weight")
    return weight if weight is not None else next(module.parameters(), None)


def _module_device(module: nn.Module, default: torch.device) -> torch.device:
    weight = _weight_of(module)
    return default if weight is None else weight.device


def _module_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    weight = _weight_of(module)
    return default if weight is None else weight.dtype


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
