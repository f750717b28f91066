"""Bad input to the tree builders, the beam baseline, and registration of the built-ins."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bastion
from bastion.core import InvalidInputError, Marginals, TreeBuilder
from bastion.trees import BeamBuilder, BestFirstBuilder

from trees_strategies import assert_prefix_closed_everywhere, medium_marginals, small_marginals

BUILDERS = ["best-first", "chain", "static", "beam"]


@pytest.fixture
def marginals() -> Marginals:
    return Marginals.from_logits(torch.randn(4, 10, generator=torch.Generator().manual_seed(0)))


def test_builtin_tree_builders_are_registered_and_build_with_default_options(marginals: Marginals) -> None:
    assert set(BUILDERS) <= set(bastion.registry.names("tree_builder"))
    for name in BUILDERS:
        builder = bastion.registry.create("tree_builder", name)
        assert isinstance(builder, TreeBuilder)
        tree = builder.build(marginals, root_token=5, max_nodes=16)
        tree.validate(vocab_size=10)
        assert int(tree.tokens[0]) == 5 and float(tree.log_scores[0]) == 0.0 and 1 < len(tree) <= 16


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("max_nodes", [0, -3, 2.5, True, "8", None])
def test_builders_reject_max_nodes_that_is_not_an_int_at_least_one(name: str, max_nodes, marginals: Marginals) -> None:
    with pytest.raises(InvalidInputError, match="max_nodes"):
        bastion.registry.create("tree_builder", name).build(marginals, root_token=0, max_nodes=max_nodes)


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("root", [-1, 10, 3.0])
def test_builders_reject_root_tokens_outside_the_vocabulary(name: str, root, marginals: Marginals) -> None:
    with pytest.raises(InvalidInputError, match="root_token"):
        bastion.registry.create("tree_builder", name).build(marginals, root_token=root, max_nodes=8)


@pytest.mark.parametrize("name", BUILDERS)
def test_builders_reject_marginals_that_are_not_marginals(name: str) -> None:
    with pytest.raises(InvalidInputError, match="Marginals"):
        bastion.registry.create("tree_builder", name).build(torch.zeros(3, 4), root_token=0, max_nodes=8)


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, 5.0])
def test_builders_reject_nan_inf_or_unnormalized_log_probs(name: str, bad: float) -> None:
    lp = torch.log_softmax(torch.zeros(3, 6), dim=-1)
    lp[1, 4] = bad
    with pytest.raises(InvalidInputError, match="NaN|log-probabilities"):
        bastion.registry.create("tree_builder", name).build(Marginals(lp), root_token=0, max_nodes=64)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_from_logits_rejects_nan_and_positive_inf(bad: float) -> None:
    logits = torch.zeros(2, 5)
    logits[0, 1] = bad
    with pytest.raises(InvalidInputError, match="NaN"):
        Marginals.from_logits(logits)


def test_zero_depth_marginals_are_rejected() -> None:
    with pytest.raises(InvalidInputError, match="K = 0"):
        Marginals.from_logits(torch.zeros(0, 5))
    with pytest.raises(InvalidInputError, match="K = 0"):
        Marginals(torch.zeros(0, 5))


@pytest.mark.parametrize("name, option", [("best-first", "top_k"), ("best-first", "max_depth"), ("chain", "max_depth"),
                                          ("beam", "top_k"), ("beam", "beam_width")])
@pytest.mark.parametrize("value", [0, -1, 1.5, "3"])
def test_builder_options_must_be_positive_ints(name: str, option: str, value) -> None:
    with pytest.raises(InvalidInputError, match=option):
        bastion.registry.create("tree_builder", name, **{option: value})


@given(m=medium_marginals(), max_nodes=st.integers(1, 60), top_k=st.integers(1, 5), width=st.integers(1, 5))
def test_beam_every_prefix_is_prefix_closed(m: Marginals, max_nodes: int, top_k: int, width: int) -> None:
    tree = BeamBuilder(top_k=top_k, beam_width=width).build(m, root_token=0, max_nodes=max_nodes)
    assert_prefix_closed_everywhere(tree)
    assert bool((tree.log_scores[1:] <= tree.log_scores[:-1]).all())


@given(m=small_marginals(), max_nodes=st.integers(1, 30), top_k=st.integers(1, 3), width=st.integers(1, 3))
def test_beam_never_beats_best_first_and_matches_it_when_the_beam_keeps_everything(
    m: Marginals, max_nodes: int, top_k: int, width: int
) -> None:
    best = BestFirstBuilder().build(m, root_token=0, max_nodes=max_nodes).accept_score()
    beam = BeamBuilder(top_k=top_k, beam_width=width).build(m, root_token=0, max_nodes=max_nodes).accept_score()
    assert beam <= best + 1e-6
    full = BeamBuilder(top_k=1000, beam_width=1000).build(m, root_token=0, max_nodes=max_nodes).accept_score()
    assert full == pytest.approx(best, rel=1e-6)


def test_a_greedy_beam_of_width_one_is_not_optimal_where_best_first_is() -> None:
    # depth 1: a 0.6 / 0.4 split; depth 2 peaked: the second depth-1 token beats the chain's second node
    logits = torch.log(torch.tensor([[0.6, 0.4], [0.5, 0.5]]))
    m = Marginals.from_logits(logits)
    best = BestFirstBuilder().build(m, root_token=0, max_nodes=3)
    assert best.accept_score() == pytest.approx(1 + 0.6 + 0.4)
    beam = BeamBuilder(top_k=1, beam_width=1).build(m, root_token=0, max_nodes=3)
    assert beam.accept_score() == pytest.approx(1 + 0.6 + 0.3)


def test_beam_needs_a_top_k_and_a_beam_width() -> None:
    with pytest.raises(InvalidInputError, match="top_k and beam_width"):
        BeamBuilder(top_k=None)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", BUILDERS)
def test_trees_live_on_the_device_of_the_marginals(name: str) -> None:
    lp = torch.log_softmax(torch.randn(6, 1000, device="cuda"), dim=-1)
    tree = bastion.registry.create("tree_builder", name).build(Marginals(lp), root_token=3, max_nodes=64)
    assert all(t.device.type == "cuda" for t in (tree.tokens, tree.parents, tree.depths, tree.log_scores))
    cpu = bastion.registry.create("tree_builder", name).build(Marginals(lp.cpu()), root_token=3, max_nodes=64)
    assert tree.accept_score() == pytest.approx(cpu.accept_score(), rel=1e-5)
