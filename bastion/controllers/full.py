"""The ``full`` budget controller: verify every node the tree builder produced.

The baseline for builders whose shape is the method (``chain`` is DFlash's top-1 chain, ``static`` an
EAGLE-style fixed tree); with a budget-free builder it verifies the whole tree every step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import BudgetController, BudgetDecision, LatencyModel

__all__ = ["FullTreeController", "tree_size"]


class FullTreeController(BudgetController):
    """Verifies every row's whole tree: the width is the largest tree's size."""

    def decide_width(
        self,
        log_scores: Sequence[torch.Tensor],
        context_lens: Sequence[int],
        latency: LatencyModel,
        overhead_s: float,
        draft_s: float,
    ) -> BudgetDecision:
        return BudgetDecision(max(tree_size(s) for s in _rows(log_scores)))

    def __repr__(self) -> str:
        return "FullTreeController()"


def tree_size(log_scores: object) -> int:
    """The node count of one row's ``log_scores`` [n] (checked: a non-empty 1-D tensor)."""
    if not isinstance(log_scores, torch.Tensor) or log_scores.dim() != 1 or log_scores.shape[0] < 1:
        raise InvalidInputError("log_scores must be a non-empty 1-D tensor (a tree has at least its root)")
    return int(log_scores.shape[0])


def _rows(log_scores: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    if not log_scores:
        raise InvalidInputError("decide_width needs at least one row of log_scores")
    return log_scores
