"""Tree utilities: masks, positions, paths, children, truncation and validation errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bastion.core import InvalidInputError, Marginals, Tree, TreeValidationError
from bastion.trees import BestFirstBuilder

from trees_strategies import medium_marginals


def _tree() -> Tree:
    # root(9) -> a(1) -> c(3)
    #         -> b(2) -> d(3)
    return Tree.from_parents([9, 1, 2, 3, 3], [-1, 0, 0, 1, 2], log_scores=[0.0, -0.1, -0.2, -0.3, -0.4])


@given(m=medium_marginals(), max_nodes=st.integers(1, 50))
def test_ancestor_mask_holds_exactly_the_nodes_on_each_path(m: Marginals, max_nodes: int) -> None:
    tree = BestFirstBuilder().build(m, root_token=0, max_nodes=max_nodes)
    mask = tree.ancestor_mask()  # [n, n]
    expected = torch.zeros(len(tree), len(tree), dtype=torch.bool)
    for i in range(len(tree)):
        expected[i, tree.path(i)] = True
    assert torch.equal(mask, expected)
    assert torch.equal(mask.sum(dim=1), tree.depths + 1)


def test_position_ids_are_context_length_plus_depth() -> None:
    assert _tree().position_ids(10).tolist() == [10, 11, 11, 12, 12]


def test_path_and_children_follow_parents() -> None:
    tree = _tree()
    assert tree.path(3) == [0, 1, 3] and tree.path(4) == [0, 2, 4] and tree.path(0) == [0]
    assert tree.children(0) == [1, 2] and tree.children(3) == []
    assert tree.children_lists() == [[1, 2], [3], [4], [], []]
    with pytest.raises(InvalidInputError, match="out of range"):
        tree.path(5)


def test_accept_curve_is_the_cumulative_sum_of_rho() -> None:
    curve = _tree().accept_curve()
    expected = torch.tensor([0.0, -0.1, -0.2, -0.3, -0.4], dtype=torch.float32).double().exp().cumsum(0)
    assert torch.allclose(curve, expected)
    assert _tree().truncate(3).accept_score() == pytest.approx(float(expected[2]))


def test_truncate_rejects_sizes_outside_one_to_n() -> None:
    for n in (0, 6, 2.0):
        with pytest.raises(InvalidInputError):
            _tree().truncate(n)  # type: ignore[arg-type]


def _broken(**changes: list) -> Tree:
    base = {"tokens": [9, 1, 2, 3], "parents": [-1, 0, 0, 1], "depths": [0, 1, 1, 2], "log_scores": [0.0, -1.0, -1.0, -2.0]}
    base.update(changes)
    return Tree(
        torch.tensor(base["tokens"]),
        torch.tensor(base["parents"]),
        torch.tensor(base["depths"]),
        torch.tensor(base["log_scores"], dtype=torch.float32),
    )


@pytest.mark.parametrize(
    "changes, invariant",
    [
        ({"parents": [-1, 0, 3, 1]}, "parents precede children"),
        ({"parents": [0, 0, 0, 1]}, "root first"),
        ({"depths": [0, 1, 2, 2]}, "depth"),
        ({"tokens": [9, 1, 1, 3]}, "distinct siblings"),
        ({"log_scores": [0.0, float("nan"), -1.0, -2.0]}, "finite"),
        ({"tokens": [9, 1, 2]}, "entries"),
    ],
)
def test_validate_names_the_broken_invariant(changes: dict, invariant: str) -> None:
    with pytest.raises(TreeValidationError, match=invariant):
        _broken(**changes).validate()


def test_validate_checks_the_vocabulary_when_given() -> None:
    _broken().validate(vocab_size=10)
    with pytest.raises(TreeValidationError, match="tokens must lie"):
        _broken().validate(vocab_size=5)
