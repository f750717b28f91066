"""What the engine's step reports about itself: stage timestamps, what the latency model, the budget
controller and the cost models learn from the step, and the rows' step records.

The step (:mod:`bastion.engine.engine`) reads as the method, draft -> build -> decide -> verify ->
commit, and marks a :class:`StageClock` between stages; after the commit it hands the clock and what
the step produced to the :class:`StepObserver`, the one place where timings turn into feedback and
records. No method here reads the device.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Sequence

import attrs
import torch

from bastion.utils.running import RobustLevel
from bastion.contract.types import StageTimings, StepFeedback, StepRecord

if TYPE_CHECKING:
    from bastion.contract.interfaces import BudgetDecision
    from bastion.contract.tree import Tree
    from bastion.contract.types import Verdict

__all__ = ["StageClock", "StepObserver"]

#: during a run of plain steps, the verify times of steps 1, 2, 4, .. of the run and then one in this
#: many go to the latency model (plain steps all time W = 1; each observation may trigger a refit)
PLAIN_LATENCY_EVERY = 64

#: what a plain step hands the controller for "the verified tree": the root alone, accepted
_ROOT_SCORES = torch.zeros(1)  # [1] log rho of the root
_ROOT_PATH = torch.zeros(1, dtype=torch.long)  # [1] the accepted path: the root


class StageClock:
    """Wall seconds of one step's stages: :meth:`mark` closes the stage running since the last mark."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last = start
        self.seconds: dict[str, float] = {}

    def mark(self, stage: str) -> float:
        """End ``stage`` now (its seconds add up if it is marked twice) -> the time."""
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + (now - self.last)
        self.last = now
        return now

    def __getitem__(self, stage: str) -> float:
        return self.seconds.get(stage, 0.0)

    def timings(self) -> StageTimings:
        return StageTimings(**{k: v for k, v in self.seconds.items() if k in _TIMED})


_TIMED = frozenset(f.name for f in attrs.fields(StageTimings))


