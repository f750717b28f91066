"""A budget controller's speedup estimator (what an autoregressive drafter asks before each depth) is the
controller's own objective: it equals the S(n) ``decide`` predicts for the same tree and overhead, and
asking it changes nothing (neither the gate nor the calibration)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bastion.controllers import BastionController, FixedController
from bastion.core import BudgetController, StepFeedback
from bastion.testing.contract import FixedLatencyModel

_LOG_RHO = st.lists(st.floats(min_value=-8.0, max_value=0.0), min_size=0, max_size=40)


def _tree(log_rho: list[float]) -> list[float]:
    """Root first, then non-increasing log rho (best-first order)."""
    return [0.0, *sorted(log_rho, reverse=True)]


@given(_LOG_RHO, st.floats(min_value=0.0, max_value=0.05), st.floats(min_value=0.0, max_value=0.05), st.sampled_from(["scan", "first-decrease"]))
def test_bastion_estimate_equals_the_speedup_decide_predicts_for_the_same_tree(log_rho, other_s, draft_s, rule):
    lat = FixedLatencyModel(base_s=2e-3, per_token_s=3e-4, per_context_s=1e-7)
    ctl = BastionController(rule=rule, calibration=False, gate=False)
    scores = _tree(log_rho)
    estimate = ctl.speedup_estimator(37, lat, other_s)
    decision = ctl.decide(torch.tensor(scores, dtype=torch.float64), 37, lat, other_s + draft_s)
    assert estimate(scores, draft_s) == pytest.approx(decision.predicted_speedup, rel=1e-12)


@given(_LOG_RHO, st.integers(min_value=1, max_value=20), st.floats(min_value=0.0, max_value=0.05))
def test_fixed_estimate_equals_decide_once_the_tree_holds_the_budget_and_prices_smaller_trees_at_it(log_rho, budget, draft_s):
    lat = FixedLatencyModel()
    ctl = FixedController(budget=budget)
    scores = _tree(log_rho)
    estimate = ctl.speedup_estimator(11, lat, 0.004)
    if len(scores) >= budget:
        decision = ctl.decide(torch.tensor(scores), 11, lat, 0.004 + draft_s)
        assert estimate(scores, draft_s) == pytest.approx(decision.predicted_speedup, rel=1e-6)
    else:  # all of a smaller tree, at the verify time of the budget it is growing toward
        a_hat = sum(math.exp(s) for s in scores)
        expected = a_hat * lat.predict(1, 11) / (0.004 + draft_s + lat.predict(budget, 11))
        assert estimate(scores, draft_s) == pytest.approx(expected, rel=1e-6)


def test_asking_the_estimate_leaves_gate_and_calibration_untouched():
    lat = FixedLatencyModel()
    ctl = BastionController()
    scores = torch.tensor(_tree([-0.1, -0.5, -2.0, -3.0]))
    ctl.decide(scores, 20, lat, 0.001)  # a first decision: the gate has a running gain
    gate_before = (ctl.gate.speculating, ctl.gate.backoff, ctl.gate.gain)
    estimate = ctl.speedup_estimator(20, lat, 0.001)
    for draft_s in (0.0, 0.5, 100.0):  # a hopeless draft would switch the gate off if it were told
        estimate(scores.tolist(), draft_s)
    assert (ctl.gate.speculating, ctl.gate.backoff, ctl.gate.gain) == gate_before
    assert ctl.decide(scores, 20, lat, 0.001).n == ctl.decide(scores, 20, lat, 0.001).n


def test_calibrated_estimate_uses_the_learnt_acceptance():
    lat = FixedLatencyModel()
    ctl = BastionController(gate=False)
    scores = _tree([-0.1, -0.2, -0.3])
    raw = BastionController(calibration=False, gate=False).speedup_estimator(5, lat, 0.0)(scores, 0.0)
    assert ctl.speedup_estimator(5, lat, 0.0)(scores, 0.0) == pytest.approx(raw)  # nothing learnt yet
    miss = StepFeedback(drafted=True, log_scores=torch.tensor(scores), accepted_nodes=torch.tensor([0]), context_len=5, verify_s=1e-3, overhead_s=1e-3)
    for _ in range(60):  # these scores never get accepted
        ctl.observe(miss)
    assert ctl.speedup_estimator(5, lat, 0.0)(scores, 0.0) < raw


def test_a_controller_without_an_estimate_offers_none():
    class Third(BudgetController):
        def choose(self, log_scores, context_len, latency, overhead_s):
            return 1

    assert Third().speedup_estimator(3, FixedLatencyModel(), 0.0) is None


def test_estimate_falls_as_drafting_takes_longer():
    est = BastionController(calibration=False, gate=False).speedup_estimator(9, FixedLatencyModel(), 1e-3)
    scores = _tree([math.log(0.9), math.log(0.8)])
    assert est(scores, 0.0) > est(scores, 1e-3) > est(scores, 1e-2)
