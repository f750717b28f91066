"""The ``plain`` budget controller: never draft (speculation off, on the same engine).

Every step is the target alone verifying the root: one forward, one token. The engine runs no drafter
at all under it (``drafts = False``: no draft features are asked of the target, no draft state is
kept), so it is the speculation-off baseline of ``bastion serve --budget-controller plain``, the bench's
``ar`` method and ``--budget-controller plain`` anywhere else.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bastion.contract.interfaces import BatchStepCosts, BudgetController, BudgetDecision, LatencyModel
from bastion.controllers.full import widest_tree

__all__ = ["PlainController"]


class PlainController(BudgetController):
    """Always decodes plainly: :meth:`speculate_batch` is False and the width is 1 (the root)."""

    #: the engine skips the drafter entirely under this controller
    drafts = False

    def speculate(self) -> bool:
        return False

    def speculate_batch(self, context_lens: Sequence[int], latency: LatencyModel, costs: BatchStepCosts) -> bool:
        return False

    def decide_width(
        self,
        log_scores: Sequence[torch.Tensor],
        context_lens: Sequence[int],
        latency: LatencyModel,
        overhead_s: float,
        draft_s: float,
    ) -> BudgetDecision:
        widest_tree(log_scores)  # checked like any controller's input; the width is always 1
        return BudgetDecision(1)

    def __repr__(self) -> str:
        return "PlainController()"
