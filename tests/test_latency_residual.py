"""The residual table learns what the two-line roofline cannot follow (steps of a real cost curve)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from bastion.controllers import ModelCost, RooflineLatency, RooflineParams
from bastion.controllers.latency.residual import ResidualTable

COST = ModelCost(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768, vocab_size=8192)
PEAK, BW = 5e10, 1e10
PARAMS = RooflineParams(a_c=1.5, b_c=2e-3, a_m=1.2, b_m=2e-3)


def stepped_truth(n: np.ndarray, c: np.ndarray) -> np.ndarray:
    """A cost curve with steps, written independently of the model: the roofline law times a factor
    that jumps at n = 24 (a kernel switching tile size) and at n = 96 (a threading threshold)."""
    x_c = COST.flops(n, c) / PEAK
    x_m = COST.bytes(n, c) / BW
    base = np.maximum(PARAMS.a_c * x_c + PARAMS.b_c, PARAMS.a_m * x_m + PARAMS.b_m)
    return base * np.where(n >= 96, 0.7, np.where(n >= 24, 1.45, 1.0))


def make_model(**kwargs) -> RooflineLatency:
    return RooflineLatency(cost=COST, device="cpu", peak_flops=PEAK, bandwidth=BW, profile=None, **kwargs)


def feed(model: RooflineLatency, rng: np.random.Generator, count: int) -> None:
    n = rng.integers(1, 193, count)
    c = rng.integers(16, 1025, count)
    t = stepped_truth(n, c) * (1 + 0.03 * rng.standard_normal(count))
    slow = rng.random(count) < 0.05
    t[slow] *= rng.uniform(2.0, 5.0, slow.sum())  # page faults, pauses
    for a, b, s in zip(n, c, t):
        model.observe(int(a), int(b), float(s))
    model.refit()


def median_error(model: RooflineLatency) -> float:
    grid_n = np.arange(1, 193)
    errs = []
    for ctx in (16, 128, 1024):
        pred = model.predict_many(torch.from_numpy(grid_n), ctx).numpy()
        truth = stepped_truth(grid_n, np.full_like(grid_n, ctx))
        errs.append(np.abs(pred - truth) / truth)
    return float(np.median(np.concatenate(errs)))


def test_residual_follows_steps_the_roofline_cannot():
    with_table, plain = make_model(), make_model(residual=False)
    for model in (with_table, plain):
        feed(model, np.random.default_rng(0), 600)
    # two lines cannot follow the steps; the table does, despite noise and slow outliers
    assert median_error(with_table) < 0.05
    assert median_error(with_table) < 0.5 * median_error(plain)


def test_residual_is_deterministic_given_the_same_observations():
    a, b = make_model(), make_model()
    for model in (a, b):
        feed(model, np.random.default_rng(1), 200)
    sizes = torch.arange(1, 300)
    assert torch.equal(a.predict_many(sizes, 300), b.predict_many(sizes, 300))


def test_sizes_never_observed_keep_the_roofline_prediction():
    table = ResidualTable()
    table.fit(np.array([4, 4, 5, 5]), np.array([100, 120, 100, 130]), np.log(np.array([1.5, 1.5, 1.5, 1.5])))
    assert table.factor(np.array([4]), 100)[0] > 1.2  # observed cell moved towards 1.5
    assert table.factor(np.array([512]), 100)[0] == 1.0  # an unseen size keeps the plain roofline


def test_residual_survives_a_profile_round_trip(tmp_path):
    model = make_model()
    feed(model, np.random.default_rng(2), 300)
    path = model.save_profile(tmp_path / "profile.json")
    loaded = RooflineLatency(cost=COST, device="cpu", peak_flops=PEAK, bandwidth=BW, profile=path)
    sizes = torch.arange(1, 193)
    assert torch.allclose(loaded.predict_many(sizes, 200), model.predict_many(sizes, 200), rtol=1e-9)


def test_repeated_predictions_follow_refits_contexts_and_sizes_exactly():
    """The per-step prediction reuses its lines in the context while sizes, parameters, residual table
    and context bin stay the same; every answer still equals the roofline times the residual factor
    times the load factor."""
    model = make_model()
    rng = np.random.default_rng(3)
    sizes = torch.arange(1, 65)

    def formula(n: torch.Tensor, c: int) -> np.ndarray:
        grid = n.numpy().astype(np.float64)
        return model.roofline_seconds(grid, c) * model.residual.factor(grid, c) * model.load

    seen = []
    for step in range(120):
        c = int(rng.integers(10, 3000))
        for n in (sizes, sizes[:17], torch.tensor([1, 64])):  # another controller's sizes in between
            got = model.predict_many(n, c).numpy()
            np.testing.assert_allclose(got, formula(n, c), rtol=1e-12)
        assert model.predict(9, c) == pytest.approx(float(formula(torch.tensor([9]), c)[0]), rel=1e-12)
        seen.append(model.predict_many(sizes, 500).numpy().copy())
        model.observe(int(rng.integers(1, 65)), c, float(stepped_truth(np.array([16]), np.array([c]))[0]))
    # the refits (every few observations) changed the answer for the same sizes and context
    assert len({tuple(np.round(s, 15)) for s in seen}) > 3


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9000), c=st.integers(0, 2**21))
def test_the_scalar_factor_equals_the_array_factor_for_any_size_and_context(n, c):
    model = make_model()
    feed(model, np.random.default_rng(3), 120)
    table = model.residual
    assert table.n_points > 0  # a fitted table, not the all-zero one
    assert table.factor_one(float(n), c) == pytest.approx(float(table.factor(np.array([float(n)]), c)[0]), rel=1e-12)


def test_a_recorded_batched_timing_has_the_ideal_times_of_the_array_path():
    model = make_model()
    feed(model, np.random.default_rng(4), 40)
    for width, ctxs in ((1, [7]), (5, [100, 30, 64]), (33, [2000, 1])):
        before = model._count
        model.observe_batch(width, ctxs, 0.01)
        i = before % model._t.size
        x_c, x_m = model.ideal_batch_times(np.array([float(width)]), ctxs)
        assert model._x_c[i] == pytest.approx(float(x_c[0]), rel=1e-12) and model._x_m[i] == pytest.approx(float(x_m[0]), rel=1e-12)
        assert model._n[i] == width * len(ctxs) and model._c[i] == max(ctxs)
