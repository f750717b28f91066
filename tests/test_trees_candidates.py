"""Candidate trees (autoregressive drafters' proposals): validation, and best-first / chain selection
over them (best-first is optimal under A_hat at every size and every prefix is prefix-closed)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bastion
from bastion.core import CandidateTree, IncompatibleComponentsError, InvalidInputError, TreeValidationError
from bastion.testing import random_candidate_tree


@st.composite
def candidate_trees(draw: st.DrawFn, max_nodes: int = 9) -> CandidateTree:
    n = draw(st.integers(1, max_nodes))
    vocab = draw(st.integers(2, 4))
    seed = draw(st.integers(0, 2**16))
    cand = random_candidate_tree(torch.Generator().manual_seed(seed), vocab, n, scale=draw(st.sampled_from([0.5, 3.0])))
    if n > 1 and draw(st.booleans()):  # ties: give a random node the same log q as another node
        lq = cand.log_q.clone()
        i, j = draw(st.integers(1, n - 1)), draw(st.integers(1, n - 1))
        lq[i] = lq[j]
        tokens, parents, log_q = cand.tokens, cand.parents, lq
        cand = CandidateTree(tokens, parents, log_q)
    return cand


def _prefix_closed_subsets(parents: list[int]):
    n = len(parents)
    for mask in range(1 << (n - 1)):
        chosen = {0} | {i for i in range(1, n) if mask >> (i - 1) & 1}
        if all(parents[i] in chosen for i in chosen if i):
            yield chosen


def _is_prefix_closed(tree) -> bool:
    parents = tree.parents.tolist()
    return all(0 <= parents[i] < i for i in range(1, len(parents)))


@given(candidate_trees())
def test_best_first_over_candidates_is_the_brute_force_optimum_at_every_size_and_prefix_closed(cand):
    builder = bastion.registry.create("tree_builder", "best-first")
    n = len(cand)
    tree = builder.build(cand, root_token=cand.root_token, max_nodes=n)
    rho = [math.exp(s) for s in cand.log_scores()]
    parents = cand.parents.tolist()
    best = [0.0] * (n + 1)
    for chosen in _prefix_closed_subsets(parents):
        size = len(chosen)
        best[size] = max(best[size], sum(rho[i] for i in chosen))
    curve = tree.accept_curve().tolist()
    for size in range(1, n + 1):
        sub = builder.build(cand, root_token=cand.root_token, max_nodes=size)
        assert _is_prefix_closed(sub)
        assert torch.equal(sub.tokens, tree.tokens[: len(sub)]) and torch.equal(sub.parents, tree.parents[: len(sub)])
        if size <= len(tree):
            assert curve[size - 1] == pytest.approx(best[size], rel=1e-6, abs=1e-9)
        else:  # the only candidates left out have probability zero
            assert all(rho[i] == 0.0 for i in range(1, n)) or len(tree) == n


def test_best_first_over_candidates_orders_by_rho_and_keeps_the_candidates_log_scores():
    cand = CandidateTree.from_lists([7, 1, 2, 3, 4], [-1, 0, 0, 1, 2], [0.0, math.log(0.6), math.log(0.3), math.log(0.9), math.log(0.5)])
    tree = bastion.registry.create("tree_builder", "best-first").build(cand, root_token=7, max_nodes=4)
    assert tree.tokens.tolist() == [7, 1, 3, 2]  # rho 1, 0.6, 0.54, 0.3 (node 4 has rho 0.15)
    assert tree.parents.tolist() == [-1, 0, 1, 0]
    assert tree.depths.tolist() == [0, 1, 2, 1]
    assert torch.allclose(tree.log_scores.double().exp(), torch.tensor([1.0, 0.6, 0.54, 0.3], dtype=torch.float64), atol=1e-6)


def test_chain_over_candidates_follows_the_most_likely_child_up_to_the_budget_and_depth():
    cand = CandidateTree.from_lists([7, 1, 2, 3, 4, 5], [-1, 0, 0, 2, 2, 4], [0.0, math.log(0.3), math.log(0.6), math.log(0.2), math.log(0.7), 0.0])
    chain = bastion.registry.create("tree_builder", "chain")
    assert chain.build(cand, root_token=7, max_nodes=8).tokens.tolist() == [7, 2, 4, 5]
    assert chain.build(cand, root_token=7, max_nodes=2).tokens.tolist() == [7, 2]
    assert bastion.registry.create("tree_builder", "chain", max_depth=2).build(cand, root_token=7, max_nodes=8).tokens.tolist() == [7, 2, 4]


def test_candidates_with_zero_probability_never_become_nodes():
    cand = CandidateTree.from_lists([0, 1, 2], [-1, 0, 0], [0.0, float("-inf"), math.log(0.5)])
    for name in ("best-first", "chain"):
        tree = bastion.registry.create("tree_builder", name).build(cand, root_token=0, max_nodes=3)
        assert tree.tokens.tolist() == [0, 2]


@pytest.mark.parametrize("name", ["static", "beam"])
def test_marginals_only_builders_decline_candidate_trees_with_an_error_naming_the_kind(name):
    cand = CandidateTree.from_lists([0, 1], [-1, 0], [0.0, -0.1])
    with pytest.raises(IncompatibleComponentsError, match="candidate tree"):
        bastion.registry.create("tree_builder", name).build(cand, root_token=0, max_nodes=4)


def test_builders_declare_the_proposal_kinds_they_take():
    kinds = {name: bastion.registry.create("tree_builder", name).accepts for name in bastion.registry.names("tree_builder")}
    assert kinds["best-first"] == kinds["chain"] == frozenset({"marginals", "candidate_tree"})
    assert kinds["static"] == kinds["beam"] == frozenset({"marginals"})


def test_a_candidate_tree_under_another_root_is_rejected():
    cand = CandidateTree.from_lists([5, 1], [-1, 0], [0.0, -0.1])
    with pytest.raises(InvalidInputError, match="root"):
        bastion.registry.create("tree_builder", "best-first").build(cand, root_token=4, max_nodes=4)


@pytest.mark.parametrize(
    ("tokens", "parents", "log_q", "message"),
    [
        ([0, 1, 2], [-1, 2, 0], [0.0, -0.1, -0.2], "parents precede children"),
        ([0, 1, 1], [-1, 0, 0], [0.0, -1.0, -2.0], "distinct siblings"),
        ([0, 1], [-1, 0], [0.0, 0.5], "log-probability"),
        ([0, 1, 2], [-1, 0, 0], [0.0, math.log(0.7), math.log(0.6)], "probability 1.3"),
        ([0, 1], [0, 0], [0.0, -0.1], "root first"),
        ([0, 9], [-1, 0], [0.0, -0.1], r"\[0, 4\)"),
    ],
)
def test_candidate_tree_validation_names_the_broken_invariant(tokens, parents, log_q, message):
    with pytest.raises(TreeValidationError, match=message):
        CandidateTree.from_lists(tokens, parents, log_q).validate(vocab_size=4)


def test_candidate_tree_rejects_mismatched_fields_at_construction():
    with pytest.raises(InvalidInputError, match="differ in length"):
        CandidateTree(torch.tensor([0, 1]), torch.tensor([-1]), torch.tensor([0.0, -1.0]))
    with pytest.raises(InvalidInputError, match="at least its root"):
        CandidateTree.from_lists([], [], [])


def test_prune_depth_keeps_shallow_candidates_with_renumbered_parents():
    cand = CandidateTree.from_lists([0, 1, 2, 3, 4], [-1, 0, 1, 0, 2], [0.0, -0.1, -0.2, -0.3, -0.4])
    cut = cand.prune_depth(1)
    assert cut.tokens.tolist() == [0, 1, 3] and cut.parents.tolist() == [-1, 0, 0]
    two = cand.prune_depth(2)
    assert two.tokens.tolist() == [0, 1, 2, 3] and two.parents.tolist() == [-1, 0, 1, 0]
    assert cand.prune_depth(5) is cand


def test_proposal_kinds_are_listed_and_recognised():
    assert bastion.core.PROPOSAL_KINDS == ("marginals", "candidate_tree")
    assert bastion.core.proposal_kind(CandidateTree.from_lists([0], [-1], [0.0])) == "candidate_tree"
    assert bastion.core.proposal_kind(bastion.core.Marginals.from_logits(torch.zeros(1, 3))) == "marginals"
    with pytest.raises(InvalidInputError, match="Marginals or bastion.core.CandidateTree"):
        bastion.core.proposal_kind(torch.zeros(3))
