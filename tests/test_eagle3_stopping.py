"""The ``eagle3`` drafter stops expanding where the budget controller's objective stops rising, and never
under the ``full`` controller (EAGLE-3's own tree)."""

from __future__ import annotations

import math

import torch
from test_eagle3_drafter import _bound, _features, _prompts

import bastion
from bastion.core import DraftContext, DraftStep


def _a_hat_per_second(log_scores, draft_s: float) -> float:
    """A controller objective: expected tokens over (one second + the drafting seconds)."""
    return sum(math.exp(s) for s in log_scores) / (1.0 + draft_s)


def _propose(estimate, depth_cost_s: float | None, early_stop: bool = True, total_token: int = 40):
    drafter, target = _bound(total_token=total_token, depth=4, top_k=4, early_stop=early_stop)
    drafter.depth_cost_s = depth_cost_s
    context = _prompts()[2]
    drafter.begin(DraftContext(tokens=torch.tensor(context), features=_features(target, drafter, context)))
    cand = drafter.propose(DraftStep(root_token=7, context_len=len(context), estimate_speedup=estimate))
    return drafter, cand


def test_a_depth_that_costs_more_than_it_gains_is_not_expanded():
    drafter, cand = _propose(_a_hat_per_second, depth_cost_s=10.0)  # each depth: ten seconds
    assert drafter.last_depth == 1 and cand.max_depth == 1 and len(cand) == 1 + 4  # the root's top-k only


def test_depths_whose_children_enter_the_tree_for_free_are_all_expanded_giving_eagle3s_whole_tree():
    everything = 1 + 4 + 4 * 16  # room for every candidate of 4 expansions at top-k 4

    def tokens_only(log_scores, draft_s: float) -> float:  # an objective blind to time
        return sum(math.exp(s) for s in log_scores)

    drafter, cand = _propose(tokens_only, depth_cost_s=0.0, total_token=everything)
    _, full = _propose(None, depth_cost_s=10.0, total_token=everything)  # no objective: EAGLE-3's tree
    assert drafter.last_depth == 5 and len(cand) == everything
    assert cand.tokens.tolist() == full.tokens.tolist() and cand.parents.tolist() == full.parents.tolist()
    assert drafter.depth_cost_s is not None and drafter.depth_cost_s > 0.0  # measured while expanding


def test_a_depth_whose_children_cannot_enter_the_kept_candidates_is_skipped():
    def tokens_only(log_scores, draft_s: float) -> float:
        return sum(math.exp(s) for s in log_scores)

    drafter, cand = _propose(tokens_only, depth_cost_s=1e-3, total_token=1 + 4)  # 4 slots: the root's children
    assert drafter.last_depth == 1 and len(cand) == 5


def test_without_early_stop_the_objective_is_ignored():
    drafter, cand = _propose(_a_hat_per_second, depth_cost_s=10.0, early_stop=False)
    assert drafter.last_depth == 5 and len(cand) == 40  # the root's row + 4 expansions, 39 kept


def test_the_full_controller_offers_no_objective_so_eagle3s_tree_is_never_cut():
    full = bastion.registry.create("budget_controller", "full")
    latency = bastion.registry.create("latency_model", "roofline")
    assert full.speedup_estimator(10, latency, 0.0) is None
