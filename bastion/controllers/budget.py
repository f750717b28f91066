"""Budget controllers: how many nodes of the best-first tree to verify this step.

``bastion`` maximizes the predicted speedup over autoregressive decoding

    S(n) = A_hat(T_n) * L_AR / C(n),   A_hat(T_n) = sum_{i < n} rho_i,   C(n) = overhead + T_verify(n, c)

where ``rho_i = exp(log_scores[i])`` in node order (the root's rho is 1, so A_hat >= 1), ``L_AR`` is the
predicted time of one autoregressive target step (``T_verify(1, c)``) and ``overhead`` the observed draft
and non-verify seconds per step. Because best-first order makes A_hat(T_n) the best surrogate of any
n-node tree, scanning n is a scan over optimal trees. All candidate sizes are scored with one vectorized
latency call.

With calibration on (the default), ``rho_i`` in A_hat is replaced by the acceptance rate an
:class:`~bastion.controllers.calibration.AcceptanceCalibrator` learnt for such scores from what
verification realized, so S(n) is predicted from the calibrated A_cal(T_n). With the speculation gate
on (the default), "do not draft" is one of the choices: when the best predicted S falls below a plain
target step's, a :class:`~bastion.controllers.gate.SpeculationGate` switches the pipeline to plain
decoding and re-probes with a back-off.

``fixed`` always verifies the same number of nodes and always drafts (the baseline; ``budget=1`` with the
``chain`` builder is plain DFlash).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Literal, Mapping, Sequence

import numpy as np
import torch

from bastion.controllers.calibration import AcceptanceCalibrator, SamplingKey, sampling_key
from bastion.controllers.gate import SpeculationGate
from bastion.controllers.request_accept import RequestAcceptance
from bastion.utils.checks import check_int, check_number, options_object, predict_batch_checked, predict_checked
from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import BatchStepCosts, BudgetController, BudgetDecision, LatencyModel
from bastion.utils.running import RobustLevel
from bastion.contract.types import SamplingConfig, SpeedupEstimator, StepFeedback

__all__ = ["PLAIN_STEPS_MIN", "BastionController", "BastionDecision", "FixedController", "batch_accept_curve"]

#: a step measured this many times slower than its prediction ran beside a burst of foreign load
_BURST_RATIO = 1.5
#: the recent rows' acceptance curves a batch's gain is predicted from (single sequences' decisions and
#: each row of batched speculative steps)
_ROW_WINDOW = 16

Rule = Literal["scan", "first-decrease"]


#: the decision type of the built-in controllers (the interface's typed decision)
BastionDecision = BudgetDecision


def _host_scores(log_scores: torch.Tensor) -> list[float]:
    """The one host transfer of a step: FloatTensor[n_max] -> checked floats [n_max] (the per-step
    arithmetic runs on a few dozen numbers, where Python floats beat NumPy calls)."""
    if not isinstance(log_scores, torch.Tensor) or log_scores.dim() != 1 or log_scores.shape[0] < 1:
        raise InvalidInputError(
            f"log_scores must be a non-empty 1-D tensor, got {getattr(log_scores, 'shape', type(log_scores).__name__)}"
        )
    values: list[float] = log_scores.detach().cpu().tolist()
    if not all(v <= 1e-6 for v in values):  # a NaN fails the comparison too
        raise InvalidInputError("log_scores must be log-probabilities (<= 0, no NaN)")
    return values


def _scores_to_numpy(log_scores: torch.Tensor) -> np.ndarray:
    """:func:`_host_scores` as a float64 array [n_max] (the batched paths' row-wise NumPy arithmetic)."""
    return np.array(_host_scores(log_scores), dtype=np.float64)


def _check_overhead(overhead_s: float) -> float:
    return check_number("overhead_s", overhead_s)


#: plain steps measured at a batch size before a batch of that size drafts (:meth:`BastionController.speculate_batch`):
#: every gain at that size is judged against a plain step's price there, so it is measured, not extrapolated
#: (the first plain steps of a fresh server can run cold: one at 2 rows priced 17.9 ms outside the forward,
#: where servers that priced each size first measured 0.3-0.5 ms at 2-3 rows; the median of three sets one aside)
PLAIN_STEPS_MIN = 3

#: the realized / predicted gain of a batch size's speculative steps is trusted within these bounds
_REALISM_BOUNDS = (0.05, 1.5)
#: speculative steps a batch size needs before its realized / predicted gain corrects the predictions
_REALISM_MIN_STEPS = 2
#: the recent speculative steps of a batch size whose realized and predicted gains are summed (:meth:`realism`),
#: and the multiple of its prediction above which one step's realized gain is clipped (a timing glitch)
_REALISM_WINDOW, _REALISM_CLIP = 16, 2.0

#: drafted tokens a probe must have had accepted before its realized gain can overrule the predicted one
#: (one accepted token is a lucky draw as often as evidence: at a per-node rate of 0.2 it comes one probe in five)
_REALIZED_MIN_ACCEPTED = 2

#: while a batch's gate waits out a back-off, the plain steps from one prediction of the gain to the next,
_RECHECK_EVERY = 4
#: ... and when the last prediction was below this share of the margin, the plain steps to the next one:
#: a batch far from paying waits longer between predictions (each costs about 0.3 ms inside a step's loop
#: on the demo pair, a tenth of a plain step at 2 rows, where a microbenchmark says 0.05)
_RECHECK_NEAR, _RECHECK_FAR = 0.8, 16
#: how far above the last probe's measured gain a prediction must rise to probe before the back-off ends
_RECHECK_RISE = 1.1
#: rows of the long-run window a batch's newly joined rows are predicted from (:meth:`_predicted_gain`)
_LONG_WINDOW = 256


class BastionController(BudgetController):
    """Chooses n maximizing the predicted speedup S(n) over the allowed sizes, or no drafting at all.

    ``rule="scan"`` returns the exact argmax (the smallest n among ties); ``rule="first-decrease"`` walks
    sizes upward and stops before the first one whose S is lower than its predecessor's (the paper's
    rule; equal to the scan when S is unimodal). ``min_budget`` / ``max_budget`` bound n; ``buckets``
    restricts n to a set of sizes (e.g. the sizes of captured CUDA graphs); when no bucket fits under the
    tree, the largest allowed size is used. ``extra_overhead_s`` is added to the observed overhead.

    ``calibration`` (default on): an :class:`AcceptanceCalibrator`, a mapping of its options, or False to
    predict with the raw surrogate. ``gate`` (default on): a :class:`SpeculationGate`, a mapping of its
    options, or False to draft every step. Both are exposed as attributes (``calibrator``, ``gate``).
    ``request_accept`` (default off): True, a
    :class:`~bastion.controllers.request_accept.RequestAcceptance` or a mapping of its options scales a
    single sequence's calibrated acceptance by how its own drafts fared against it so far (attribute
    ``request_accept``, None when off; batches of several rows have :meth:`realism` instead). Off by
    default: on the demo pair it ran slower than without it on every bench data set (docs/controllers.md).
    ``row_window`` (default 16): how many of the most recent rows drafted a batch's predicted gain reads
    (:meth:`_predicted_gain`); served side by side on the demo pair, 64 against 16 measured ahead at 2-4
    concurrent requests in one run and behind in the next (docs/results.md), so the default stays.
    """

    def __init__(
        self,
        *,
        rule: Rule = "scan",
        min_budget: int = 1,
        max_budget: int | None = None,
        buckets: Iterable[int] | None = None,
        extra_overhead_s: float = 0.0,
        calibration: AcceptanceCalibrator | Mapping[str, Any] | bool = True,
        gate: SpeculationGate | Mapping[str, Any] | bool = True,
        request_accept: RequestAcceptance | Mapping[str, Any] | bool = False,
        row_window: int = _ROW_WINDOW,
    ) -> None:
        if rule not in ("scan", "first-decrease"):
            raise InvalidInputError(f"rule must be 'scan' or 'first-decrease', got {rule!r}")
        self.rule: Rule = rule
        self.min_budget = check_int("min_budget", min_budget)
        self.max_budget = None if max_budget is None else check_int("max_budget", max_budget)
        if self.max_budget is not None and self.max_budget < self.min_budget:
            raise InvalidInputError(f"max_budget ({max_budget}) is below min_budget ({min_budget})")
        self.buckets: tuple[int, ...] | None = None
        self._candidates: dict[int, tuple[np.ndarray, torch.Tensor, list[int]]] = {}
        self.use_buckets(buckets)
        self.extra_overhead_s = _check_overhead(extra_overhead_s)
        self.calibrator: AcceptanceCalibrator | None = options_object("calibration", calibration, AcceptanceCalibrator)
        self.gate: SpeculationGate | None = options_object("gate", gate, SpeculationGate)
        self.request_accept: RequestAcceptance | None = options_object("request_accept", request_accept, RequestAcceptance)
        #: the calibrated drafted tokens (A_cal - 1, unscaled) the last single-sequence decision expected
        self._expected_extra: float | None = None
        self._key: SamplingKey = sampling_key(SamplingConfig())
        self._predicted_cost_s = 0.0  # the last decision's predicted step seconds (0: none yet)
        self._miss = RobustLevel(tolerance=_BURST_RATIO - 1.0)  # recent measured / predicted step seconds
        self._plain_overhead = RobustLevel()  # a plain step's non-verify seconds
        self._plain_step = RobustLevel()  # a plain step's seconds
        #: batches: the calibrated acceptance curves of the most recent rows drafted (each [n_i], entry
        #: W - 1: the row's tokens at width W), newest last; a plain step's probe decision predicts from them
        self.row_window = check_int("row_window", row_window)
        self._row_curves: deque[np.ndarray] = deque(maxlen=self.row_window)
        #: the same curves over a longer past: what a row that joined the batch since its last drafted
        #: step is predicted from (its text has not been drafted yet; the recent rows are other texts)
        self._long_curves: deque[np.ndarray] = deque(maxlen=max(_LONG_WINDOW, self.row_window))
        self._rows_seen = 0  # rows ever added to the window (its version, for the cache below)
        self._fresh = 0  # rows of the running batch that joined since its last drafted step
        self._batch_rows = 0  # the running batch's rows at the last begin / begin_batch
        #: (rows seen, batch size, fresh rows) -> the window's batch totals [G, n] (:meth:`_predicted_gain`)
        self._totals: tuple[tuple[int, int, int], np.ndarray] | None = None
        self._batch_plain_s: float | None = None  # this batched step's plain-step seconds (speculate_batch)
        self._probe_rows: int | None = None  # rows of the batch's last speculative step
        #: the gain predicted when the batch's last probe started (None: not predicted), and the newest
        #: prediction; a re-check probes only on a prediction above both it and the probe's gain
        self._probe_predicted: float | None = None
        self._last_predicted: float | None = None
        self._recheck_at = 0  # the gate's plain-step count at which a backed-off batch predicts again
        #: per batch size, the (realized, predicted) gains of its recent speculative steps: the batch
        #: gate's predictions are scaled by their ratio (see :meth:`realism`)
        self._realism: dict[int, deque[tuple[float, float]]] = {}
        #: the speculative batched step being observed row by row (None: none)
        self._pending_step: _PendingStep | None = None

    @property
    def row_curve(self) -> np.ndarray | None:
        """The mean calibrated acceptance curve of the recent rows drafted (entry W - 1: tokens per row
        at width W; a shorter row's curve stays flat past its end), None before any."""
        if not self._row_curves:
            return None
        n = max(c.shape[0] for c in self._row_curves)
        return np.mean([_extend_flat(c, n) for c in self._row_curves], axis=0)

    @property
    def plain_overhead_s(self) -> float:
        """A plain step's non-verify seconds: robust level of recent plain steps (0 until one is seen)."""
        return self._plain_overhead.value

    @property
    def plain_step_s(self) -> float:
        """A plain step's seconds: robust level of recent plain steps (0 until one is seen)."""
        return self._plain_step.value

    def use_buckets(self, buckets: Iterable[int] | None) -> None:
        """Restrict n to ``buckets`` from now on (None: every size), e.g. the sizes the compiled verify
        path captured."""
        if buckets is None:
            self.buckets = None
        else:
            sizes = sorted({check_int("bucket size", b) for b in buckets})
            if not sizes:
                raise InvalidInputError("buckets must hold at least one size (or be None)")
            self.buckets = tuple(sizes)
        self._candidates.clear()

    # ------------------------------------------------------------------ per sequence
    def begin(self, sampling: SamplingConfig) -> None:
        """Select the calibration table of ``sampling`` and start the gate's new sequence (calibration
        persists; the gate continues the back-off of this setting's last sequence, see
        :meth:`SpeculationGate.start`)."""
        self._key = sampling_key(sampling)
        if self.gate is not None:
            self.gate.start(self._key)
        if self.request_accept is not None:
            self.request_accept.reset()
        self._expected_extra = None

    def speculate(self) -> bool:
        return True if self.gate is None else self.gate.should_draft()

    def begin_batch(self, sampling: SamplingConfig, batch_size: int) -> None:
        """:meth:`begin` for a batch: the gate's state is kept per (sampling setting, batch size), so
        whether speculation paid at one batch size never decides another's start (nor a single
        sequence's)."""
        self._joined(int(batch_size))
        if batch_size == 1:
            self.begin(sampling)  # a batch of one is a sequence: the single-sequence gate state
            return
        self._key = sampling_key(sampling)
        self._probe_rows = None
        self._probe_predicted = self._last_predicted = None
        self._recheck_at = 0
        if self.gate is not None:
            self.gate.start((self._key, "batch", int(batch_size)))

    def speculate_batch(self, context_lens: Sequence[int], latency: LatencyModel, costs: BatchStepCosts) -> bool:
        """The gate's decision for a batched step, checked against the batch's measured costs.

        A batch size whose plain step was measured fewer than :data:`PLAIN_STEPS_MIN` times
        (``costs.plain_steps``) decodes plainly first: a drafted step's realized gain is its tokens per
        second over a plain step's at that size, so a plain price extrapolated from other sizes would have
        the batch draft on gains it never realizes, with nothing to correct them: in a fresh server one
        cold plain step at 2 rows (17.9 ms outside the forward) scaled to 83 ms at 16 rows, and the batch
        of 16 drafted on 89% of its steps, "realizing" 2-4x that price while it served 0.64x plain.

        While speculation pays the gate decides alone (every speculative step's :meth:`decide_width`
        updates it). Otherwise the gain of speculating now is predicted from :attr:`row_curve` (the
        acceptance of recent speculative steps) and the latency and cost models at this batch size:

        - a probe the gate schedules (or a batch's first step) that is predicted not to pay is skipped
          and counts as a probe that did not pay (the back-off grows), until the back-off reaches its
          cap; from then on every probe of the countdown drafts, so the acceptance is re-measured now
          and then; a first-step look (:attr:`SpeculationGate.looking`: the batch restarted because a
          row joined or left) predicted not to pay is skipped at the cap too;
        - when rows have left the batch since its last speculative step and speculating is now
          predicted to pay, the step probes at once instead of waiting out the back-off;
        - while waiting out a back-off the gain is predicted again :data:`_RECHECK_EVERY` plain steps
          after the last prediction (:data:`_RECHECK_FAR` when that one was below
          :data:`_RECHECK_NEAR` times the margin): when it is above the margin and
          :data:`_RECHECK_RISE` times both the gain the last probe measured and the gain predicted
          when that probe started (the costs or the acceptance curve moved since: a drafting cost
          first measured cold, a batch whose rows changed), the step probes at once. A back-off of
          256 steps then no longer outlasts the conditions that set it, and a probe whose own trees
          did not pay is not repeated on the prediction it failed."""
        if len(context_lens) == 1:
            return self.speculate()  # a single sequence: the gate alone (its costs are learnt in observe)
        self._batch_plain_s = costs.plain_s
        gate = self.gate
        if gate is None:
            return True
        if costs.plain_steps is not None and costs.plain_steps < PLAIN_STEPS_MIN:
            return False  # a plain step measures the price every gain at this size is judged against (the gate's look waits)
        first = gate.speculating and gate.gain is None  # a batch's first step: the gate's first probe
        if gate.speculating and not first:
            return gate.should_draft()
        rows = len(context_lens)
        shrunk = self._probe_rows is not None and rows < self._probe_rows
        waiting = not first and gate.wait > 0
        recheck = waiting and gate.plain_steps >= self._recheck_at
        if waiting and not shrunk and not recheck:  # waiting out the back-off: no prediction needed
            return self._probe_starts(gate.should_draft())
        gain = self._predicted_gain(context_lens, latency, costs)
        if gain is None:
            return self._probe_starts(gate.should_draft())
        self._last_predicted = gain
        if waiting:
            near = gain > _RECHECK_NEAR * gate.margin
            self._recheck_at = gate.plain_steps + (_RECHECK_EVERY if near else _RECHECK_FAR)
            last = max(gate.gain if gate.gain is not None else 0.0, self._probe_predicted or 0.0)
            if gain > gate.margin and (shrunk or gain > last * _RECHECK_RISE):
                gate.wait = 0  # probe now: should_draft() below starts it
            elif shrunk:
                self._probe_rows = rows  # predicted for this size: ask again only when it shrinks further
        if not gate.should_draft():
            return False
        # at the back-off's cap the countdown's probes draft whatever the prediction (the acceptance is
        # re-measured now and then); a look outside the countdown (a row joined) follows the prediction
        if gain > gate.margin or (gate.backoff >= gate.max_backoff and not gate.looking):
            return self._probe_starts(True)
        gate.update(gain)  # a probe predicted not to pay: skipped, counted as one that did not pay
        return False

    def _probe_starts(self, drafts: bool) -> bool:
        """``drafts``, remembering the newest prediction as the one a probe started on when it is one
        (a backed-off batch's re-checks compare their predictions with it)."""
        if drafts and self.gate is not None and not self.gate.speculating:
            self._probe_predicted = self._last_predicted
        return drafts

    def _predicted_gain(self, context_lens: Sequence[int], latency: LatencyModel, costs: BatchStepCosts) -> float | None:
        """Predicted gain of drafting this step over a plain batched step: the mean, over batches of
        ``B`` recent rows (consecutive in the window of :attr:`row_window` rows, wrapping), of what
        :meth:`decide_width` would realize on such a batch, its best width's tokens per second, or a
        plain step's tokens after the drafting it wasted when W = 1 wins.

        Not the gain of the mean curve: a step decides on its own drafts, wide when they are confident
        and plain when they are not, and the mean of those best choices is above the best choice for the
        mean curve (at 2 rows on the demo pair the mean curve predicted 0.73-0.99 while every decision on
        real drafts gained 1.1-3.2: the batch stayed plain where fixed widths ran 1.04-1.10x). With
        ``B`` at least the window's rows the batches are all one, the window's sum scaled to ``B``."""
        totals = self._window_totals(len(context_lens))  # [G, n]
        if totals is None:
            return None
        rows = len(context_lens)
        rate, cost, t_verify, sizes = self._batch_rates(totals, context_lens, latency, costs.overhead_s, costs.draft_s)  # [G, N + 1]
        drafted = sizes > 1  # [N + 1]: the widths that verify drafted nodes (sizes may list W = 1 twice)
        wide = rate[:, drafted].max(axis=1) if drafted.any() else np.zeros(rate.shape[0])  # [G] the best such width's tokens per second
        # decide_width takes W = 1 when no wider tree beats verifying the roots alone after the drafting
        # (spent by then): the step then commits one token per row after the drafting it wasted
        realized = np.maximum(wide, rows / (cost[0] + _check_overhead(costs.draft_s)))  # [G]
        plain = rows / (t_verify[0] + costs.plain_s)
        return float(realized.mean() / plain) * self.realism(rows)

    def _remember_rows(self, curves: list[np.ndarray]) -> None:
        """Rows just drafted (each curve [n_i]): into both windows; the running batch has no fresh row."""
        self._row_curves.extend(curves)
        self._long_curves.extend(curves)
        self._rows_seen += len(curves)
        self._fresh = 0

    def _joined(self, batch_size: int) -> None:
        """The running batch now has ``batch_size`` rows: rows beyond its last size joined (fresh)."""
        self._fresh = min(batch_size, self._fresh + max(0, batch_size - self._batch_rows))
        self._batch_rows = batch_size

    def _window_totals(self, rows: int) -> np.ndarray | None:
        """The window's batches of ``rows`` rows: their summed acceptance curves [G, n] (None: no curve
        of two nodes or more yet); kept until the window changes, so the re-checks of a backed-off
        batch (the window does not move while it decodes plainly) do not rebuild them. The rows that
        joined since the batch last drafted are taken from the long-run window instead: the recent
        rows are the texts that were running when drafting stopped paying (at 2 concurrent requests in
        a server the recent window predicted 0.89-0.98 for a newly joined request's batch, its looks
        were skipped and the back-off grew to 64 steps, while a fixed width of 16 ran 1.35x plain)."""
        fresh = min(self._fresh, rows)
        key = (self._rows_seen, rows, fresh)
        if self._totals is not None and self._totals[0] == key:
            return self._totals[1]
        n = max((c.shape[0] for c in (self._long_curves if fresh else self._row_curves)), default=0)
        if n < 2:
            return None
        totals = _group_totals(self._row_curves, rows - fresh, n)  # [G1, n] or None
        if fresh:
            joined = _group_totals(self._long_curves, fresh, n)  # [G2, n]
            assert joined is not None
            if totals is not None:  # pair the groups (the shorter list wrapping)
                g = max(totals.shape[0], joined.shape[0])
                totals = np.resize(totals, (g, n)) + np.resize(joined, (g, n))
            else:
                totals = joined
        assert totals is not None
        self._totals = (key, totals)
        return totals

    def _batch_rates(
        self, total: np.ndarray, context_lens: Sequence[int], latency: LatencyModel, overhead_s: float, draft_s: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Predicted accepted tokens per second of the batch at each allowed width, from ``total``
        [n_top] (entry W - 1: the batch's accepted tokens at width W), or [G, n_top] for G batches at
        once -> (rate [N + 1] or [G, N + 1], seconds per step, T_verify, sizes, each [N + 1]);
        sizes[0] is W = 1 (no drafting cost)."""
        overhead = _check_overhead(overhead_s) + self.extra_overhead_s
        draft = _check_overhead(draft_s)
        sizes, sizes_t, _ = self._sizes(total.shape[-1])  # [N + 1], sizes[0] == 1
        t_verify = predict_batch_checked(latency, sizes_t, context_lens).numpy()  # [N + 1] seconds
        cost = overhead + t_verify + np.where(sizes > 1, draft, 0.0)  # [N + 1] seconds per step
        return total[..., sizes - 1] / cost, cost, t_verify, sizes

    def observe(self, outcome: StepFeedback) -> None:
        """Learn the acceptance of the verified nodes (speculative steps) or the cost of a plain step."""
        if not outcome.drafted and outcome.batch_size > 1:
            return  # a batch's plain-step cost comes with each step (speculate_batch), per batch size
        if outcome.drafted and outcome.batch_size > 1:
            self._hear_row(outcome)
        if not outcome.drafted:
            self._plain_overhead.observe(_check_overhead(outcome.overhead_s))
            self._plain_step.observe(outcome.verify_s + outcome.overhead_s)
            return
        measured = outcome.verify_s + outcome.overhead_s
        # a step far slower against its prediction than recent steps were ran beside a burst of foreign
        # load: its cost is not the evidence a step under steady load is, so it does not raise the cap
        calm = True
        if self._predicted_cost_s > 0:
            miss = measured / self._predicted_cost_s
            typical = self._miss.value if self._miss.count >= 3 else miss
            self._miss.observe(miss)
            calm = miss <= _BURST_RATIO * typical
        expected, self._expected_extra = self._expected_extra, None
        if self.request_accept is not None and expected is not None and outcome.batch_size == 1:
            self.request_accept.observe(expected, outcome.accepted)
        if self.gate is not None and self.plain_step_s and outcome.batch_size == 1 and measured > 0 and outcome.accepted >= _REALIZED_MIN_ACCEPTED:
            # a probe predicted not to pay whose tree paid after all: speculation resumes (the gate ignores
            # this after any other step); committed tokens per second over a plain step's
            self.gate.observe_realized((outcome.accepted + 1) * self.plain_step_s / measured)
        if self.gate is not None and self.plain_step_s and outcome.batch_size == 1 and calm:
            # a probe that did not pay: its seconds beyond the plain steps it replaced set the gate's cap
            self.gate.observe_probe_cost(measured / self.plain_step_s - (outcome.accepted + 1))
        if self.calibrator is None:
            return
        scores = outcome.log_scores.tolist()  # [n], root first
        accepted = [False] * len(scores)  # [n]
        for node in outcome.accepted_nodes.tolist():
            accepted[node] = True
        self.calibrator.observe_values(scores[1:], accepted[1:], self._key)

    def _hear_row(self, outcome: StepFeedback) -> None:
        """One row of a speculative batched step: once every row is heard, the step's realized gain (its
        tokens per second over a plain batched step's) against the gain :meth:`decide_width` predicted
        for it teaches :meth:`realism` at that batch size (a step that chose W > 1), and a probe that
        did not pay reports its cost beyond the plain steps it replaced to the gate
        (:meth:`SpeculationGate.observe_probe_cost`, in plain batched steps), whose back-off cap rises
        with it. A batch's probe after a long plain stretch also catches the drafter up on every row's
        positions since its last draft: in-process at 16 running requests on the demo pair, the one
        pass of four whose 126 steps included two such drafted steps ran 0.79 of speculation off (the
        other three 0.96-1.00), and uncosted, the capped back-off (256 steps) repeated them."""
        step = self._pending_step
        if step is None or step.rows != outcome.batch_size:
            return
        step.heard += 1
        step.emitted += outcome.accepted + 1
        if step.heard < step.rows:
            return
        self._pending_step = None
        seconds = outcome.verify_s + outcome.overhead_s
        if seconds <= 0 or step.plain_rate <= 0:
            return
        if self.gate is not None:  # in plain batched steps (rows / plain_rate seconds each), less those it emitted
            self.gate.observe_probe_cost(seconds * step.plain_rate / step.rows - step.emitted / step.rows)
        if step.predicted <= 0:
            return
        realized = (step.emitted / seconds) / step.plain_rate
        recent = self._realism.get(step.rows)
        if recent is None:
            recent = self._realism[step.rows] = deque(maxlen=_REALISM_WINDOW)
        recent.append((min(realized, _REALISM_CLIP * step.predicted), step.predicted))

    def realism(self, batch_size: int) -> float:
        """How much of its predicted gain a speculative step at ``batch_size`` rows realized: the realized
        gains of that size's last :data:`_REALISM_WINDOW` speculative steps over their predicted gains,
        summed, within :data:`_REALISM_BOUNDS`; 1.0 until :data:`_REALISM_MIN_STEPS` were seen. A batch's
        gate hears its predicted gains scaled by it, so a cost or acceptance model that over-promises at
        some batch size (a wide verify priced too cheaply, drafting that catches up on newly joined rows)
        stops drafting there after a few steps instead of at the next prediction that happens to fall.
        A single sequence has its own check (a failed probe's measured cost).

        Sums, not a level of per-step ratios: one step's realized gain swings from under half to about
        twice the typical step's with the text it drafts on (at 2 rows on the demo pair), and a run of a
        few poor steps (hard text, or a burst of foreign load) weighs its share of the window, no more;
        one step's realized gain is clipped at :data:`_REALISM_CLIP` times its prediction (a timing
        glitch). A median that restarts on such a run (as this once was) fell to 0.55 at 2 running
        requests on the demo pair, and since only drafted steps move it, the batch then drafted on 1-2%
        of its steps."""
        recent = self._realism.get(int(batch_size))
        if recent is None or len(recent) < _REALISM_MIN_STEPS:
            return 1.0
        realized = sum(r for r, _ in recent)
        predicted = sum(p for _, p in recent)
        lo, hi = _REALISM_BOUNDS
        return min(hi, max(lo, realized / predicted))

    def accept_rates(self, log_scores: np.ndarray) -> np.ndarray:
        """Per-node acceptance probabilities [n] used for A_cal (root first: 1), from log rho [n]."""
        return np.array(self._rates(np.asarray(log_scores, dtype=np.float64).tolist()), dtype=np.float64)

    def _rates(self, log_scores: list[float]) -> list[float]:
        """:meth:`accept_rates` on floats."""
        rest = log_scores[1:]
        if self.calibrator is not None:
            return [1.0, *self.calibrator.calibrate_values(rest, self._key)]
        return [1.0, *(math.exp(v) for v in rest)]

    def _request_rates(self, rates: list[float]) -> list[float]:
        """A single sequence's per-node acceptance [n] (root first): the calibrated ``rates`` times the
        request's factor (:attr:`request_accept`), each at most 1."""
        if self.request_accept is None:
            return rates
        f = self.request_accept.factor
        if f == 1.0:
            return rates
        return [1.0, *(min(1.0, f * r) for r in rates[1:])]

    def candidates(self, n_max: int) -> np.ndarray:
        """Allowed sizes (ascending, int64 array) for a tree of ``n_max`` nodes."""
        return self._sizes(n_max)[0][1:]

    def _sizes(self, n_max: int) -> tuple[np.ndarray, torch.Tensor, list[int]]:
        """Cached ``[1, *candidates]`` as an array and a tensor (1 first: the autoregressive step), and
        the candidates alone as a list."""
        cached = self._candidates.get(n_max)
        if cached is None:
            hi = n_max if self.max_budget is None else min(self.max_budget, n_max)
            lo = min(self.min_budget, hi)
            if self.buckets is None:
                cand = np.arange(lo, hi + 1, dtype=np.int64)
            else:
                cand = np.array([b for b in self.buckets if lo <= b <= hi], dtype=np.int64)
                if cand.size == 0:
                    cand = np.array([hi], dtype=np.int64)
            sizes = np.concatenate([np.ones(1, dtype=np.int64), cand])
            cached = (sizes, torch.from_numpy(sizes), cand.tolist())
            self._candidates[n_max] = cached
        return cached

    def choose(self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float) -> int:
        return self.decide(log_scores, context_len, latency, overhead_s).n

    def _scan(self, rates: list[float], t_verify: list[float], cand: list[int], overhead: float) -> tuple[int, float, float]:
        """The chosen candidate ``(k, S(cand[k]), A_cal(cand[k]))`` from per-node acceptance ``rates``
        [n_max] (root first), verify seconds ``t_verify`` [N + 1] (``[0]``: n = 1, then one per candidate)
        and the candidate sizes ``cand`` [N] (ascending), with S(n) = A_cal(T_n) * L_AR / (overhead +
        T_verify(n)). ``rule="scan"``: the first maximum; ``"first-decrease"``: the size before S first
        falls (the last one when it never does)."""
        l_ar = t_verify[0]
        first_decrease = self.rule == "first-decrease"
        best = (0, -math.inf, 0.0)
        accept, i = 0.0, 0
        for k, n in enumerate(cand):
            while i < n:  # A_cal(T_n): the cumulative acceptance of the first n nodes
                accept += rates[i]
                i += 1
            speedup = accept * (l_ar / (overhead + t_verify[k + 1]))
            if first_decrease:
                if k and speedup < best[1]:
                    break
                best = (k, speedup, accept)
            elif speedup > best[1]:
                best = (k, speedup, accept)
        return best

    def decide(
        self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float
    ) -> BudgetDecision:
        scores = _host_scores(log_scores)  # [n_max]
        overhead = _check_overhead(overhead_s) + self.extra_overhead_s
        _, sizes_t, cand = self._sizes(len(scores))
        t_verify = predict_checked(latency, sizes_t, context_len).tolist()  # [N + 1] seconds; [0] is n = 1
        rates = self._rates(scores)  # [n_max] per-node acceptance, root first
        k, speedup, a_cal = self._scan(self._request_rates(rates), t_verify, cand, overhead)
        n = cand[k]
        if self.request_accept is not None:
            self._expected_extra = sum(rates[1:n])  # what calibration alone expects the tree to add
        # a single sequence's acceptance curve teaches the one batched steps predict from: a batch's
        # first step after single-request traffic is then decided on it, not probed blind
        self._remember_rows([np.cumsum(np.asarray(rates, dtype=np.float64))])
        # against a plain step (no draft); drafting then verifying the root alone never beats it
        plain = t_verify[0] / (t_verify[0] + self.plain_overhead_s)
        gain = speedup / plain if n > 1 else 0.0
        if self.gate is not None:
            self.gate.update(gain)
        self._predicted_cost_s = overhead + t_verify[k + 1]
        return BudgetDecision(
            n,
            speedup,
            predicted_accept=sum(math.exp(v) for v in scores[:n]),  # A_hat(T_n), the raw surrogate
            predicted_cost_s=overhead + t_verify[k + 1],
            calibrated_accept=a_cal,
            gain=gain,
        )

    def speedup_estimator(self, context_len: int, latency: LatencyModel, overhead_s: float) -> SpeedupEstimator:
        """S(n) of the size :meth:`decide` would choose, for candidates still being drafted (see
        :meth:`BudgetController.speedup_estimator`): the same calibrated acceptance, latency model and
        overhead (``overhead_s`` plus the drafting seconds), without touching the gate. The verify times
        are predicted once per tree size seen."""
        base = _check_overhead(overhead_s) + self.extra_overhead_s
        times: dict[int, list[float]] = {}

        def estimate(log_scores: Sequence[float], draft_s: float) -> float:
            scores = [float(v) for v in log_scores]  # [n] log rho, root first
            _, sizes_t, cand = self._sizes(len(scores))
            t_verify = times.get(len(scores))
            if t_verify is None:  # [N + 1] seconds; [0] is n = 1
                t_verify = times[len(scores)] = predict_checked(latency, sizes_t, context_len).tolist()
            return self._scan(self._request_rates(self._rates(scores)), t_verify, cand, base + draft_s)[1]

        return estimate

    # ------------------------------------------------------------------ batches
    def decide_width(
        self,
        log_scores: Sequence[torch.Tensor],
        context_lens: Sequence[int],
        latency: LatencyModel,
        overhead_s: float,
        draft_s: float,
    ) -> BudgetDecision:
        """The width W maximizing the step's predicted accepted tokens per second

            G(W) = sum_i A_i(min(W, n_i)) / (overhead + draft + T_verify(B, W, contexts))

        over ``{1} | candidates(max n_i)``, with ``A_i`` row i's calibrated acceptance curve (the raw
        surrogate without calibration). The width is chosen after the drafting, so every width pays it,
        W = 1 (verifying the roots alone) included, as a single sequence's :meth:`decide` prices its sizes.
        Ties go to the smaller width. ``predicted_speedup`` is G(W) over a plain batched step's rate
        ``B / (overhead + T_verify(B, 1))`` (nothing drafted); the gate hears the gain over a plain
        batched step, 0 when W = 1 wins, so a batch whose drafts do not pay stops drafting and re-probes
        later.

        Pricing W = 1 without the drafting it follows (as this method once did) compared a finished
        draft with not having drafted: measured in a server at 2 concurrent requests with the gate off,
        45% of the drafted steps then verified their roots alone (34 ms for 2 tokens, against 43 ms for
        9.3 tokens at the widths chosen otherwise), and that server ran 0.87x a fixed width of 16."""
        if not log_scores or len(log_scores) != len(context_lens):
            raise InvalidInputError("decide_width needs one log_scores tensor per context length (and at least one row)")
        if len(log_scores) == 1:  # a single sequence: its tree size by S(n)
            return self.decide(log_scores[0], int(context_lens[0]), latency, overhead_s + draft_s)
        rows = [_scores_to_numpy(s) for s in log_scores]
        raw = batch_accept_curve([np.exp(r) for r in rows])  # [n_top] sum_i A_hat_i(min(W, n_i))
        row_rates = [self.accept_rates(r) for r in rows]  # each [n_i], calibrated
        cal = batch_accept_curve(row_rates)  # [n_top] the same, calibrated
        self._remember_rows([np.cumsum(r) for r in row_rates])
        self._probe_rows = len(rows)
        rate, cost, t_verify, sizes = self._batch_rates(cal, context_lens, latency, overhead_s, draft_s)  # each [N + 1]
        spent = cal[sizes - 1] / (cost + np.where(sizes > 1, 0.0, _check_overhead(draft_s)))  # [N + 1] the draft paid at every width
        k = int(np.argmax(spent))
        width = int(sizes[k])
        plain_s = self.plain_overhead_s if self._batch_plain_s is None else self._batch_plain_s
        plain = len(rows) / (t_verify[0] + plain_s)  # a plain batched step's tokens per second
        gain = float(rate[k] / plain) if width > 1 else 0.0
        # this step's realized gain is compared with its prediction once every row is observed, when the
        # prediction had costs to go on: a batch size's first steps are priced with no drafting or plain
        # step measured yet (0 s), and their realized / predicted gain (measured in a server's first steps
        # at 2 rows: 0.15) would scale every later prediction at that size down until a capped probe
        priced = draft_s > 0 and plain_s > 0
        # (a step at W = 1 is still measured: a probe that did not pay reports its cost to the gate)
        self._pending_step = _PendingStep(len(rows), float(plain), gain if width > 1 else 0.0) if priced else None
        gain *= self.realism(len(rows))
        if self.gate is not None:
            self.gate.update(gain)
        return BudgetDecision(
            width,
            float(rate[k] / rate[0]),
            predicted_accept=float(raw[width - 1]),
            predicted_cost_s=float(cost[k]),
            calibrated_accept=float(cal[width - 1]),
            gain=gain,
        )

    def __repr__(self) -> str:
        return (
            f"BastionController(rule={self.rule!r}, min_budget={self.min_budget}, max_budget={self.max_budget}, "
            f"buckets={self.buckets}, calibration={self.calibrator!r}, gate={self.gate!r})"
        )


class FixedController(BudgetController):
    """Always verifies ``budget`` nodes (root included), or the whole tree when it is smaller.

    With ``estimate=True`` (default) it still records the predicted A_hat and speedup of its choice.
    """

    def __init__(self, *, budget: int = 16, estimate: bool = True) -> None:
        self.budget = check_int("budget", budget)
        self.estimate = bool(estimate)

    def choose(self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float) -> int:
        return self.decide(log_scores, context_len, latency, overhead_s).n

    def decide(
        self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float
    ) -> BudgetDecision:
        if not isinstance(log_scores, torch.Tensor) or log_scores.dim() != 1 or log_scores.shape[0] < 1:
            raise InvalidInputError("log_scores must be a non-empty 1-D tensor")
        n = min(self.budget, int(log_scores.shape[0]))
        if self.estimate:
            a_hat = float(log_scores[:n].detach().double().exp().sum())
            times = predict_checked(latency, torch.tensor([1, n]), context_len)
            cost = _check_overhead(overhead_s) + float(times[1])
            return BudgetDecision(n, a_hat * float(times[0]) / cost, predicted_accept=a_hat, predicted_cost_s=cost)
        return BudgetDecision(n)

    def speedup_estimator(self, context_len: int, latency: LatencyModel, overhead_s: float) -> SpeedupEstimator:
        """The predicted speedup of verifying the first ``min(budget, n)`` of ``n`` candidates (see
        :meth:`BudgetController.speedup_estimator`): A_hat over ``overhead_s`` + drafting + the verify time
        of ``budget`` nodes. A fixed controller verifies ``budget`` nodes whenever the tree holds them, so
        a tree still growing toward the budget is priced at that size: the drafter fills it by the
        acceptance each depth adds, whatever the latency model thinks of smaller verifies."""
        base = _check_overhead(overhead_s)
        times = predict_checked(latency, torch.tensor([1, self.budget]), context_len).numpy()  # [2] n = 1, budget

        def estimate(log_scores: Sequence[float], draft_s: float) -> float:
            a_hat = float(np.exp(np.asarray(log_scores[: self.budget], dtype=np.float64)).sum())
            return a_hat * float(times[0]) / (base + draft_s + float(times[1]))

        return estimate

    def decide_width(
        self,
        log_scores: Sequence[torch.Tensor],
        context_lens: Sequence[int],
        latency: LatencyModel,
        overhead_s: float,
        draft_s: float,
    ) -> BudgetDecision:
        """The fixed budget as the batch width (or the largest tree when every tree is smaller)."""
        if not log_scores:
            raise InvalidInputError("decide_width needs at least one row")
        if len(log_scores) == 1:
            return self.decide(log_scores[0], int(context_lens[0]), latency, overhead_s + draft_s)
        width = min(self.budget, max(int(s.shape[0]) for s in log_scores))
        if not self.estimate:
            return BudgetDecision(width)
        total = batch_accept_curve([np.exp(_scores_to_numpy(s)) for s in log_scores])
        times = predict_batch_checked(latency, torch.tensor([1, width]), context_lens).numpy()
        base = _check_overhead(overhead_s)
        cost = base + float(times[1]) + (_check_overhead(draft_s) if width > 1 else 0.0)
        speedup = (float(total[width - 1]) / cost) / (len(log_scores) / (base + float(times[0])))
        return BudgetDecision(width, speedup, predicted_accept=float(total[width - 1]), predicted_cost_s=cost)

    def __repr__(self) -> str:
        return f"FixedController(budget={self.budget})"


class _PendingStep:
    """A speculative batched step whose rows' feedback is still arriving: its rows, a plain batched
    step's tokens per second and the gain predicted for it (0: W = 1, nothing to compare), then the rows
    heard and tokens emitted."""

    __slots__ = ("rows", "plain_rate", "predicted", "heard", "emitted")

    def __init__(self, rows: int, plain_rate: float, predicted: float) -> None:
        self.rows, self.plain_rate, self.predicted = rows, plain_rate, predicted
        self.heard = 0
        self.emitted = 0


def _group_totals(window: Sequence[np.ndarray], rows: int, n: int) -> np.ndarray | None:
    """Batches of ``rows`` consecutive curves of ``window`` (wrapping), each extended flat to ``n``
    entries: their summed curves [G, n]; with ``rows`` at least the window's curves one batch, the
    window's sum scaled to ``rows``. None for no rows or an empty window."""
    if rows <= 0 or not window:
        return None
    curves = np.stack([_extend_flat(c, n) for c in window])  # [K, n]
    k = curves.shape[0]
    if rows >= k:
        return curves.sum(axis=0, keepdims=True) * (rows / k)  # [1, n]
    totals = curves.copy()
    for shift in range(1, rows):
        totals += np.roll(curves, -shift, axis=0)  # [K, n]: rows g .. g + B - 1 (wrapping)
    return totals


def _extend_flat(curve: np.ndarray, n: int) -> np.ndarray:
    """``curve`` [m] continued flat at its last value to length ``n`` >= m (as ``np.pad`` edge mode, a
    tenth of its cost: this runs on every speculative step)."""
    if curve.shape[0] == n:
        return curve
    return np.concatenate([curve, np.full(n - curve.shape[0], curve[-1])])


def batch_accept_curve(rates: Sequence[np.ndarray]) -> np.ndarray:
    """``curve[W - 1] = sum_i A_i(min(W, n_i))`` for W = 1..max n_i, from each row's per-node acceptance
    rates (float64 arrays [n_i], root first): a row whose tree is smaller than W contributes all of it."""
    top = max(r.shape[0] for r in rates)
    padded = np.zeros((len(rates), top))  # [B, n_top], zero past each row's tree
    for i, r in enumerate(rates):
        padded[i, : r.shape[0]] = r
    return padded.sum(axis=0).cumsum()  # [n_top]
