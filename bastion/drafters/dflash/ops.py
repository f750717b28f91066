"""Tensor operations shared by the draft network's module path (training, batches) and its decode pass."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bastion.drafters.network import rms_norm  # the norm both the module path and the decode pass run

__all__ = ["rms_norm", "grouped_attention", "signed_sin"]


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of ``q`` [N, h, S, D] over ``k`` / ``v`` [N, h_kv, L, D] where query head ``j`` reads
    key head ``j // (h / h_kv)``. The query heads sharing a key head are folded into the query axis
    ([N, h_kv, rep * S, D]), so the keys and values are never repeated or copied."""
    n, h, s, d = q.shape
    rep = h // k.shape[1]
    if rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    qg = q.reshape(n, k.shape[1], rep * s, d)  # [N, h_kv, rep * S, D]
    mg = None if mask is None else mask.repeat(1, 1, rep, 1)  # [N, 1, rep * S, L]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mg, scale=scale)  # [N, h_kv, rep * S, D]
    return out.reshape(n, h, s, d)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """A rotary sin table [..., D] with its first half negated: ``x * cos + x.roll(D / 2, -1) * signed``
    is then the rotation ``x * cos + rotate_half(x) * sin`` (negating a factor is exact)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
