"""Acceptance calibration: the calibrated rate converges to the realized one, stays monotone in rho and
is deterministic; the controller predicts S(n) from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bastion.controllers import AcceptanceCalibrator, BastionController, RooflineLatency, RooflineParams, sampling_key
from bastion.core import SamplingConfig, StepFeedback
from bastion.contract.errors import InvalidInputError
from bastion.testing.tiny import tiny_config

GREEDY = sampling_key(SamplingConfig())
HOT = sampling_key(SamplingConfig(temperature=1.0))


def planted_steps(steps: int, truth, seed: int = 0, nodes: int = 12):
    """Steps of ``nodes`` scores each (log rho in [-6, 0]) accepted with probability ``truth(rho)``."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        log_rho = np.sort(rng.uniform(-6.0, 0.0, nodes))[::-1]
        accepted = rng.random(nodes) < truth(np.exp(log_rho))
        yield log_rho, accepted


def over_confident(rho):
    return 0.3 * rho**2  # the drafter claims rho; reality is far lower and bends further at high rho


def test_calibrated_rates_converge_to_the_planted_acceptance():
    cal = AcceptanceCalibrator(half_life=1e6)  # no forgetting: a plain average over every step
    for log_rho, accepted in planted_steps(3000, over_confident):
        cal.observe(log_rho, accepted, GREEDY)
    probe = np.log(np.array([0.05, 0.15, 0.3, 0.5, 0.7, 0.9]))
    got = cal.calibrate(probe, GREEDY)
    want = over_confident(np.exp(probe))
    assert np.abs(got - want).max() < 0.04, (got, want)
    assert np.abs(np.exp(probe) - want).max() > 0.5  # the raw surrogate was far off


def test_recency_weighting_follows_a_drafter_whose_acceptance_drops():
    cal = AcceptanceCalibrator(half_life=32.0)
    for log_rho, accepted in planted_steps(400, lambda r: r, seed=1):
        cal.observe(log_rho, accepted, GREEDY)
    for log_rho, accepted in planted_steps(400, lambda r: 0.1 * r, seed=2):
        cal.observe(log_rho, accepted, GREEDY)
    assert cal.calibrate(np.log(np.array([0.8])), GREEDY)[0] < 0.2


def test_each_sampling_setting_has_its_own_table():
    cal = AcceptanceCalibrator()
    for log_rho, accepted in planted_steps(300, lambda r: 0.05 * r):
        cal.observe(log_rho, accepted, HOT)
    x = np.log(np.array([0.9]))
    assert cal.calibrate(x, HOT)[0] < 0.2
    assert cal.calibrate(x, GREEDY)[0] == pytest.approx(0.9)  # greedy has seen nothing: the raw score
    assert cal.table(GREEDY) is None and cal.table(HOT) is not None


@given(st.integers(0, 2**31 - 1), st.integers(1, 60))
def test_the_calibrated_map_is_non_decreasing_in_rho(seed, steps):
    rng = np.random.default_rng(seed)
    cal = AcceptanceCalibrator(bins=12)
    for _ in range(steps):
        log_rho = rng.uniform(-14.0, 0.0, int(rng.integers(1, 20)))
        cal.observe(log_rho, rng.random(log_rho.size) < rng.random(), HOT)
    grid = np.linspace(-16.0, 0.0, 200)
    rates = cal.calibrate(grid, HOT)
    assert np.all(np.diff(rates) >= -1e-12)
    assert np.all((rates >= 0) & (rates <= 1))


def test_the_same_observations_give_the_same_calibration():
    a, b = AcceptanceCalibrator(), AcceptanceCalibrator()
    steps = list(planted_steps(200, over_confident, seed=5))
    for log_rho, accepted in steps:
        a.observe(log_rho, accepted, HOT)
    for i, (log_rho, accepted) in enumerate(steps):
        b.observe(log_rho, accepted, HOT)
        if i % 7 == 0:  # interleaved observations of another setting change nothing here
            b.observe(log_rho, ~accepted, GREEDY)
    assert a.table(HOT) == b.table(HOT)


