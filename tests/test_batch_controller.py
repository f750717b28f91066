"""The batch-aware controller: one width W for the whole batch, the exact argmax of the predicted
accepted tokens per second; verification expensive in B x W makes W fall to 1 and drafting stop, flat
verification cost makes W grow. The roofline model prices batched verification."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bastion
from bastion.controllers.budget import _RECHECK_EVERY, PLAIN_STEPS_MIN, BastionController, FixedController
from bastion.controllers.latency.roofline import RooflineLatency
from bastion.huggingface.causal_lm import HFTarget
from bastion.engine.costs import CostBySize
from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import BatchStepCosts, LatencyModel
from bastion.contract.types import SamplingConfig, StepFeedback
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_config, tiny_model


class PlantedBatchLatency(LatencyModel):
    """T(B, W, S) = base + per_bw * B * W + per_w2 * W^2 + per_ctx * B * S (a planted law)."""

    def __init__(self, base: float, per_bw: float, per_w2: float = 0.0, per_ctx: float = 0.0) -> None:
        self.base, self.per_bw, self.per_w2, self.per_ctx = base, per_bw, per_w2, per_ctx

    def law(self, b: int, w: int, s: int) -> float:
        return self.base + self.per_bw * b * w + self.per_w2 * w * w + self.per_ctx * b * s

    def predict(self, n_tokens: int, context_len: int) -> float:
        return self.law(1, n_tokens, context_len)

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        pass

    def predict_batch(self, widths: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        b, s = len(context_lens), max(context_lens)
        return torch.tensor([self.law(b, int(w), s) for w in widths.tolist()], dtype=torch.float64)

    def observe_batch(self, width: int, context_lens: Sequence[int], seconds: float) -> None:
        pass


def _row_scores(draw_lists: list[list[float]]) -> list[torch.Tensor]:
    """Each row: root (log rho 0) then non-increasing log rho."""
    return [torch.tensor([0.0] + sorted((-abs(x) for x in row), reverse=True)) for row in draw_lists]


def _brute_force(rows: list[torch.Tensor], ctxs: list[int], lat: PlantedBatchLatency, overhead: float, draft: float) -> np.ndarray:
    """Objective G(W) for W = 1..max n_i, computed directly from its definition: the drafting is spent
    when the width is chosen, so every width pays it."""
    top = max(len(r) for r in rows)
    out = []
    for w in range(1, top + 1):
        accepted = sum(float(r[: min(w, len(r))].double().exp().sum()) for r in rows)
        cost = overhead + lat.law(len(rows), w, max(ctxs)) + draft
        out.append(accepted / cost)
    return np.array(out)


@given(
    rows=st.lists(st.lists(st.floats(0.0, 6.0), min_size=0, max_size=24), min_size=2, max_size=6),
    ctxs_seed=st.integers(0, 1000),
    base=st.floats(1e-4, 1e-2),
    per_bw=st.floats(0.0, 1e-3),
    per_w2=st.floats(0.0, 1e-4),
    overhead=st.floats(0.0, 5e-3),
    draft=st.floats(0.0, 5e-3),
)
def test_chosen_width_of_two_or_more_rows_is_the_exact_argmax_of_the_predicted_batch_throughput(rows, ctxs_seed, base, per_bw, per_w2, overhead, draft):
    scores = _row_scores(rows)
    rng = np.random.default_rng(ctxs_seed)
    ctxs = rng.integers(1, 500, size=len(scores)).tolist()
    lat = PlantedBatchLatency(base, per_bw, per_w2, per_ctx=1e-7)
    decision = BastionController(calibration=False, gate=False).decide_width(scores, ctxs, lat, overhead, draft)
    objective = _brute_force(scores, ctxs, lat, overhead, draft)
    best = objective.max()
    assert objective[decision.n - 1] >= best * (1 - 1e-9)
    assert all(objective[w - 1] < best * (1 - 1e-9) for w in range(1, decision.n))  # smallest among ties
    plain = len(scores) / (overhead + lat.law(len(scores), 1, max(ctxs)))  # a plain batched step: nothing drafted
    tokens = sum(float(r[: min(decision.n, len(r))].double().exp().sum()) for r in scores)
    drafted = draft if decision.n > 1 else 0.0
    assert decision.predicted_speedup == pytest.approx(tokens / (overhead + drafted + lat.law(len(scores), decision.n, max(ctxs))) / plain)


def test_a_batch_prices_every_width_with_the_drafting_it_already_paid():
    """Traced in a server at 2 concurrent requests with the gate off: priced without the drafting it
    follows, verifying the roots alone (W = 1) won 45% of the drafted steps, which then took 34 ms for 2
    tokens where the other steps took 43 ms for 9.3, and that server ran 0.87x a fixed width of 16. The
    width is chosen after the drafting, so W = 1 pays it too: here (planted costs of that trace, 18 ms of drafting, about 4.2
    tokens at W = 16 against 2 at W = 1) the decision verifies a tree."""
    lat = PlantedBatchLatency(base=0.010, per_bw=0.0003)
    chain = [1.0, 1.3, 1.7, 2.2, 2.7, 3.2, 3.7, 4.2, 4.7, 5.2, 5.7, 6.0, 6.0, 6.0, 6.0]  # -log rho, each row
    scores = _row_scores([chain, chain])
    overhead, draft = 0.003, 0.018
    tokens = {w: sum(float(r[:w].double().exp().sum()) for r in scores) for w in range(1, 17)}
    assert tokens[1] == 2.0 and 4.0 < tokens[16] < 5.0
    without_draft = tokens[1] / (overhead + lat.law(2, 1, 9))  # the old price of W = 1
    assert all(without_draft > tokens[w] / (overhead + draft + lat.law(2, w, 9)) for w in range(2, 17))  # the old rule chose W = 1
    decision = BastionController(calibration=False, gate=False).decide_width(scores, [9, 9], lat, overhead, draft)
    assert decision.n > 1
    assert decision.gain is not None and decision.gain > 0  # the gate hears what the verified tree gains


@given(
    row=st.lists(st.floats(0.0, 6.0), min_size=0, max_size=24),
    ctx=st.integers(1, 500),
    overhead=st.floats(0.0, 5e-3),
    draft=st.floats(0.0, 5e-3),
)
def test_a_batch_of_one_row_is_decided_as_a_single_sequence(row, ctx, overhead, draft):
    (scores,) = _row_scores([row])
    lat = PlantedBatchLatency(1e-3, 1e-4, 1e-6, per_ctx=1e-7)
    for make in (lambda: BastionController(calibration=False, gate=False), lambda: FixedController(budget=4)):
        batch = make().decide_width([scores], [ctx], lat, overhead, draft)
        solo = make().decide(scores, ctx, lat, overhead + draft)
        assert batch == solo


def test_fixed_controller_keeps_its_width_for_the_batch():
    scores = _row_scores([[0.1] * 3, [0.2] * 30])
    lat = PlantedBatchLatency(1e-3, 1e-3)
    assert FixedController(budget=8).decide_width(scores, [5, 9], lat, 0.0, 0.0).n == 8
    assert FixedController(budget=64).decide_width(scores, [5, 9], lat, 0.0, 0.0).n == 31  # the largest tree


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model("qwen3", seed=0)


class _CountingDrafter(NoisyOracleDrafter):
    proposals = 0

    def propose(self, step):
        type(self).proposals += 1
        return super().propose(step)


def _run(lat: LatencyModel, noise: float = 0.2) -> tuple[list, int]:
    model = _model()
    _CountingDrafter.proposals = 0
    pipe = bastion.Pipeline(
        HFTarget(model),
        _CountingDrafter(model, block_size=6, noise=noise),
        tree_builder="best-first",
        budget_controller=BastionController(),
        latency_model=lat,
        max_nodes=16,
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (2, 9, 17, 5)]
    results = pipe.generate_batch(prompts, max_new_tokens=40, stop_on_eos=False)
    return [s for r in results for s in r.steps], _CountingDrafter.proposals


def test_verification_expensive_in_batch_times_width_makes_w_one_and_stops_drafting():
    steps, proposals = _run(PlantedBatchLatency(base=1e-4, per_bw=1e-2))
    assert max(s.width for s in steps) == 1
    # drafting only on the re-probes (backing off): far fewer drafter calls than row steps
    assert proposals < len(steps) / 3
    assert sum(not s.drafted for s in steps) > len(steps) / 2  # most steps were plain batched decoding


def test_flat_verification_cost_makes_w_grow():
    # a (planted) verify forward of 100 s whatever B and W: measured drafting and bookkeeping are negligible
    steps, proposals = _run(PlantedBatchLatency(base=100.0, per_bw=0.0), noise=0.2)
    widths = [s.width for s in steps]
    assert np.mean(widths) > 8
    # every row drafted at every step but a last one-token step and the plain steps that first price each batch size
    # (PLAIN_STEPS_MIN steps of `size` row records each)
    sizes = {s.batch_size for s in steps if s.batch_size and s.batch_size > 1}
    assert proposals >= len(steps) - 4 - PLAIN_STEPS_MIN * sum(sizes)
    assert sum(not s.drafted for s in steps) <= 4 + PLAIN_STEPS_MIN * sum(sizes)


def test_roofline_prices_weights_once_per_batch_and_work_per_token():
    lat = RooflineLatency(tiny_config("qwen3", hidden_size=512, intermediate_size=2048, vocab_size=32000), "cpu", probe=False, profile=None)
    w = torch.tensor([1, 4, 16])
    one = lat.predict_batch(w, [100])
    torch.testing.assert_close(one, lat.predict_many(w, 100))  # one row is the single-sequence model
    eight = lat.predict_batch(w, [100] * 8)
    assert bool((eight < 8 * one).all())  # weights are read once per forward, not once per row
    assert bool((eight > one).all())
    assert bool((eight[1:] > eight[:-1]).all())  # and work grows with B x W
    before = float(lat.predict_batch(torch.tensor([4]), [50] * 4)[0])
    for _ in range(40):
        lat.observe_batch(4, [50] * 4, 10 * before)  # the machine is 10x slower than the prior says
    after = float(lat.predict_batch(torch.tensor([4]), [50] * 4)[0])
    assert after == pytest.approx(10 * before, rel=0.2)


class _SmallBatchesPay(LatencyModel):
    """Verification flat in W up to two rows, then priced per row and slot: speculation pays only for
    batches of at most two rows."""

    def predict(self, n_tokens: int, context_len: int) -> float:
        return 1e-2

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        pass

    def predict_batch(self, widths: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        b = len(context_lens)
        per = 0.0 if b <= 2 else 1e-2
        return torch.tensor([1e-2 + per * b * (int(w) - 1) for w in widths.tolist()], dtype=torch.float64)

    def observe_batch(self, width: int, context_lens: Sequence[int], seconds: float) -> None:
        pass


_COSTS = BatchStepCosts(overhead_s=1e-4, draft_s=1e-3, plain_s=1e-4)
_GOOD_ROWS = [[0.05] * 11] * 8  # rows whose drafts are mostly accepted


def _primed(rows: int) -> BastionController:
    """A controller that has seen one speculative batch of ``rows`` rows (its acceptance curve)."""
    c = BastionController(calibration=False)
    c.begin_batch(SamplingConfig(), rows)
    assert c.speculate_batch([10] * rows, _SmallBatchesPay(), _COSTS)  # no acceptance seen yet: the first probe drafts
    c.decide_width(_row_scores(_GOOD_ROWS[:rows]), [10] * rows, _SmallBatchesPay(), _COSTS.overhead_s, _COSTS.draft_s)
    return c


def test_a_probe_predicted_not_to_pay_is_skipped_until_the_backoff_reaches_its_cap():
    c = _primed(8)  # at 8 rows W = 1 wins: the gate switched off
    assert not c.gate.speculating and c.row_curve is not None
    c.begin_batch(SamplingConfig(), 8)
    plain = 0
    while not c.speculate_batch([10] * 8, _SmallBatchesPay(), _COSTS):
        plain += 1
        assert plain < 1000
    assert c.gate.backoff == c.gate.max_backoff  # every earlier probe was predicted to lose and skipped
    assert plain >= 4 + 8 + 16 + 32  # the back-off grew through the skipped probes
    # a batch size never seen starts from the prediction too: skipped at once when it cannot pay
    c.begin_batch(SamplingConfig(), 16)
    assert not c.speculate_batch([10] * 16, _SmallBatchesPay(), _COSTS)


def test_a_batch_predicted_to_pay_drafts_and_a_shrinking_batch_probes_at_once():
    c = _primed(8)
    c.begin_batch(SamplingConfig(), 2)  # a new size where speculation is predicted to pay: draft
    assert c.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS)
    c = _primed(8)  # switched off at 8 rows, waiting out the back-off
    assert c.gate.wait > 0
    assert not c.speculate_batch([10] * 8, _SmallBatchesPay(), _COSTS)
    assert not c.speculate_batch([10] * 5, _SmallBatchesPay(), _COSTS)  # rows left, still predicted to lose
    assert c.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS)  # down to two rows: probe now


def test_gate_state_is_kept_per_batch_size_and_apart_from_single_sequences():
    c = _primed(8)
    assert not c.gate.speculating
    c.begin_batch(SamplingConfig(), 3)
    assert c.gate.speculating  # another batch size starts fresh
    c.begin(SamplingConfig())
    assert c.gate.speculating  # and so does a single sequence
    c.begin_batch(SamplingConfig(), 8)
    assert not c.gate.speculating and c.gate.wait > 0  # 8 rows continue their own back-off


@given(a=st.floats(0.0, 1e-2), b=st.floats(0.0, 1e-3), sizes=st.lists(st.integers(1, 64), min_size=2, max_size=6, unique=True))
def test_costs_by_batch_size_are_exact_where_seen_and_a_nonnegative_fit_elsewhere(a, b, sizes):
    costs = CostBySize()
    assert costs(4) == 0.0
    for s in sizes:
        costs.observe(s, a + b * s)
    for s in sizes:
        assert costs(s) == pytest.approx(a + b * s)
    for s in (1, 3, 100):
        assert costs(s) >= 0.0
        assert costs(s) == pytest.approx(a + b * s, rel=1e-6, abs=1e-12)  # exact data: the fit recovers the law
    one = CostBySize()
    one.observe(8, 4e-3)
    assert one(16) == pytest.approx(8e-3) and one(2) == pytest.approx(1e-3)  # one size seen: proportional to B


def test_single_sequence_steps_teach_the_batch_acceptance_curve_so_a_first_batch_is_not_probed_blind():
    """A lone request's steps (a batch of one asks ``decide``) feed the acceptance curve that batched
    steps predict from. Before: only ``decide_width`` fed it, so after a server's single-request phase
    the first step at 16 rows drafted blind (measured 290-400 ms on the demo pair, some 40 plain steps)."""
    c = BastionController(calibration=False)
    c.begin(SamplingConfig())
    assert c.speculate()
    scores = _row_scores(_GOOD_ROWS[:1])[0]  # [12] log rho, root first
    c.decide(scores, 10, _SmallBatchesPay(), _COSTS.overhead_s + _COSTS.draft_s)
    assert c.row_curve is not None and c.row_curve.shape == scores.shape
    assert c.row_curve[-1] == pytest.approx(float(scores.double().exp().sum()))  # A(T_12), uncalibrated
    c.begin_batch(SamplingConfig(), 16)
    assert not c.speculate_batch([10] * 16, _SmallBatchesPay(), _COSTS)  # predicted not to pay at 16 rows: skipped
    c.begin_batch(SamplingConfig(), 2)
    assert c.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS)  # and to pay at 2


def _backed_off(rows: int, gain: float) -> BastionController:
    """A controller at ``rows`` rows whose gate switched off long ago (back-off 256, 200 plain steps to
    wait) after a probe that measured ``gain``, with a good acceptance curve."""
    c = _primed(rows)
    g = c.gate
    g.speculating, g.backoff, g.wait, g.gain = False, 256, 200, gain
    return c


def test_a_backed_off_batch_gate_probes_early_when_the_predicted_gain_rises_above_the_margin():
    """Measured in serving at 2 concurrent requests: the gate had backed off to 256 steps on a cold
    drafting cost; the prediction from the learnt costs said 1.3x for the next 200 plain steps and the
    gate drafted on 6% of steps while fixed widths ran 1.46x plain decoding."""
    c = _backed_off(2, 0.96)
    predicted = c._predicted_gain([10] * 2, _SmallBatchesPay(), _COSTS)
    assert predicted > 1.1 * 0.96
    calls = 0
    while not c.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS):
        calls += 1
        assert calls <= 4  # within one recheck period, not 200 steps
    assert c.gate.wait == 0


def test_a_backed_off_batch_gate_keeps_waiting_when_the_prediction_is_what_the_probe_measured():
    c = _backed_off(2, 0.0)
    predicted = c._predicted_gain([10] * 2, _SmallBatchesPay(), _COSTS)
    c.gate.gain = predicted  # the last probe measured exactly what the model predicts now
    assert not any(c.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS) for _ in range(40))
    c8 = _backed_off(8, 0.0)  # at 8 rows W = 1 wins: never above the margin
    assert not any(c8.speculate_batch([10] * 8, _SmallBatchesPay(), _COSTS) for _ in range(40))


class _VerifyTooDear(_SmallBatchesPay):
    """Any width above one costs a hundred plain forwards: whatever the trees, W = 1 wins."""

    def predict_batch(self, widths: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        return torch.tensor([1e-2 if int(w) == 1 else 1.0 for w in widths.tolist()], dtype=torch.float64)


def test_a_recheck_probe_whose_trees_did_not_pay_is_not_repeated_on_the_same_prediction():
    """Measured in-process at 3-4 running requests on the demo pair: the re-check predicted 1.3-1.4x
    from the acceptance curve, the probe's own trees chose W = 1 (gain 0), and because the prediction
    stayed above 1.1x that 0, the gate drafted again 4 plain steps later, five times in a row: each a
    wasted draft (14 ms against a 7-8 ms plain step). A re-check now probes only when the prediction
    has risen above the one that started the last probe (or the probe's measured gain)."""
    c = _backed_off(2, 0.96)
    predicted = c._predicted_gain([10] * 2, _SmallBatchesPay(), _COSTS)
    assert predicted > 1.1 * 0.96 and predicted > c.gate.margin
    for _ in range(8):  # the re-check starts a probe
        if c.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS):
            break
    else:
        pytest.fail("the re-check did not probe")
    # the probe's trees (the same good rows: the acceptance curve is unchanged) do not pay this time
    decision = c.decide_width(_row_scores(_GOOD_ROWS[:2]), [10] * 2, _VerifyTooDear(), _COSTS.overhead_s, _COSTS.draft_s)
    assert decision.n == 1 and not c.gate.speculating
    assert c._predicted_gain([10] * 2, _SmallBatchesPay(), _COSTS) == pytest.approx(predicted, rel=0.05)
    assert c.gate.wait >= 64
    drafted = 0
    for _ in range(64):  # each drafted step's trees fail the same way
        if c.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS):
            drafted += 1
            c.decide_width(_row_scores(_GOOD_ROWS[:2]), [10] * 2, _VerifyTooDear(), _COSTS.overhead_s, _COSTS.draft_s)
    assert drafted == 0  # waits out its back-off: the prediction is the one the failed probe started on
    # a prediction that rises well above it (plain steps now measured slower) still probes early
    c.gate.wait = 200
    slower = BatchStepCosts(overhead_s=_COSTS.overhead_s, draft_s=_COSTS.draft_s, plain_s=2e-2)
    assert c._predicted_gain([10] * 2, _SmallBatchesPay(), slower) > 1.1 * predicted
    assert any(c.speculate_batch([10] * 2, _SmallBatchesPay(), slower) for _ in range(_RECHECK_EVERY + 1))


