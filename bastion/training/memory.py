"""The memory plan of drafter training: what one rank holds, as arithmetic from the shapes.

Data parallel keeps a full copy of everything on every rank. Per rank:

- **target weights**: the frozen target's parameters in its own dtype;
- **drafter states**: float32 weights, gradients and the two AdamW moments, 16 bytes per parameter;
- **target forward** (online features only): the frozen target's hidden states of one sequence, every
  layer's output and the embeddings (``layers + 1`` tensors ``[L, H]`` in the target's dtype; no
  gradient, no KV cache); precomputed features read one sequence's ``[L, F]`` from disk instead;
- **logits**: ``anchors x (block - 1)`` rows over the vocabulary, in the autocast dtype, their float32
  copy for the loss and its float32 gradient (2 + 4 + 4 bytes an entry).

Not counted: the drafter's own activations over its blocks and context, and the allocator's slack; a
measured peak (``torch.cuda.max_memory_allocated``) lies above the plan by about that much.
"""

from __future__ import annotations

import attrs
import torch

from bastion.huggingface.configs import DecoderShape

__all__ = ["MemoryPlan", "memory_plan", "parameter_count"]

GB = 1e9


@attrs.frozen
class MemoryPlan:
    """Bytes per rank, by item (see the module doc)."""

    target_weights: int
    drafter_states: int
    target_forward: int
    logits: int

    @property
    def total(self) -> int:
        return self.target_weights + self.drafter_states + self.target_forward + self.logits

    def gigabytes(self) -> dict[str, float]:
        """Every item and the total in GB (10^9 bytes), rounded to 0.01."""
        items = {**attrs.asdict(self), "total": self.total}
        return {k: round(v / GB, 2) for k, v in items.items()}


def parameter_count(module: torch.nn.Module) -> int:
    """Parameters of ``module`` (tied weights once); works on the meta device."""
    return sum(p.numel() for p in module.parameters())


def memory_plan(
    target_config, target_params: int, drafter_params: int, *, seq_len: int, anchors: int, block_size: int,
    target_bytes: int = 2, online: bool = True,
) -> MemoryPlan:
    """The plan for a target of ``target_config`` (HF config) with ``target_params`` parameters of
    ``target_bytes`` bytes each, a drafter of ``drafter_params`` parameters and block ``block_size``,
    sequences of ``seq_len`` tokens with ``anchors`` blocks each."""
    shape = DecoderShape.from_config(target_config, purpose="the memory plan")
    forward = (shape.num_layers + 1) * seq_len * shape.hidden_size * target_bytes if online else 0
    return MemoryPlan(
        target_weights=target_params * target_bytes,
        drafter_states=drafter_params * 16,
        target_forward=forward,
        logits=anchors * (block_size - 1) * shape.vocab_size * (2 + 4 + 4),
    )
