"""Example budget controller: verify every node whose path is likely enough to be accepted."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from bastion.core import BudgetController, BudgetDecision, InvalidInputError, LatencyModel


class ThresholdController(BudgetController):
    """Verify the nodes whose path probability rho (``exp(log_scores)``: the chance the target accepts
    the whole path, as the drafter estimates it) is at least ``threshold``, at most ``max_budget``.

    The tree builder lists nodes so that every prefix is a tree, and a best-first builder in order of
    non-increasing rho, so the first ``n`` nodes are the ones to keep: ``n`` counts the leading nodes
    above the threshold. It ignores the latency model (the built-in ``bastion`` controller weighs the
    predicted speedup instead).

    Written against bastion's batch-first controller interface: :meth:`decide_width` sees every row of
    the step (a single sequence is one row) and gives the batch the widest row's count, so no row
    verifies fewer of its likely nodes than it would alone."""

    def __init__(self, threshold: float = 0.1, max_budget: int = 64) -> None:
        if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
            raise InvalidInputError(f"threshold must be a probability in [0, 1], got {threshold!r}")
        if isinstance(max_budget, bool) or not isinstance(max_budget, int) or max_budget < 1:
            raise InvalidInputError(f"max_budget must be an int >= 1, got {max_budget!r}")
        self.threshold = float(threshold)
        self.max_budget = max_budget

    def decide_width(
        self,
        log_scores: Sequence[torch.Tensor],
        context_lens: Sequence[int],
        latency: LatencyModel,
        overhead_s: float,
        draft_s: float,
    ) -> BudgetDecision:
        if not log_scores:
            raise InvalidInputError("decide_width() needs at least one row of log_scores")
        return BudgetDecision(max(self._leading(row) for row in log_scores))

    def _leading(self, log_scores: torch.Tensor) -> int:
        """How many leading nodes of one row are above the threshold (at most ``max_budget``)."""
        if not isinstance(log_scores, torch.Tensor) or log_scores.dim() != 1 or log_scores.numel() == 0:
            raise InvalidInputError("log_scores must be a non-empty 1-D tensor (the root first)")
        cut = math.log(self.threshold) if self.threshold > 0.0 else -math.inf
        above = (log_scores.detach().cpu() >= cut).tolist()
        n = 1  # the root is always verified: it is the token the target already committed
        while n < len(above) and above[n]:
            n += 1
        return int(min(n, self.max_budget, log_scores.numel()))

    def __repr__(self) -> str:
        return f"ThresholdController(threshold={self.threshold}, max_budget={self.max_budget})"