def test_a_batch_whose_speculative_steps_realize_less_than_predicted_stops_drafting():
    """The batched gate heard only the gain each step predicted: in-process at 2-8 running requests on
    the demo pair it kept drafting on 1-4% of steps, 0.84-0.90x speculation off, where no width paid.
    Each speculative batched step's realized gain now corrects the predictions at its batch size."""
    c = BastionController(calibration=False)
    c.begin_batch(SamplingConfig(), 2)
    lat = _SmallBatchesPay()
    rows = _row_scores([[1.0] * 11] * 2)  # rho 0.37 per node: predicted well above a plain step
    plain = 2 / (float(lat.predict_batch(torch.tensor([1]), [10] * 2)[0]) + _COSTS.plain_s)  # tokens/s
    steps = 0
    first_gain = None
    while c.gate.speculating and steps < 12:
        assert c.speculate_batch([10] * 2, lat, _COSTS)
        d = c.decide_width(rows, [10] * 2, lat, _COSTS.overhead_s, _COSTS.draft_s)
        assert d.n > 1
        first_gain = d.gain if first_gain is None else first_gain  # predicted, nothing realized yet
        seconds = 6 / (0.5 * plain)  # each row emits 3 tokens: the step ran at half a plain step's rate
        for _ in range(2):
            c.observe(
                StepFeedback(
                    drafted=True, log_scores=rows[0][: d.n], accepted_nodes=torch.tensor([0, 1, 2]), context_len=10,
                    verify_s=seconds, overhead_s=0.0, batch_size=2,
                )
            )
        steps += 1
    assert not c.gate.speculating and steps <= 6
    assert first_gain > 2 and c.realism(2) == pytest.approx(0.5 / first_gain)  # realized 0.5 of a plain step
    assert c._predicted_gain([10] * 2, lat, _COSTS) < c.gate.margin  # the backed-off gate's re-checks agree
    assert c.realism(3) == 1.0  # another batch size is not judged by this one


