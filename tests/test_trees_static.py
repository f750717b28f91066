"""Static (fixed-topology) trees and the chain baseline."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bastion
from bastion.core import InvalidInputError, Marginals
from bastion.trees import DEFAULT_CHOICES, ChainBuilder, StaticBuilder, choices_from_branching

from trees_strategies import assert_prefix_closed_everywhere, medium_marginals, path_log_score, rank_path


@st.composite
def topologies(draw: st.DrawFn) -> list[tuple[int, ...]]:
    """A random prefix-closed set of rank paths (depth <= 4, ranks < 4)."""
    paths: list[tuple[int, ...]] = []
    frontier: list[tuple[int, ...]] = [()]
    while frontier and len(paths) < 30:
        node = frontier.pop(0)
        if len(node) >= 4:
            continue
        for r in range(draw(st.integers(0 if node else 1, 3))):
            paths.append(node + (r,))
            frontier.append(node + (r,))
    return draw(st.permutations(paths))  # order of the list must not matter


@st.composite
def distinct_marginals(draw: st.DrawFn, k: int, v: int) -> Marginals:
    rows = [draw(st.permutations(range(v))) for _ in range(k)]
    return Marginals.from_logits(torch.tensor(rows, dtype=torch.float32) * draw(st.floats(0.2, 2.0)))


@given(choices=topologies(), data=st.data())
def test_static_reproduces_its_choices_topology_exactly(choices: list[tuple[int, ...]], data) -> None:
    m = data.draw(distinct_marginals(k=4 + data.draw(st.integers(0, 2)), v=4 + data.draw(st.integers(0, 3))))
    tree = StaticBuilder(choices=choices).build(m, root_token=0, max_nodes=1000)
    built = [rank_path(m, tree, i) for i in range(1, len(tree))]
    assert sorted(built) == sorted(choices)
    assert_prefix_closed_everywhere(tree)
    for i in range(len(tree)):
        assert float(tree.log_scores[i]) == pytest.approx(path_log_score(m, tree, i), abs=1e-4)


@given(branching=st.lists(st.integers(1, 3), min_size=1, max_size=4), data=st.data())
def test_static_reproduces_its_branching_topology_exactly(branching: list[int], data) -> None:
    m = data.draw(distinct_marginals(k=len(branching), v=3))
    tree = StaticBuilder(branching=branching).build(m, root_token=1, max_nodes=10_000)
    level_sizes = [math.prod(branching[: d + 1]) for d in range(len(branching))]
    assert len(tree) == 1 + sum(level_sizes)
    assert torch.bincount(tree.depths).tolist() == [1, *level_sizes]
    for node, kids in enumerate(tree.children_lists()):
        d = int(tree.depths[node])
        assert len(kids) == (branching[d] if d < len(branching) else 0)


@given(m=medium_marginals(), max_nodes=st.integers(1, 100))
def test_static_default_every_prefix_is_prefix_closed_and_scores_sorted(m: Marginals, max_nodes: int) -> None:
    tree = bastion.registry.create("tree_builder", "static").build(m, root_token=0, max_nodes=max_nodes)
    assert_prefix_closed_everywhere(tree)
    assert bool((tree.log_scores[1:] <= tree.log_scores[:-1]).all())


def test_static_default_topology_is_depth_six_rank_sum_two() -> None:
    builder = bastion.registry.create("tree_builder", "static")
    assert len(builder) == 84 and len(DEFAULT_CHOICES) == 83
    assert builder.depth == 6 and all(sum(c) <= 2 for c in DEFAULT_CHOICES)
    m = Marginals.from_logits(torch.randn(15, 100, generator=torch.Generator().manual_seed(0)))
    assert len(builder.build(m, root_token=3, max_nodes=512)) == 84


def test_static_budget_keeps_the_highest_scoring_part_of_the_topology() -> None:
    m = Marginals.from_logits(torch.randn(6, 30, generator=torch.Generator().manual_seed(3)) * 2)
    full = StaticBuilder().build(m, root_token=0, max_nodes=1000)
    cut = StaticBuilder().build(m, root_token=0, max_nodes=20)
    assert len(cut) == 20
    assert torch.equal(cut.tokens, full.tokens[:20]) and torch.equal(cut.parents, full.parents[:20])


def test_static_drops_nodes_deeper_than_the_marginals_or_wider_than_the_vocab() -> None:
    m = Marginals.from_logits(torch.randn(2, 3, generator=torch.Generator().manual_seed(4)))
    tree = StaticBuilder(branching=(5, 1, 1)).build(m, root_token=0, max_nodes=100)
    assert len(tree) == 1 + 3 + 3  # ranks 3, 4 do not exist in V = 3; depth 3 > K = 2
    tree.validate(vocab_size=3)


def test_static_drops_zero_probability_tokens_with_their_subtrees() -> None:
    logits = torch.tensor([[0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0]])
    tree = StaticBuilder(branching=(2, 2)).build(Marginals.from_logits(logits), root_token=0, max_nodes=100)
    assert len(tree) == 1 + 1 + 2


@pytest.mark.parametrize(
    "options, message",
    [
        ({"choices": [[0], [1, 0], [2]]}, "no parent"),
        ({"choices": [[0], [0]]}, "listed twice"),
        ({"choices": [[]]}, "empty path"),
        ({"choices": []}, "at least one"),
        ({"choices": [[0], [-1]]}, ">= 0"),
        ({"choices": ["ab"]}, "sequence of ranks"),
        ({"branching": [2, 0]}, ">= 1"),
        ({"branching": []}, "at least one depth"),
        ({"branching": [1000, 1000]}, "more than"),
        ({"choices": [[0]], "branching": [1]}, "not both"),
    ],
)
def test_static_rejects_malformed_topologies_with_a_clear_error(options: dict, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        bastion.registry.create("tree_builder", "static", **options)


def test_choices_from_branching_lists_every_rank_path() -> None:
    assert choices_from_branching([2, 1]) == ((0,), (1,), (0, 0), (1, 0))


@given(m=medium_marginals(), max_nodes=st.integers(1, 20), max_depth=st.none() | st.integers(1, 8))
def test_chain_is_the_top1_path_cut_to_budget_and_depth(m: Marginals, max_nodes: int, max_depth: int | None) -> None:
    tree = bastion.registry.create("tree_builder", "chain", max_depth=max_depth).build(m, root_token=0, max_nodes=max_nodes)
    depth = m.depth if max_depth is None else min(m.depth, max_depth)
    assert len(tree) == min(max_nodes, depth + 1)
    assert tree.parents.tolist() == list(range(-1, len(tree) - 1))
    top1 = m.log_probs.max(dim=-1)  # values [K], indices [K]
    for i in range(1, len(tree)):
        assert float(m.log_probs[i - 1, int(tree.tokens[i])]) == float(top1.values[i - 1])
    expected = torch.cat([torch.zeros(1), top1.values[: len(tree) - 1].double().cumsum(0).float()])
    assert torch.allclose(tree.log_scores, expected, atol=1e-5)


def test_chain_of_a_block_16_drafter_has_16_nodes() -> None:
    m = Marginals.from_logits(torch.randn(15, 64, generator=torch.Generator().manual_seed(5)))
    assert len(ChainBuilder().build(m, root_token=0, max_nodes=1024)) == 16
