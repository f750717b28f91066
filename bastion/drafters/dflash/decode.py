"""The draft network's decode pass: one block of one sequence over the cached context, in the fewest
operations a pass needs.

Every draft of the decode loop has the same shape: one block ``[1, S]`` right after the committed
context, preceded by the P >= 0 context positions committed since the last draft, with the context's
keys and values in per-layer storage that has scratch slots after them, and no mask. The module path
(training, batches, masks) runs each layer as its modules: a few dozen small operations, module calls
and attribute lookups per layer, and on a small drafter on a CPU each costs a few microseconds, about as
much as the arithmetic. This pass computes the same function with fewer of them:

- the weights every layer reads, gathered once into a :class:`DecodePlan` (rebuilt when any of them
  changes);
- one product for the query, key and value projections of the P + S rows (the concatenated weight of
  :class:`~bastion.drafters.dflash.fused.FusedLinears`, shared with the module path);
- one norm for the query and key heads together (their norm weights side by side, one row per head)
  and one rotation for both (``x * cos + x.roll(D / 2) * signed_sin``);
- the P context rows' and the block's keys and values written into the scratch slots in place, and
  attention over a view of context plus block;
- one product for the MLP's gate and up projections.

It runs at inference only; the module path stays the reference it is tested against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bastion.drafters.dflash.fused import tensor_version
from bastion.drafters.dflash.ops import grouped_attention, rms_norm

if TYPE_CHECKING:
    from bastion.drafters.dflash.fused import FusedLinears

__all__ = ["DecodePlan", "decode_layers"]


class _Product(NamedTuple):
    """Linear layers that read one input, answered side by side: one packed product, or each layer."""

    weight: torch.Tensor | None  # [sum out, in] (None: the layers one by one)
    bias: torch.Tensor | None
    linears: tuple[nn.Linear, ...]

    @classmethod
    def of(cls, fused: "FusedLinears") -> "_Product":
        packed = fused.pack()
        return cls(None, None, fused.linears) if packed is None else cls(packed[0], packed[1], fused.linears)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return torch.cat([lin(x) for lin in self.linears], dim=-1)
        return F.linear(x, self.weight, self.bias)


class _Layer(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    inter: int  # MLP width
    eps: float
    norm_in: torch.Tensor  # [H]
    qkv: _Product  # -> [.., (h + 2 h_kv) D]
    qk_norm: torch.Tensor  # [h + h_kv, D]
    o_weight: torch.Tensor  # [H, h D]
    o_bias: torch.Tensor | None
    norm_post: torch.Tensor  # [H]
    gate_up: _Product  # -> [.., 2 I]
    act: Callable[[torch.Tensor], torch.Tensor]
    down_weight: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None


class DecodePlan:
    """What the decode pass reads from a :class:`DFlashDraftModel`, gathered once: per layer its sizes,
    norm weights and (packed) projection weights. :meth:`current` rebuilds it whenever a weight changed
    in place (an optimizer step, ``load_state_dict``), moved (``.to``) or was assigned anew
    (``lin.weight = Parameter(...)``). Like the module path's fused products, it reads the layers the
    model was built with: replace a weight, not a module."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._sources = [(m._parameters, name) for m in model.modules() for name, p in m._parameters.items() if p is not None]
        self._tensors = [params[name] for params, name in self._sources]
        self._state = [(t.data_ptr(), tensor_version(t)) for t in self._tensors]
        self.layers = tuple(_gather(layer) for layer in model.layers)
        self.final_norm, self.final_eps = model.norm.weight, model.norm.eps
        self._fc_weight, self._fc_bias = model.fc.weight, model.fc.bias
        self._hidden_norm, self._hidden_eps = model.hidden_norm.weight, model.hidden_norm.eps

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[.., F]`` -> context vectors ``[.., H]`` (the model's ``fc`` then ``hidden_norm``)."""
        vectors = F.linear(features.to(self._fc_weight.dtype), self._fc_weight, self._fc_bias)
        return rms_norm(vectors, self._hidden_norm, self._hidden_eps)

    def matches(self) -> bool:
        """Whether every weight is still the one gathered, with the same storage and version."""
        for (params, name), t, (ptr, version) in zip(self._sources, self._tensors, self._state):
            if params.get(name) is not t or t.data_ptr() != ptr or tensor_version(t) != version:
                return False
        return True

    @classmethod
    def current(cls, model: torch.nn.Module, plan: "DecodePlan | None") -> "DecodePlan":
        """``plan`` if it still matches ``model``'s weights, else a new one."""
        return plan if plan is not None and plan.matches() else cls(model)


def _gather(layer: nn.Module) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    with torch.no_grad():
        qk_norm = torch.cat([attn.q_norm.weight.expand(attn.n_heads, -1), attn.k_norm.weight.expand(attn.n_kv, -1)])
    return _Layer(
        attn.n_heads, attn.n_kv, attn.head_dim, mlp.gate_proj.out_features, layer.input_layernorm.eps,
        layer.input_layernorm.weight, _Product.of(attn._qkv), qk_norm, attn.o_proj.weight, attn.o_proj.bias,
        layer.post_attention_layernorm.weight, _Product.of(mlp._gate_up), mlp.act, mlp.down_proj.weight, mlp.down_proj.bias,
    )


def decode_layers(
    plan: DecodePlan,
    x: torch.Tensor,  # [1, S, H] block hidden states
    cos: torch.Tensor,  # [1, 1, P + S, D] at the P context positions, then the block's
    sin_signed: torch.Tensor,  # [1, 1, P + S, D] (see ops.signed_sin)
    context: torch.Tensor | None,  # [1, P, H] projected context vectors not cached yet (None: P = 0)
    keys: Sequence[torch.Tensor],  # per layer [1, h_kv, C + tail, D], tail >= P + S
    values: Sequence[torch.Tensor],
    committed: int,  # C: the cached context positions
) -> torch.Tensor:
    """Final (normed) hidden states ``[1, S, H]``; the P context positions' keys/values land in slots
    ``C .. C + P - 1`` of ``keys`` / ``values``, the block's after them."""
    s = x.shape[1]
    p = 0 if context is None else context.shape[1]
    end = committed + p + s
    for lay, ck, cv in zip(plan.layers, keys, values):
        h, hk, d, eps = lay.heads, lay.kv_heads, lay.head_dim, lay.eps
        width = (h + hk) * d
        hs = rms_norm(x, lay.norm_in, eps)
        qkv = lay.qkv(hs if context is None else torch.cat([context, hs], dim=1))  # [1, P + S, (h + 2 h_kv) D]
        qk = rms_norm(qkv[..., :width].unflatten(-1, (h + hk, d)), lay.qk_norm, eps).transpose(1, 2)  # [1, h + h_kv, P + S, D]
        qk = qk * cos + qk.roll(d // 2, -1) * sin_signed
        ck[:, :, committed:end] = qk[:, h:]
        cv[:, :, committed:end] = qkv[..., width:].unflatten(-1, (hk, d)).transpose(1, 2)
        out = grouped_attention(qk[:, :h, p:], ck[:, :, :end], cv[:, :, :end], None, d**-0.5)  # [1, h, S, D]
        x = x + F.linear(out.transpose(1, 2).reshape(1, s, h * d), lay.o_weight, lay.o_bias)
        gate_up = lay.gate_up(rms_norm(x, lay.norm_post, eps))  # [1, S, 2 I]
        x = x + F.linear(lay.act(gate_up[..., : lay.inter]) * gate_up[..., lay.inter :], lay.down_weight, lay.down_bias)
    return rms_norm(x, plan.final_norm, plan.final_eps)