def _realize(c: BastionController, rows: list[torch.Tensor], lat: LatencyModel, share: float) -> None:
    """One speculative batched step of ``rows`` (each row emits 3 tokens) whose measured time makes it
    realize ``share`` of the gain it was predicted (before realism)."""
    c.speculate_batch([10] * len(rows), lat, _COSTS)
    d = c.decide_width(rows, [10] * len(rows), lat, _COSTS.overhead_s, _COSTS.draft_s)
    step = c._pending_step
    assert step is not None
    seconds = 3 * len(rows) / (share * step.predicted * step.plain_rate)
    for _ in rows:
        c.observe(
            StepFeedback(
                drafted=True, log_scores=rows[0][: d.n], accepted_nodes=torch.tensor([0, 1, 2]), context_len=10,
                verify_s=seconds, overhead_s=0.0, batch_size=len(rows),
            )
        )


def test_a_run_of_poor_steps_lowers_the_realized_gain_by_its_share_of_recent_steps_not_to_its_own_level():
    """Traced in-process at 2 running requests on the demo pair (the gate's smoothing at 0.2): a few
    drafted steps in a row realized well under their predictions; the realized / predicted level (a
    median that restarts on such a run) fell from 0.98 to 0.55, every later prediction was scaled by it
    (1.42 -> 0.78), and since only drafted steps move it the batch drafted on 1-2% of its steps for the
    next two rounds of requests, while a fixed width of 16 ran 1.10-1.26x it. The realized gain is now
    the recent steps' realized gains over their predictions, summed: such a run weighs its share."""
    c = BastionController(calibration=False)
    c.begin_batch(SamplingConfig(), 2)
    lat = _SmallBatchesPay()
    rows = _row_scores([[1.0] * 11] * 2)
    for _ in range(12):
        _realize(c, rows, lat, 1.0)
    for _ in range(4):
        _realize(c, rows, lat, 0.4)
    assert c.realism(2) == pytest.approx((12 + 4 * 0.4) / 16)
    assert c._predicted_gain([10] * 2, lat, _COSTS) > c.gate.margin  # the batch still drafts


