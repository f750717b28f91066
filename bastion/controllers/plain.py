"""The ``plain`` budget controller: never draft (speculation off, on the same engine).

Every step is the target alone verifying the root: one forward, one token. The engine runs no drafter
at all under it (``drafts = False``: no draft features are asked of the target, no draft state is
kept), so it is the speculation-off baseline of ``bastion serve --budget-controller plain``, the bench's
``ar`` method and ``--budget-controller plain`` anywhere else.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import BatchStepCosts, BudgetController, LatencyModel

__all__ = ["PlainController"]


class PlainController(BudgetController):
    """Always decodes plainly: :meth:`speculate` is False and the tree size is 1 (the root)."""

    #: the engine skips the drafter entirely under this controller
    drafts = False

    def speculate(self) -> bool:
        return False

    def speculate_batch(self, context_lens: Sequence[int], latency: LatencyModel, costs: BatchStepCosts) -> bool:
        return False

    def choose(self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float) -> int:
        if not isinstance(log_scores, torch.Tensor) or log_scores.dim() != 1 or log_scores.shape[0] < 1:
            raise InvalidInputError("log_scores must be a non-empty 1-D tensor (a tree has at least its root)")
        return 1

    def __repr__(self) -> str:
        return "PlainController()"
