"""Best-first BASTION trees: ordering, optimality against brute force, concavity, options."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bastion
from bastion.core import Marginals
from bastion.trees import BestFirstBuilder

from trees_strategies import (
    assert_prefix_closed_everywhere,
    brute_force_best,
    medium_marginals,
    path_log_score,
    small_marginals,
)


def _positive_nodes(m: Marginals) -> int:
    """Nodes of the full candidate tree with non-zero probability (root included)."""
    alive = torch.isfinite(m.log_probs).sum(dim=1).tolist()  # [K]
    total, level = 1, 1
    for a in alive:
        level *= a
        total += level
    return total


@given(m=small_marginals(), max_nodes=st.integers(1, 40))
def test_best_first_accept_score_equals_brute_force_maximum_for_every_size(m: Marginals, max_nodes: int) -> None:
    tree = BestFirstBuilder().build(m, root_token=0, max_nodes=max_nodes)
    best = brute_force_best(m)
    assert len(tree) == min(max_nodes, _positive_nodes(m))
    curve = tree.accept_curve().tolist()
    for n in range(1, len(tree) + 1):
        assert curve[n - 1] == pytest.approx(best[n - 1], rel=1e-5, abs=1e-6), f"size {n}"


@given(m=medium_marginals(), max_nodes=st.integers(1, 80))
def test_best_first_every_prefix_is_prefix_closed(m: Marginals, max_nodes: int) -> None:
    assert_prefix_closed_everywhere(BestFirstBuilder().build(m, root_token=0, max_nodes=max_nodes))


@given(m=medium_marginals(), max_nodes=st.integers(1, 80))
def test_best_first_scores_are_non_increasing_in_node_order(m: Marginals, max_nodes: int) -> None:
    scores = BestFirstBuilder().build(m, root_token=0, max_nodes=max_nodes).log_scores
    assert float(scores[0]) == 0.0
    assert bool((scores[1:] <= scores[:-1]).all())


@given(m=medium_marginals(), max_nodes=st.integers(1, 80))
def test_best_first_accept_curve_is_concave_in_n(m: Marginals, max_nodes: int) -> None:
    curve = BestFirstBuilder().build(m, root_token=0, max_nodes=max_nodes).accept_curve()  # [n]
    steps = curve.diff()  # marginal gain of each added node
    assert bool((steps[1:] <= steps[:-1] + 1e-12).all())
    assert float(curve[0]) == 1.0


@given(m=medium_marginals(), max_nodes=st.integers(2, 60))
def test_best_first_log_scores_are_sums_of_path_log_probs(m: Marginals, max_nodes: int) -> None:
    tree = BestFirstBuilder().build(m, root_token=0, max_nodes=max_nodes)
    for i in range(len(tree)):
        assert float(tree.log_scores[i]) == pytest.approx(path_log_score(m, tree, i), abs=1e-4)


@given(m=medium_marginals(distinct=True), big=st.integers(2, 80), data=st.data())
def test_best_first_small_budget_tree_is_the_prefix_of_a_large_budget_tree(m: Marginals, big: int, data) -> None:
    small = data.draw(st.integers(1, big))
    large = BestFirstBuilder().build(m, root_token=1 % m.vocab_size, max_nodes=big)
    tree = BestFirstBuilder().build(m, root_token=1 % m.vocab_size, max_nodes=small)
    cut = large.truncate(min(small, len(large)))
    assert torch.equal(tree.tokens, cut.tokens) and torch.equal(tree.parents, cut.parents)
    assert torch.equal(tree.log_scores, cut.log_scores)


@given(m=medium_marginals(), max_depth=st.integers(1, 4), top_k=st.integers(1, 4))
def test_best_first_respects_max_depth_and_top_k(m: Marginals, max_depth: int, top_k: int) -> None:
    tree = BestFirstBuilder(max_depth=max_depth, top_k=top_k).build(m, root_token=0, max_nodes=64)
    assert tree.max_depth <= max_depth
    allowed = torch.topk(m.log_probs, min(top_k, m.vocab_size), dim=-1).values[:, -1]  # [K] k-th best value
    for i in range(1, len(tree)):
        d, tok = int(tree.depths[i]), int(tree.tokens[i])
        assert float(m.log_probs[d - 1, tok]) >= float(allowed[d - 1])
    assert max((len(c) for c in tree.children_lists()), default=0) <= top_k


def test_best_first_top_k_above_vocab_is_clamped_to_vocab() -> None:
    m = Marginals.from_logits(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
    wide = BestFirstBuilder(top_k=1000).build(m, root_token=2, max_nodes=200)
    assert len(wide) == 1 + 4 + 16 + 64  # the full candidate tree: nothing to clamp beyond V
    assert torch.equal(wide.tokens, BestFirstBuilder().build(m, root_token=2, max_nodes=200).tokens)


def test_best_first_root_is_node_zero_with_log_score_zero() -> None:
    m = Marginals.from_logits(torch.randn(4, 9, generator=torch.Generator().manual_seed(1)))
    tree = bastion.registry.create("tree_builder", "best-first").build(m, root_token=7, max_nodes=20)
    assert int(tree.tokens[0]) == 7 and int(tree.parents[0]) == -1 and float(tree.log_scores[0]) == 0.0
    assert tree.device == m.log_probs.device


def test_best_first_max_nodes_one_gives_root_only() -> None:
    m = Marginals.from_logits(torch.zeros(3, 5))
    tree = BestFirstBuilder().build(m, root_token=4, max_nodes=1)
    assert tree.tokens.tolist() == [4] and tree.log_scores.tolist() == [0.0]


def test_best_first_never_emits_zero_probability_tokens() -> None:
    logits = torch.tensor([[0.0, -math.inf, 1.0], [-math.inf, -math.inf, 2.0]])
    tree = BestFirstBuilder().build(Marginals.from_logits(logits), root_token=0, max_nodes=50)
    assert len(tree) == 1 + 2 + 2  # two live tokens at depth 1, one at depth 2 below each
    assert bool(torch.isfinite(tree.log_scores).all())


def test_best_first_handles_half_precision_marginals() -> None:
    lp = torch.log_softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(2)), dim=-1)
    tree16 = BestFirstBuilder().build(Marginals(lp.half()), root_token=0, max_nodes=30)
    tree32 = BestFirstBuilder().build(Marginals(lp), root_token=0, max_nodes=30)
    tree16.validate(vocab_size=50)
    assert tree16.log_scores.dtype == torch.float32
    assert tree16.accept_score() == pytest.approx(tree32.accept_score(), rel=1e-2)


@given(m=medium_marginals(distinct=True), max_nodes=st.integers(1, 80), probe_k=st.integers(1, 4))
def test_best_first_probe_width_never_changes_the_tree(m: Marginals, max_nodes: int, probe_k: int) -> None:
    probed = BestFirstBuilder(probe_k=probe_k).build(m, root_token=0, max_nodes=max_nodes)
    full = BestFirstBuilder(probe_k=None).build(m, root_token=0, max_nodes=max_nodes)
    assert torch.equal(probed.tokens, full.tokens) and torch.equal(probed.parents, full.parents)
    assert torch.equal(probed.log_scores, full.log_scores)


@given(m=small_marginals(), max_nodes=st.integers(1, 40), probe_k=st.integers(1, 2))
def test_best_first_with_a_narrow_probe_still_matches_brute_force(m: Marginals, max_nodes: int, probe_k: int) -> None:
    curve = BestFirstBuilder(probe_k=probe_k).build(m, root_token=0, max_nodes=max_nodes).accept_curve().tolist()
    best = brute_force_best(m)
    assert curve == pytest.approx(best[: len(curve)], rel=1e-5, abs=1e-6)


def test_best_first_probe_result_reports_cut_siblings() -> None:
    from bastion.trees.best_first import expand_best_first
    from bastion.trees.common import top_candidates

    m = Marginals.from_logits(torch.log(torch.tensor([[0.5, 0.3, 0.2]])))
    cand = top_candidates(m.log_probs, 1, 2)  # ranks 0 and 1, where rank 1 is the sentinel
    narrow = expand_best_first(cand, root_token=0, max_nodes=3, width=1)
    assert narrow.cut_best == pytest.approx(math.log(0.3)) and not narrow.is_exact(3)
    assert expand_best_first(cand, root_token=0, max_nodes=2, width=1).is_exact(2)


def _flat_marginals(depth: int = 4, vocab: int = 3000, seed: int = 0) -> Marginals:
    gen = torch.Generator().manual_seed(seed)
    return Marginals.from_logits(torch.randn(depth, vocab, generator=gen))  # [K, V], no strong tokens


@pytest.mark.parametrize("max_nodes", [40, 300, 900])
def test_best_first_threshold_path_equals_the_full_width_tree(max_nodes: int) -> None:
    m = _flat_marginals()
    fast = BestFirstBuilder(probe_k=4).build(m, root_token=0, max_nodes=max_nodes)
    full = BestFirstBuilder(probe_k=None).build(m, root_token=0, max_nodes=max_nodes)
    assert torch.equal(fast.tokens, full.tokens) and torch.equal(fast.parents, full.parents)
    assert torch.equal(fast.log_scores, full.log_scores)


def test_best_first_threshold_path_ranks_only_the_depths_that_can_hold_a_node(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _flat_marginals(depth=6)
    real_topk, calls = torch.topk, []

    def counting_topk(x: torch.Tensor, k: int, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((tuple(x.shape), k))
        return real_topk(x, k, *args, **kwargs)

    monkeypatch.setattr(torch, "topk", counting_topk)
    BestFirstBuilder(probe_k=4).build(m, root_token=0, max_nodes=300)
    wide = [(shape, k) for shape, k in calls if k > 5]  # more than probe + sentinel
    assert len(wide) == 1, calls  # one top-k after the probe
    assert wide[0][0][0] < m.depth  # over the live depths only, never the whole block