def test_one_slow_step_moves_the_realized_gain_by_at_most_its_share_and_one_fast_step_by_at_most_double_it():
    """A step beside a burst of foreign load realizes a fraction of its prediction, a step timed by a
    glitch many times it: each weighs at most its share of the recent steps, the fast one clipped at
    twice its prediction."""
    c = BastionController(calibration=False)
    c.begin_batch(SamplingConfig(), 2)
    lat = _SmallBatchesPay()
    rows = _row_scores([[1.0] * 11] * 2)
    for k in range(8):
        _realize(c, rows, lat, 0.1 if k == 4 else 1.0)  # one step ten times slower
    assert c.realism(2) == pytest.approx((7 + 0.1) / 8)
    assert c.gate.speculating
    for _ in range(16):  # the slow step leaves the window
        _realize(c, rows, lat, 1.0)
    assert c.realism(2) == pytest.approx(1.0)
    _realize(c, rows, lat, 50.0)  # one step timed fifty times faster than predicted
    assert c.realism(2) == pytest.approx((15 + 2.0) / 16)


def test_a_batch_probe_that_did_not_pay_reports_its_cost_and_the_gates_cap_rises_with_it():
    """In-process at 16 running requests on the demo pair: a batch backed off to its cap (256 steps)
    still drafts each countdown probe, and a probe after a long plain stretch also catches the drafter
    up on every row's positions since its last draft: the one pass of four whose 126 steps included two
    such drafted steps ran 0.79 of speculation off, the other three 0.96-1.00. A single sequence's
    failed probes report their cost and raise the gate's cap (probes that do not pay cost at most 0.5%
    of plain decoding); a batch's did not. They now do, W = 1 included."""
    c = _backed_off(8, 0.0)
    c.gate.wait = 0  # the countdown's probe is due
    lat = _VerifyTooDear()
    assert c.speculate_batch([10] * 8, lat, _COSTS)  # at the cap it drafts whatever the prediction
    rows = _row_scores(_GOOD_ROWS[:8])
    d = c.decide_width(rows, [10] * 8, lat, _COSTS.overhead_s, _COSTS.draft_s)
    assert d.n == 1 and not c.gate.speculating  # its trees did not pay
    plain_step = float(lat.predict_batch(torch.tensor([1]), [10] * 8)[0]) + _COSTS.plain_s
    for _ in range(8):  # the probe took ten plain steps' time and emitted one token per row
        c.observe(
            StepFeedback(
                drafted=True, log_scores=rows[0][:1], accepted_nodes=torch.tensor([0]), context_len=10,
                verify_s=10 * plain_step, overhead_s=0.0, batch_size=8,
            )
        )
    assert c.gate.probe_excess == pytest.approx(9.0)
    assert c.gate.cap == 1800  # ceil(9 / 0.005): such probes cost at most 0.5% of plain decoding