class StepObserver:
    """Turns a finished step into what the pipeline's models learn and the rows' records.

    It holds the engine's running statistics across steps: the length of the current run of plain steps
    (their latency is sampled, see :data:`PLAIN_LATENCY_EVERY`) and a robust level of the seconds per
    committed token (what an autoregressive drafter weighs its next depth against)."""

    def __init__(self, pipe: Any, drafts: bool) -> None:
        self.pipe = pipe
        self.drafts = drafts  # whether a controller that may draft hears the plain steps too
        self.plain_steps = 0  # consecutive plain steps so far
        self.per_token = RobustLevel()  # seconds per committed token of a row in a speculative step
        #: rows joined since the last speculative step: the next draft also catches the drafter up on
        #: their prompts (a one-time cost per request, like its prefill), not what a step's drafting costs
        self.joined = False

    # ---------------------------------------------------------------- plain steps
    def plain(self, ctxs: Sequence[int], clock: StageClock, stage: Any) -> list[StepRecord]:
        """A plain step over rows at ``ctxs`` (stages ``controller``, ``verify``, ``commit``) -> each
        row's record (one token each)."""
        pipe = self.pipe
        b = len(ctxs)
        verify_s = clock["verify"]
        self.plain_steps += 1
        if _observe_plain(self.plain_steps):
            stage.at("latency_model", pipe.latency_model, "observe_batch")
            pipe.latency_model.observe_batch(1, ctxs, verify_s)
        overhead = clock["controller"] + clock["commit"]
        if self.drafts:
            stage.at("budget_controller", pipe.budget_controller, "observe")
            pipe.budget_controller.observe(
                StepFeedback(
                    drafted=False, log_scores=_ROOT_SCORES, accepted_nodes=_ROOT_PATH, context_len=max(ctxs), verify_s=verify_s,
                    overhead_s=overhead, batch_size=b,
                )
            )
        timings = clock.timings()
        return [
            StepRecord(
                budget=1, accepted=0, emitted=1, context_len=ctx, predicted_accept=1.0, predicted_speedup=None,
                timings=timings, drafted=False, batch_size=b, width=1 if b > 1 else None,
            )
            for ctx in ctxs
        ]

    def plain_done(self, b: int, clock: StageClock) -> None:
        """The plain step's non-verify seconds, its records' emission included."""
        self.pipe._batch_costs.plain.observe(b, clock["controller"] + clock["commit"] + (time.perf_counter() - clock.last))

    # ---------------------------------------------------------------- speculative steps
    def speculative(
        self,
        ctxs: Sequence[int],
        trees: Sequence["Tree"],
        scores: Sequence[torch.Tensor],  # per row [n_i] log rho of the built tree (host)
        verdicts: Sequence["Verdict"],
        decision: "BudgetDecision",
        clock: StageClock,
        stage: Any,
    ) -> list[StepRecord]:
        """A speculative step (stages ``draft``, ``tree``, ``controller``, ``verify``, ``accept``,
        ``commit``) -> each row's record. The latency model hears the forward and the read of its
        verdicts at the batch's width; the controller each row's verified tree and accepted path."""
        pipe = self.pipe
        b = len(ctxs)
        width = max(len(t) for t in trees)
        self.plain_steps = 0
        verify_s = clock["verify"] + clock["accept"]  # the forward and the read of its verdicts
        stage.at("latency_model", pipe.latency_model, "observe_batch")
        pipe.latency_model.observe_batch(width, ctxs, verify_s)
        drafting = clock["draft"] + clock["tree"]
        costs = pipe._batch_costs
        if self.joined and b > 1 and costs.draft.sizes:
            # this draft also caught the drafter up on the newcomers' prompts (a one-time cost per request,
            # like its prefill): the controller hears the step at the steady drafting cost, so a batch's
            # first steps after joins do not teach it that drafting never pays at this size (measured in
            # serving at 2 requests: two such steps set the realized / predicted gain to 0.17, and the
            # batch then drafted on 6% of its steps where fixed widths ran 1.03-1.15x plain decoding)
            drafting = min(drafting, costs.draft(b))
        non_verify = drafting + clock["controller"] + clock["commit"]
        stage.at("budget_controller", pipe.budget_controller, "observe")
        for tree, row_scores, verdict, ctx in zip(trees, scores, verdicts, ctxs):
            pipe.budget_controller.observe(
                StepFeedback(
                    drafted=True, log_scores=row_scores[: len(tree)], accepted_nodes=verdict.accepted_nodes, context_len=ctx,
                    verify_s=verify_s, overhead_s=non_verify, batch_size=b,
                )
            )
        timings = clock.timings()
        return [
            StepRecord(
                budget=len(tree), accepted=verdict.num_accepted, emitted=verdict.num_accepted + 1, context_len=ctx,
                predicted_accept=tree.accept_score(), predicted_speedup=decision.predicted_speedup, timings=timings,
                calibrated_accept=decision.calibrated_accept, drafted=True, batch_size=b, width=width if b > 1 else None,
            )
            for tree, verdict, ctx in zip(trees, verdicts, ctxs)
        ]

    def speculative_done(self, b: int, emitted: int, clock: StageClock) -> None:
        """The speculative step's drafting and other non-verify seconds (its records' emission
        included), and the seconds per committed token. The drafting seconds of the first speculative
        step after rows joined are left out (see :attr:`joined`): measured 1.5-2x a steady step's on
        the demo pair, they would price every later step's drafting at the newcomers' catch-up."""
        costs = self.pipe._batch_costs
        end = time.perf_counter()
        if not self.joined:
            costs.draft.observe(b, clock["draft"] + clock["tree"])
        self.joined = False
        costs.other.observe(b, clock["controller"] + clock["commit"] + (end - clock.last))
        self.per_token.observe((end - clock.start) * b / max(emitted, 1))


def _observe_plain(k: int) -> bool:
    """Whether the ``k``-th plain step of a run (from 1) times the latency model."""
    return k & (k - 1) == 0 or k % PLAIN_LATENCY_EVERY == 0
