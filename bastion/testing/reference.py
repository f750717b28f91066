"""Reference decoders that use no bastion code: oracles for lossless tests."""

from __future__ import annotations

import torch

__all__ = ["greedy_reference"]


def greedy_reference(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    """The model's own greedy continuation of ``prompt`` [1, L]: one full forward per token, no cache."""
    ids = prompt.clone()
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()