def test_a_batch_gain_is_predicted_from_what_decisions_on_recent_rows_realize_not_from_their_mean_curve():
    """Measured in the batch sweep at 2 rows on the demo pair: after single-sequence traffic whose
    drafts were sometimes confident (wide trees) and sometimes not (W = 1), the gain of the *mean*
    acceptance curve came out 0.73-0.99, so the batch never drafted (its probes were skipped as
    predicted not to pay) while every decision taken on real drafts gained 1.1-3.2 and fixed widths ran
    1.04-1.10x plain decoding. A step decides on its own drafts: the mean of those best choices is what
    drafting realizes, and it is above the best choice for the mean curve."""
    lat = PlantedBatchLatency(base=1e-2, per_bw=2e-3)
    costs = BatchStepCosts(overhead_s=1e-3, draft_s=1.6e-2, plain_s=1e-4)
    confident = _row_scores([[0.01 * k for k in range(1, 12)]])[0]  # [12] log rho: a long chain accepted
    poor = _row_scores([[3.0] * 11])[0]  # [12]: nothing past the root is likely
    c = BastionController(calibration=False)
    c.begin(SamplingConfig())
    for scores in [confident] * 6 + [poor] * 10:  # one request's confident stretch, then a poor one
        c.decide(scores, 10, lat, costs.overhead_s + costs.draft_s)
    mean = c.row_curve
    assert mean is not None
    rate, _, t_verify, sizes = c._batch_rates(2 * mean, [10, 10], lat, costs.overhead_s, costs.draft_s)
    plain = 2 / (t_verify[0] + costs.plain_s)
    assert rate[sizes > 1].max() < plain  # the mean curve: no width pays at 2 rows
    assert c._predicted_gain([10, 10], lat, costs) > 1.0  # the decisions on such rows pay on average
    c.begin_batch(SamplingConfig(), 2)
    assert c.speculate_batch([10, 10], lat, costs)  # so the batch's first step drafts
    c.begin_batch(SamplingConfig(), 16)
    assert not c.speculate_batch([10] * 16, lat, costs)  # at 16 rows no width pays on any of them: skipped


