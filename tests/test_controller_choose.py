"""The budget controllers choose exactly what S(n) = A_hat(T_n) * L_AR / C(n) says they should."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bastion
from bastion.controllers import BastionController, FixedController
from bastion.core import BudgetController, BudgetDecision, InvalidInputError, LatencyModel


class PlantedLatency(LatencyModel):
    """T(n, c) = base + per_token * n + per_ctx * c + jump * [n > knee] (no vectorized override)."""

    def __init__(self, base: float, per_token: float, per_ctx: float = 0.0, knee: int = 10**9, jump: float = 0.0):
        self.base, self.per_token, self.per_ctx, self.knee, self.jump = base, per_token, per_ctx, knee, jump
        self.observed: list[tuple[int, int, float]] = []

    def predict(self, n_tokens: int, context_len: int) -> float:
        return self.base + self.per_token * n_tokens + self.per_ctx * context_len + (self.jump if n_tokens > self.knee else 0.0)

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        self.observed.append((n_tokens, context_len, seconds))


def reference_speedups(log_scores: list[float], lat: LatencyModel, ctx: int, overhead: float, sizes: list[int]) -> list[float]:
    """S(n) computed one size at a time in plain Python."""
    l_ar = lat.predict(1, ctx)
    out = []
    for n in sizes:
        a_hat = sum(math.exp(s) for s in log_scores[:n])
        out.append(a_hat * l_ar / (overhead + lat.predict(n, ctx)))
    return out


def first_decrease_reference(speedups: list[float], sizes: list[int]) -> int:
    """The paper's rule: grow n until S decreases, keep the size before the decrease."""
    for j in range(1, len(sizes)):
        if speedups[j] < speedups[j - 1]:
            return sizes[j - 1]
    return sizes[-1]


@st.composite
def planted_rho(draw: st.DrawFn) -> list[float]:
    """Non-increasing log rho in node order, root first (log rho = 0), as a best-first tree has."""
    n = draw(st.integers(1, 80))
    probs = draw(st.lists(st.floats(1e-4, 1.0), min_size=n - 1, max_size=n - 1))
    return [0.0] + sorted((math.log(p) for p in probs), reverse=True)


@given(
    rho=planted_rho(),
    base=st.floats(1e-4, 5e-2),
    per_token=st.floats(1e-6, 2e-3),
    knee=st.integers(1, 80),
    jump=st.floats(0.0, 2e-2),
    overhead=st.floats(0.0, 2e-2),
)
def test_scan_returns_exact_argmax_of_planted_speedup(rho, base, per_token, knee, jump, overhead):
    lat = PlantedLatency(base, per_token, per_ctx=1e-6, knee=knee, jump=jump)
    ctrl = BastionController(rule="scan")
    scores = torch.tensor(rho)  # float32, as trees hold them
    rho = scores.double().tolist()
    n = ctrl.choose(scores, 37, lat, overhead)
    sizes = list(range(1, len(rho) + 1))
    s = reference_speedups(rho, lat, 37, overhead, sizes)
    best = max(s)
    assert math.isclose(s[n - 1], best, rel_tol=1e-9)
    assert n == next(size for size, v in zip(sizes, s) if math.isclose(v, best, rel_tol=1e-9))  # smallest among ties
    decision = ctrl.decide(scores, 37, lat, overhead)
    assert isinstance(decision, BudgetDecision) and decision.n == n
    assert math.isclose(decision.predicted_speedup, best, rel_tol=1e-9)
    assert math.isclose(decision.predicted_accept, sum(math.exp(x) for x in rho[:n]), rel_tol=1e-9)


@given(rho=planted_rho(), base=st.floats(1e-4, 5e-2), per_token=st.floats(1e-6, 2e-3), knee=st.integers(1, 80), jump=st.floats(0.0, 2e-2))
def test_first_decrease_rule_matches_the_papers_walk(rho, base, per_token, knee, jump):
    lat = PlantedLatency(base, per_token, knee=knee, jump=jump)
    ctrl = BastionController(rule="first-decrease")
    scores = torch.tensor(rho)
    rho = scores.double().tolist()
    n = ctrl.choose(scores, 0, lat, 1e-3)
    sizes = list(range(1, len(rho) + 1))
    assert n == first_decrease_reference(reference_speedups(rho, lat, 0, 1e-3, sizes), sizes)


def test_first_decrease_stops_at_a_local_peak_that_the_scan_passes():
    # a latency with a big step at n = 4: S rises to n = 3, falls at 4, then climbs past the first peak
    rho = [0.0] + [math.log(0.99)] * 40
    lat = PlantedLatency(1e-2, 1e-5, knee=3, jump=5e-3)
    assert BastionController(rule="first-decrease").choose(torch.tensor(rho), 0, lat, 0.0) == 3
    assert BastionController(rule="scan").choose(torch.tensor(rho), 0, lat, 0.0) == 41


