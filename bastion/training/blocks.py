"""Teacher-forced DFlash training blocks: ``[anchor, MASK x (B - 1)]`` with labels and context masks."""

from __future__ import annotations

import torch
from attrs import field, frozen

from bastion.contract.errors import InvalidInputError

__all__ = ["TrainingBlocks", "make_training_blocks"]


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