def test_a_backed_off_batch_far_from_paying_predicts_its_gain_less_often(monkeypatch):
    """Each prediction costs about 0.3 ms inside the step loop on the demo pair (a tenth of a plain step
    at 2 rows): measured in-process at 2 running requests, the re-checks every 4 plain steps were most
    of what a drafting engine that never drafts cost beyond speculation off. A batch whose last
    prediction was far below the margin now predicts again after 16 plain steps; one near it after 4."""
    far = _backed_off(8, 0.0)  # at 8 rows W = 1 wins, and drafting costs a plain step: far below the margin
    dear = BatchStepCosts(overhead_s=_COSTS.overhead_s, draft_s=1e-2, plain_s=_COSTS.plain_s)
    near = _backed_off(2, 0.0)
    assert far._predicted_gain([10] * 8, _SmallBatchesPay(), dear) < 0.8 * far.gate.margin
    near.gate.gain = near._predicted_gain([10] * 2, _SmallBatchesPay(), _COSTS)  # probed at this very prediction
    assert near.gate.gain > 0.8 * near.gate.margin
    calls: list[int] = []
    original = BastionController._predicted_gain

    def counted(self: BastionController, *args: object) -> float | None:
        calls.append(id(self))
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(BastionController, "_predicted_gain", counted)
    for _ in range(64):
        assert not far.speculate_batch([10] * 8, _SmallBatchesPay(), dear)
        assert not near.speculate_batch([10] * 2, _SmallBatchesPay(), _COSTS)
    assert calls.count(id(far)) == 64 // 16
    assert calls.count(id(near)) == 64 // 4


