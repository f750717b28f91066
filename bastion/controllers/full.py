"""The ``full`` budget controller: verify every node the tree builder produced.

The baseline for builders whose shape is the method (``chain`` is DFlash's top-1 chain, ``static`` an
EAGLE-style fixed tree); with a budget-free builder it verifies the whole tree every step.
"""

from __future__ import annotations

import torch

from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import BudgetController, LatencyModel

__all__ = ["FullTreeController"]


class FullTreeController(BudgetController):
    """Returns ``n_max``: the whole tree."""

    def choose(self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float) -> int:
        if not isinstance(log_scores, torch.Tensor) or log_scores.dim() != 1 or log_scores.shape[0] < 1:
            raise InvalidInputError("log_scores must be a non-empty 1-D tensor (a tree has at least its root)")
        return int(log_scores.shape[0])

    def __repr__(self) -> str:
        return "FullTreeController()"
