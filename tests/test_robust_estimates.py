"""Cost and acceptance estimates under change: planted timing streams (isolated bursts, a lasting step up
and down, slow drift) and planted acceptance shifts. A burst does not move an estimate; a lasting change
is followed within the documented number of steps; stationary noise detects no change."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

import bastion
from bastion.controllers.calibration import AcceptanceCalibrator, sampling_key
from bastion.controllers.latency.roofline import RooflineLatency
from bastion.utils.running import RobustLevel
from bastion.contract.types import SamplingConfig, StepFeedback
from bastion.testing.tiny import tiny_model

import torch


def _noisy(rng: random.Random, level: float, spread: float = 0.08) -> float:
    return level * (1.0 + spread * (rng.random() - 0.5))


def test_a_robust_level_ignores_isolated_bursts_and_follows_a_lasting_step_within_its_run():
    rng = random.Random(0)
    level = RobustLevel(window=9, run=4, tolerance=0.3)
    for _ in range(30):
        level.observe(_noisy(rng, 1.0))
    for burst in range(10):  # bursts of up to 3 samples at 5x, apart from each other
        for _ in range(1 + burst % 3):
            level.observe(5.0)
        for _ in range(6):
            level.observe(_noisy(rng, 1.0))
        assert abs(level.value - 1.0) < 0.1
    assert level.shifts == 0
    for k in range(4):  # a lasting step up: followed within `run` samples
        level.observe(_noisy(rng, 3.0))
    assert level.shifts == 1 and abs(level.value - 3.0) < 0.3
    for k in range(4):  # and down again
        level.observe(_noisy(rng, 1.0))
    assert level.shifts == 2 and abs(level.value - 1.0) < 0.1
    for k in range(200):  # slow drift (0.5% a sample) is followed without any detected change
        level.observe(_noisy(rng, 1.0 * 1.005**k, 0.02))
    assert abs(level.value / 1.005**199 - 1.0) < 0.05


def _latency() -> RooflineLatency:
    return RooflineLatency(model_config=tiny_model("qwen3").config, probe=False, profile=None)


def _base(n: int) -> float:
    return 0.002 + 0.00005 * n


def _ratios(lat: RooflineLatency, sizes=(1, 4, 16, 32)) -> list[float]:
    return [lat.predict(n, 100) / _base(n) for n in sizes]


def test_the_latency_model_holds_out_an_isolated_burst_and_follows_a_lasting_change_within_shift_run_plus_two():
    rng = random.Random(1)
    lat = _latency()
    sizes = (1, 4, 16, 32)
    for _ in range(64):
        n = rng.choice(sizes)
        lat.observe(n, 100, _noisy(rng, _base(n)))
    calm = _ratios(lat)
    assert all(abs(r - 1.0) < 0.1 for r in calm)
    for _ in range(3):  # a burst: three verify times at 10x
        lat.observe(16, 100, 10 * _base(16))
    assert lat.held_out == 3 and lat.shifts == 0
    assert all(abs(a - b) < 0.02 for a, b in zip(_ratios(lat), calm))  # the decision inputs did not move
    for _ in range(lat.shift_run + 2):  # a lasting 3x slowdown (a steady neighbour)
        n = rng.choice(sizes)
        lat.observe(n, 100, _noisy(rng, 3 * _base(n)))
    assert lat.shifts >= 1 and all(abs(r / 3.0 - 1.0) < 0.15 for r in _ratios(lat))
    for _ in range(lat.shift_run + 2):  # and back
        n = rng.choice(sizes)
        lat.observe(n, 100, _noisy(rng, _base(n)))
    assert all(abs(r - 1.0) < 0.15 for r in _ratios(lat))
    # the machine's shape (verify time against tree size) survived both changes
    shape = [r / _ratios(lat)[0] for r in _ratios(lat)]
    assert all(abs(x - 1.0) < 0.1 for x in shape)


def test_the_latency_model_with_shift_run_zero_fits_every_timing_as_before():
    lat = RooflineLatency(model_config=tiny_model("qwen3").config, probe=False, profile=None, shift_run=0)
    for k in range(40):
        lat.observe(4, 100, 0.01 if k % 5 == 0 else 0.002)
    assert lat.held_out == 0 and lat.load == 1.0


def _steps(rng: random.Random, rate: float, n: int = 12) -> tuple[list[float], list[bool]]:
    """One verified step: n nodes of raw score 0.5 each accepted with probability ``rate``."""
    return [math.log(0.5)] * n, [rng.random() < rate for _ in range(n)]


def _predicted(cal: AcceptanceCalibrator, key) -> float:
    return cal.calibrate_values([math.log(0.5)], key)[0]


def test_the_acceptance_calibration_follows_a_workload_shift_within_twenty_steps_and_not_noise():
    rng = random.Random(2)
    key = sampling_key(SamplingConfig())
    cal = AcceptanceCalibrator()
    for _ in range(300):  # stationary: no shift detected
        cal.observe_values(*_steps(rng, 0.7), key)
    assert cal.shifts(key) == 0 and abs(_predicted(cal, key) - 0.7) < 0.08
    for step in range(20):  # the prompt domain changes: acceptance drops to 0.2
        cal.observe_values(*_steps(rng, 0.2), key)
    assert cal.shifts(key) >= 1 and abs(_predicted(cal, key) - 0.2) < 0.1
    slow = AcceptanceCalibrator(shift_window=0)  # the half-life alone is far slower
    for _ in range(300):
        slow.observe_values(*_steps(rng, 0.7), key)
    for _ in range(20):
        slow.observe_values(*_steps(rng, 0.2), key)
    assert _predicted(slow, key) > 0.4


def test_a_probe_measured_during_a_burst_does_not_raise_the_gates_cap():
    controller = bastion.registry.create("budget_controller", "bastion")
    lat = _latency()
    for n in (1, 4, 16, 32) * 8:
        lat.observe(n, 100, _base(n))
    controller.begin(SamplingConfig())
    for _ in range(8):  # plain steps: the cost a probe is compared with
        controller.observe(StepFeedback(drafted=False, log_scores=torch.zeros(1), accepted_nodes=torch.zeros(1, dtype=torch.long),
                                        context_len=100, verify_s=_base(1), overhead_s=0.0005))
    scores = torch.log(torch.linspace(1.0, 0.05, 16))
    costs = []
    real = controller.gate.observe_probe_cost
    controller.gate.observe_probe_cost = lambda excess: costs.append(excess) or real(excess)

    def probe(slowdown: float) -> None:
        decision = controller.decide(scores, 100, lat, 0.001)
        controller.observe(StepFeedback(drafted=True, log_scores=scores[: decision.n], accepted_nodes=torch.zeros(1, dtype=torch.long),
                                        context_len=100, verify_s=slowdown * decision.predicted_cost_s, overhead_s=0.0))

    for _ in range(4):
        probe(1.1)  # steady probes: evidence
    assert len(costs) == 4
    probe(6.0)  # a probe beside a burst of foreign load: not evidence
    assert len(costs) == 4
    probe(1.1)
    assert len(costs) == 5