def test_a_step_priced_before_any_cost_was_measured_does_not_teach_the_realized_gain():
    """Traced in a server's first steps at 2 concurrent requests: the first two batched steps were
    decided with no drafting or plain-step cost measured at that size (0 s: gains of 1.9 predicted),
    realized a fraction of that, and set the realized / predicted gain at 2 rows to 0.15; every later
    prediction was scaled by it and the batch drafted on 1% of its steps while fixed widths ran
    1.03-1.15x plain decoding. Only a step whose prediction had measured costs teaches it."""
    c = BastionController(calibration=False)
    c.begin_batch(SamplingConfig(), 2)
    lat = _SmallBatchesPay()
    rows = _row_scores([[1.0] * 11] * 2)
    unpriced = BatchStepCosts(overhead_s=0.0, draft_s=0.0, plain_s=0.0)
    for _ in range(3):
        c.speculate_batch([10] * 2, lat, unpriced)
        d = c.decide_width(rows, [10] * 2, lat, unpriced.overhead_s, unpriced.draft_s)
        for _ in range(2):  # each step ran at a fifth of its prediction
            c.observe(
                StepFeedback(
                    drafted=True, log_scores=rows[0][: d.n], accepted_nodes=torch.tensor([0, 1, 2]), context_len=10,
                    verify_s=1.0, overhead_s=0.0, batch_size=2,
                )
            )
    assert c.realism(2) == 1.0


def test_a_row_joining_a_batch_backed_off_to_its_cap_does_not_draft_a_look_predicted_not_to_pay():
    """Traced in one process at 8 running requests (32 prompts, 64 tokens): every join restarts the
    batch under its key, and a join that gets the gate's first-step look (every second to sixteenth
    join) drafted at the back-off's cap whatever the prediction said (0.28-0.53 of a plain step's
    rate): the look chose W = 1, its retry four steps later did too, and the pair cost 33 + 15 ms of
    drafting (the drafter catching up on a hundred plain steps) for nothing, 3% of a pass. The cap's
    forced probe re-measures the acceptance on the countdown's schedule; a look outside it follows the
    prediction."""
    c = _backed_off(8, 0.0)
    g = c.gate
    g._paid[g._key] = 1.0  # the setting's probes paid lately: every join gets a first-step look
    dear = BatchStepCosts(overhead_s=_COSTS.overhead_s, draft_s=1e-2, plain_s=_COSTS.plain_s)
    assert c._predicted_gain([10] * 8, _SmallBatchesPay(), dear) < g.margin
    for _ in range(40):  # rows join and leave: each join restarts the batch at 8 rows
        c.begin_batch(SamplingConfig(), 8)
        assert g.backoff == g.max_backoff
        for _ in range(6):
            assert not c.speculate_batch([10] * 8, _SmallBatchesPay(), dear)
    # the countdown's own probe at the cap still drafts (the acceptance is re-measured now and then)
    g.wait = 0
    g._first_look = g._retry_look = False
    assert c.speculate_batch([10] * 8, _SmallBatchesPay(), dear)