def test_budget_grows_with_draft_confidence_and_shrinks_with_verify_cost():
    lat = PlantedLatency(1e-2, 2e-4)
    ctrl = BastionController()
    confident = torch.tensor([0.0] + [math.log(0.9**k) for k in range(1, 64)])
    unsure = torch.tensor([0.0] + [math.log(0.3**k) for k in range(1, 64)])
    assert ctrl.choose(confident, 0, lat, 0.0) > ctrl.choose(unsure, 0, lat, 0.0)
    assert ctrl.choose(confident, 0, PlantedLatency(1e-2, 2e-3), 0.0) < ctrl.choose(confident, 0, lat, 0.0)


def test_buckets_restrict_choice_to_allowed_sizes_and_pick_their_best():
    rho = [0.0] + [math.log(0.95**k) for k in range(1, 100)]
    lat = PlantedLatency(1e-2, 1e-4)
    buckets = [1, 8, 16, 32, 64]
    ctrl = BastionController(buckets=buckets)
    scores = torch.tensor(rho)
    rho = scores.double().tolist()
    n = ctrl.choose(scores, 0, lat, 0.0)
    s = reference_speedups(rho, lat, 0, 0.0, buckets)
    assert n == buckets[int(np.argmax(s))]
    assert list(ctrl.candidates(20)) == [1, 8, 16]
    # no bucket fits a tree smaller than every bucket: the whole tree is verified
    assert BastionController(buckets=[32, 64]).choose(torch.tensor(rho[:5]), 0, lat, 0.0) == 5


def test_min_and_max_budget_bound_the_choice():
    rho = torch.tensor([0.0] + [math.log(0.99**k) for k in range(1, 50)])
    cheap = PlantedLatency(1e-2, 1e-7)
    assert BastionController(max_budget=12).choose(rho, 0, cheap, 0.0) == 12
    costly = PlantedLatency(1e-4, 1e-1)
    assert BastionController(min_budget=5).choose(rho, 0, costly, 0.0) == 5
    assert BastionController(min_budget=5).choose(rho[:3], 0, costly, 0.0) == 3  # never beyond the tree


def test_overhead_makes_larger_trees_worthwhile():
    rho = torch.tensor([0.0] + [math.log(0.8**k) for k in range(1, 64)])
    lat = PlantedLatency(1e-3, 1e-4)
    ctrl = BastionController()
    assert ctrl.choose(rho, 0, lat, 0.05) > ctrl.choose(rho, 0, lat, 0.0)


def test_fixed_controller_returns_its_budget_capped_by_tree_size():
    lat = PlantedLatency(1e-2, 1e-4)
    rho = torch.tensor([0.0, -0.1, -0.2, -0.5])
    assert FixedController(budget=3).choose(rho, 0, lat, 0.0) == 3
    ctrl = FixedController(budget=16)
    assert ctrl.choose(rho, 0, lat, 0.0) == 4
    decision = ctrl.decide(rho, 0, lat, 0.0)
    assert decision.n == 4
    assert math.isclose(decision.predicted_accept, float(rho.exp().sum()), rel_tol=1e-6)
    assert FixedController(budget=1, estimate=False).choose(rho, 0, lat, 0.0) == 1


def test_controllers_register_under_their_public_names():
    assert {"bastion", "fixed"} <= set(bastion.registry.names("budget_controller"))
    fixed = bastion.registry.create("budget_controller", "fixed", budget=8)
    adaptive = bastion.registry.create("budget_controller", "bastion", rule="first-decrease")
    assert isinstance(fixed, BudgetController) and fixed.budget == 8
    assert isinstance(adaptive, BastionController) and adaptive.rule == "first-decrease"


@pytest.mark.parametrize(
    "kwargs",
    [{"rule": "greedy"}, {"min_budget": 0}, {"max_budget": 2, "min_budget": 3}, {"buckets": []}, {"buckets": [0, 4]}, {"extra_overhead_s": -1.0}],
)
def test_bad_controller_options_raise_clear_errors(kwargs):
    with pytest.raises(InvalidInputError):
        BastionController(**kwargs)


def test_bad_choose_inputs_raise_clear_errors():
    lat = PlantedLatency(1e-2, 1e-4)
    ctrl = BastionController()
    with pytest.raises(InvalidInputError):
        ctrl.choose(torch.zeros(0), 0, lat, 0.0)
    with pytest.raises(InvalidInputError):
        ctrl.choose(torch.tensor([0.0, float("nan")]), 0, lat, 0.0)
    with pytest.raises(InvalidInputError):
        ctrl.choose(torch.tensor([0.0, -1.0]), 0, lat, float("inf"))
    with pytest.raises(InvalidInputError):
        FixedController(budget=0)
