"""The ``full`` budget controller: verify every node the tree builder produced.

The baseline for builders whose shape is the method (``chain`` is DFlash's top-1 chain, ``static`` an
EAGLE-style fixed tree); with a budget-free builder it verifies the whole tree every step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import BudgetController, BudgetDecision, LatencyModel

__all__ = ["FullTreeController", "widest_tree"]


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
        return BudgetDecision(widest_tree(log_scores))

    def __repr__(self) -> str:
        return "FullTreeController()"


def widest_tree(log_scores: Sequence[torch.Tensor]) -> int:
    """The node count of the largest row of ``log_scores`` (each row [n_i], checked: a non-empty list
    of non-empty 1-D tensors)."""
    if not log_scores:
        raise InvalidInputError("decide_width needs at least one row of log_scores")
    for row in log_scores:
        if not isinstance(row, torch.Tensor) or row.dim() != 1 or row.shape[0] < 1:
            raise InvalidInputError("log_scores must be non-empty 1-D tensors (a tree has at least its root)")
    return max(int(row.shape[0]) for row in log_scores)