@pytest.mark.parametrize("window", [16, 64])
def test_a_backed_off_batch_predicts_from_its_last_row_window_rows_drafted(window):
    """The gate switches a batch off after steps whose drafts did not pay, so the newest rows of the
    prediction's window are the ones that switched it off. With 16 rows (8 steps at 2 rows) the window
    held little else: served at 2 concurrent requests on the demo pair, the backed-off batch predicted
    0.84x (median) and drafted on 14% of its steps, while those it drafted realized 1.43x speculation
    off; with 64 rows it predicted 1.54x and drafted on 32% of its steps. The window is the last
    ``row_window`` rows drafted, whatever came before."""
    lat = PlantedBatchLatency(base=1e-2, per_bw=2e-3)
    costs = BatchStepCosts(overhead_s=1e-3, draft_s=1.6e-2, plain_s=1e-4)
    confident = _row_scores([[0.01 * k for k in range(1, 12)]])[0]  # [12] log rho: a long chain accepted
    poor = _row_scores([[3.0] * 11])[0]  # [12]: nothing past the root is likely
    c = BastionController(calibration=False, row_window=window)
    c.begin(SamplingConfig())
    for scores in [confident] * 48 + [poor] * 16:  # a long stretch that paid, then the rows that did not
        c.decide(scores, 10, lat, costs.overhead_s + costs.draft_s)
    assert len(c._row_curves) == window
    gain = c._predicted_gain([10, 10], lat, costs)
    assert gain is not None
    if window == 16:
        assert gain < c.gate.margin  # only the rows that did not pay
    else:
        assert gain > c.gate.margin  # the stretch that paid is still three quarters of the window


def test_row_window_must_be_a_positive_int():
    with pytest.raises(InvalidInputError, match="row_window"):
        BastionController(row_window=0)


def test_a_row_that_joined_a_backed_off_batch_is_predicted_from_the_long_run_rows_not_from_those_that_stopped_drafting():
    """Traced in a server at 2 concurrent requests: the rows whose drafts stopped paying filled the
    recent window, a newly joined request's batch was predicted 0.89-0.98 from them, its first-step look
    was skipped and the back-off grew to 64 steps, where a fixed width of 16 ran 1.35x plain decoding.
    A row that joined since the batch last drafted is now predicted from the long-run window; once the
    batch drafts, its own rows are in the recent window and the prediction reads them again."""
    c = BastionController(calibration=False)
    lat = _SmallBatchesPay()
    c.begin_batch(SamplingConfig(), 2)
    poor = [[8.0] * 11] * 2  # drafts that are never accepted
    for rows in [_GOOD_ROWS[:2]] * 40 + [poor] * 8:  # a long good run, then the rows that stopped drafting
        c.decide_width(_row_scores(rows), [10, 10], lat, _COSTS.overhead_s, _COSTS.draft_s)
    recent = c._predicted_gain([10, 10], lat, _COSTS)
    assert recent < c.gate.margin
    c.begin_batch(SamplingConfig(), 1)  # one request finished ...
    c.begin_batch(SamplingConfig(), 2)  # ... and a new one joined
    joined = c._predicted_gain([10, 10], lat, _COSTS)
    assert joined > c.gate.margin  # one row of the recent window, one from the long run
    c.begin_batch(SamplingConfig(), 3)
    assert c._predicted_gain([10] * 3, lat, _COSTS) > 0  # two fresh rows, one recent: still predicted
    c.begin_batch(SamplingConfig(), 2)
    c.decide_width(_row_scores(poor), [10, 10], lat, _COSTS.overhead_s, _COSTS.draft_s)  # the batch drafted
    assert c._predicted_gain([10, 10], lat, _COSTS) == pytest.approx(recent)  # its own rows: the recent window


@pytest.mark.parametrize("measured", range(PLAIN_STEPS_MIN))
def test_a_batch_size_with_too_few_plain_steps_measured_decodes_plainly_and_its_gates_first_look_waits(measured):
    """Below PLAIN_STEPS_MIN plain steps measured at a batch size the batch does not draft, whatever its
    gate says; the gate's first look (a fresh batch drafts its first step) is then still to come once the
    size is priced, and costs that do not count their plain steps (None) leave the gate alone."""
    c = BastionController(calibration=False)
    c.begin_batch(SamplingConfig(), 4)
    unmeasured = BatchStepCosts(_COSTS.overhead_s, _COSTS.draft_s, _COSTS.plain_s, plain_steps=measured)
    assert not c.speculate_batch([10] * 4, _SmallBatchesPay(), unmeasured)
    assert c.gate.speculating and c.gate.gain is None  # the first look has not happened
    priced = BatchStepCosts(_COSTS.overhead_s, _COSTS.draft_s, _COSTS.plain_s, plain_steps=PLAIN_STEPS_MIN)
    assert c.speculate_batch([10] * 4, _SmallBatchesPay(), priced)
    uncounted = BastionController(calibration=False)
    uncounted.begin_batch(SamplingConfig(), 4)
    assert uncounted.speculate_batch([10] * 4, _SmallBatchesPay(), _COSTS)
