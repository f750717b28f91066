"""The per-request acceptance factor: a request whose drafts fare worse than calibration predicts goes
plain sooner, one that fares as predicted is left alone, each request starts afresh, and the factor
stays within its bounds."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.controllers import BastionController
from bastion.controllers.latency.roofline import RooflineLatency
from bastion.controllers.request_accept import RequestAcceptance
from bastion.contract.errors import InvalidInputError
from bastion.contract.types import SamplingConfig, StepFeedback
from bastion.testing.tiny import tiny_model


def _base(n: int) -> float:
    return 0.002 + 0.00005 * n


def _latency() -> RooflineLatency:
    lat = RooflineLatency(model_config=tiny_model("qwen3").config, probe=False, profile=None)
    for n in (1, 4, 16, 32) * 8:
        lat.observe(n, 100, _base(n))
    return lat


#: a chain of 16 drafted nodes, each 0.85 as likely as its parent: log rho [16], root first
_SCORES = torch.cumsum(torch.full((16,), math.log(0.85)), 0) - math.log(0.85)


def _request(controller: BastionController, lat: RooflineLatency, rate: float, steps: int, rng: random.Random) -> int:
    """One planted request: every drafted node is accepted with probability ``rate`` given its parent.
    Returns the number of speculative steps the controller chose."""
    controller.begin(SamplingConfig())
    drafted = 0
    for _ in range(steps):
        if not controller.speculate():
            controller.observe(StepFeedback(drafted=False, log_scores=torch.zeros(1), accepted_nodes=torch.zeros(1, dtype=torch.long),
                                            context_len=100, verify_s=_base(1), overhead_s=0.0003))
            continue
        decision = controller.decide(_SCORES, 100, lat, 0.001)
        path = [0]
        for node in range(1, decision.n):
            if rng.random() >= rate:
                break
            path.append(node)
        controller.observe(StepFeedback(drafted=True, log_scores=_SCORES[: decision.n], accepted_nodes=torch.tensor(path),
                                        context_len=100, verify_s=_base(decision.n), overhead_s=0.001))
        drafted += 1
    return drafted


@pytest.mark.parametrize("seed", range(4))
def test_a_planted_low_acceptance_request_goes_plain_sooner_with_the_factor_and_a_well_predicted_one_drafts_as_often(seed):
    lat = _latency()
    counts = {}
    for on in (True, False):
        controller = BastionController(request_accept=on)
        rng = random.Random(seed)
        high = _request(controller, lat, 0.9, 60, rng)  # calibration learns a high acceptance
        low = _request(controller, lat, 0.2, 30, rng)  # a request that accepts far less at the same scores
        counts[on] = (high, low)
    assert counts[True][0] == counts[False][0] == 60  # drafts that pay as predicted: drafting every step
    assert counts[True][1] * 1.4 <= counts[False][1]  # the poor request stops drafting much sooner
    assert counts[True][1] <= 14


def test_the_factor_starts_at_one_for_every_request_and_follows_the_requests_own_drafts():
    lat = _latency()
    controller = BastionController(request_accept=True)
    rng = random.Random(5)
    _request(controller, lat, 0.9, 40, rng)
    _request(controller, lat, 0.1, 12, rng)
    assert controller.request_accept.factor < 0.7  # the poor request's drafts pulled it down
    controller.begin(SamplingConfig())
    assert controller.request_accept.factor == 1.0 and controller.request_accept.steps == 0
    assert _request(controller, lat, 0.9, 20, rng) == 20  # the next good request is not held back by it


def test_a_batched_row_does_not_move_the_single_sequence_factor():
    lat = _latency()
    controller = BastionController(request_accept=True)
    controller.begin(SamplingConfig())
    controller.decide(_SCORES, 100, lat, 0.001)
    controller.observe(StepFeedback(drafted=True, log_scores=_SCORES, accepted_nodes=torch.zeros(1, dtype=torch.long),
                                    context_len=100, verify_s=_base(16), overhead_s=0.001, batch_size=2))
    assert controller.request_accept.steps == 0 and controller.request_accept.factor == 1.0


def test_the_documented_recovery_figures_hold():
    factor = RequestAcceptance()
    for _ in range(3):
        factor.observe(1.7, 1.0)
    assert factor.factor == pytest.approx(0.722, abs=0.005)
    single = RequestAcceptance()
    single.observe(3.0, 0.0)
    assert single.factor == pytest.approx(0.4)
    for _ in range(12):  # steps at the calibrated rate bring it back
        single.observe(2.0, 2.0)
    assert single.factor > 0.95


_VALUES = st.one_of(st.floats(-5, 50), st.sampled_from([math.nan, math.inf, -math.inf]))


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.tuples(_VALUES, _VALUES), max_size=40),
    prior=st.floats(0.1, 10),
    decay=st.floats(0.05, 1.0),
    low=st.floats(0.05, 1.0),
    high=st.floats(1.0, 5.0),
)
def test_the_factor_stays_within_its_bounds_whatever_it_hears(steps, prior, decay, low, high):
    factor = RequestAcceptance(prior=prior, decay=decay, low=low, high=high)
    assert factor.factor == 1.0
    for predicted, realized in steps:
        factor.observe(predicted, realized)
        assert low <= factor.factor <= high and math.isfinite(factor.factor)
    factor.reset()
    assert factor.factor == 1.0


@pytest.mark.parametrize(
    "kwargs",
    [{"prior": 0}, {"prior": float("nan")}, {"decay": 0}, {"decay": 1.5}, {"low": 0}, {"low": 1.2}, {"high": 0.5}, {"high": float("inf")}],
)
def test_bad_factor_options_are_refused_with_a_clear_error(kwargs):
    assert BastionController().request_accept is None  # off by default
    with pytest.raises(InvalidInputError):
        RequestAcceptance(**kwargs)
    with pytest.raises(InvalidInputError):
        BastionController(request_accept=kwargs)


def test_steps_that_expect_nothing_age_the_evidence_so_a_low_factor_looks_again():
    factor = RequestAcceptance()
    factor.observe(6.0, 0.0)
    assert factor.factor == pytest.approx(0.25)
    seen = []
    for _ in range(10):  # trees of the root alone: nothing predicted, nothing accepted
        factor.observe(0.0, 0.0)
        seen.append(factor.factor)
    assert seen == sorted(seen) and seen[-1] > 0.75


def test_a_probe_whose_verified_tree_paid_resumes_speculation_though_calibration_predicted_it_would_not():
    lat = _latency()
    controller = BastionController()
    rng = random.Random(7)
    _request(controller, lat, 0.02, 80, rng)  # calibration learns that these scores are rarely accepted
    gate = controller.gate
    assert not gate.speculating
    while not controller.speculate():
        controller.observe(StepFeedback(drafted=False, log_scores=torch.zeros(1), accepted_nodes=torch.zeros(1, dtype=torch.long),
                                        context_len=100, verify_s=_base(1), overhead_s=0.0003))
    decision = controller.decide(_SCORES, 100, lat, 0.001)
    assert decision.gain <= gate.margin and decision.n >= 4  # predicted not to pay
    path = list(range(decision.n))  # but every verified node was accepted: a new text the drafter knows
    controller.observe(StepFeedback(drafted=True, log_scores=_SCORES[: decision.n], accepted_nodes=torch.tensor(path),
                                    context_len=100, verify_s=_base(decision.n), overhead_s=0.001))
    assert gate.speculating and controller.speculate()