@pytest.mark.parametrize("kwargs", [dict(bins=1), dict(logit_range=(2.0, 1.0)), dict(half_life=0.0), dict(prior_weight=-1.0)])
def test_bad_calibrator_parameters_raise_invalid_input(kwargs):
    with pytest.raises(InvalidInputError):
        AcceptanceCalibrator(**kwargs)


def fixed_latency() -> RooflineLatency:
    # a slow imaginary device: verify time grows with the tree, overheads are negligible
    return RooflineLatency(
        model_config=tiny_config(), device="cpu", peak_flops=1.8e6, bandwidth=1e15,
        params=RooflineParams(1.0, 1.0, 1.0, 1.0), profile=None, online=False,
    )


def test_the_controller_predicts_speedup_from_the_calibrated_acceptance():
    ctrl = BastionController(gate=False)
    ctrl.begin(SamplingConfig(temperature=1.0))
    scores = torch.log(torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]))  # a confident chain
    latency = fixed_latency()
    n_before = ctrl.choose(scores, 10, latency, 0.0)
    assert n_before > 4
    for _ in range(60):  # nothing below the root is ever accepted
        ctrl.observe(StepFeedback(True, scores, torch.tensor([0]), 10, 1.0, 0.0))
    d = ctrl.decide(scores, 10, latency, 0.0)
    n_after = d.n
    assert n_after < n_before
    rates = ctrl.accept_rates(scores.double().numpy())
    assert rates[0] == 1.0 and (rates[1:] < 0.1).all()  # each node below the root now worth < 0.1 token
    assert d.calibrated_accept == pytest.approx(rates[:n_after].sum())
    assert ctrl.choose(scores, 10, latency, 0.0) == n_after  # choosing learns nothing: only outcomes do
    ctrl.begin(SamplingConfig())  # greedy decoding keeps its own (still uncalibrated) table
    assert ctrl.choose(scores, 10, latency, 0.0) == n_before


def test_scores_whose_rho_underflows_calibrate_to_finite_rates_without_warnings() -> None:
    import warnings

    cal = AcceptanceCalibrator()
    key = (0.0, 1.0, 0)
    # exp(-1000) is 0.0 in float64: the only seen bin has a raw mean score of 0
    cal.observe(np.array([-1000.0, -900.0]), np.array([False, False]), key)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rates = cal.calibrate(np.array([-2000.0, -1000.0, -5.0, -0.1]), key)
    assert np.isfinite(rates).all() and (rates >= 0).all() and (rates <= 1).all()
    assert (np.diff(rates) >= 0).all()  # still non-decreasing in rho


@given(st.integers(0, 2**31 - 1), st.integers(1, 40))
def test_calibrate_reads_the_fitted_table_as_documented(seed, steps):
    """Linear in logit(rho) between the seen bins' centres; beyond them the outermost bin's correction
    factor, capped to stay monotone (a reference written on the public table snapshot)."""
    rng = np.random.default_rng(seed)
    cal = AcceptanceCalibrator(bins=10)
    for _ in range(steps):
        log_rho = rng.uniform(-9.0, 0.0, int(rng.integers(1, 16)))
        cal.observe(log_rho, rng.random(log_rho.size) < rng.random(), HOT)
    t = cal.table(HOT)
    xs, ys, raw = (np.array(v) for v in (t.centers, t.rates, t.raw))
    grid = np.concatenate([np.linspace(-20.0, -1e-9, 300), [0.0]])
    rho = np.exp(grid)
    with np.errstate(divide="ignore"):
        z = grid - np.log(-np.expm1(grid))
    want = np.interp(z, xs, ys)
    low = ys[0] / raw[0] if raw[0] > 0 else 1.0
    high = ys[-1] / raw[-1] if raw[-1] > 0 else 1.0
    want = np.where(z < xs[0], np.minimum(rho * low, ys[0]), want)
    want = np.where(z > xs[-1], np.clip(rho * high, ys[-1], 1.0), want)
    np.testing.assert_allclose(cal.calibrate(grid, HOT), want, rtol=1e-9, atol=1e-12)
    assert cal.calibrate_values(grid.tolist(), HOT) == cal.calibrate(grid, HOT).tolist()
