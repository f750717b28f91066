"""Hypothesis strategies and brute-force references shared by the tree tests."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from bastion.core import Marginals, Tree

#: (K, V) pairs whose full candidate tree is small enough to enumerate every prefix-closed subtree
BRUTE_SHAPES = [(1, 1), (1, 3), (1, 6), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2)]


@st.composite
def logits_of_shape(draw: st.DrawFn, k: int, v: int, allow_banned: bool = True) -> torch.Tensor:
    """Logits [k, v] with ties allowed and, optionally, some -inf (banned) entries, never a whole row."""
    vals = draw(st.lists(st.floats(-4.0, 4.0, allow_nan=False, width=32), min_size=k * v, max_size=k * v))
    x = torch.tensor(vals, dtype=torch.float32).reshape(k, v)
    if allow_banned and v > 1:
        banned = draw(st.lists(st.booleans(), min_size=k * v, max_size=k * v))
        mask = torch.tensor(banned).reshape(k, v)
        mask[:, 0] &= ~mask.all(dim=1)  # keep at least one token per row
        x = x.masked_fill(mask, -math.inf)
    return x


@st.composite
def small_marginals(draw: st.DrawFn, allow_banned: bool = True) -> Marginals:
    k, v = draw(st.sampled_from(BRUTE_SHAPES))
    return Marginals.from_logits(draw(logits_of_shape(k, v, allow_banned)))


@st.composite
def medium_marginals(draw: st.DrawFn, distinct: bool = False) -> Marginals:
    k = draw(st.integers(1, 6))
    v = draw(st.integers(1, 12))
    if distinct:  # distinct log-probs per row: no ties, so node choices are unique
        rows = [draw(st.permutations(range(v))) for _ in range(k)]
        scale = draw(st.floats(0.1, 3.0))
        x = torch.tensor(rows, dtype=torch.float32) * scale
    else:
        x = draw(logits_of_shape(k, v))
    return Marginals.from_logits(x)


def brute_force_best(m: Marginals) -> list[float]:
    """``best[n - 1]`` = max A_hat over ALL prefix-closed subtrees of size n of the full K-level V-ary
    candidate tree (root included), by exhaustive enumeration."""
    probs = m.log_probs.double().exp().tolist()  # [K][V]
    k_depth, vocab = len(probs), len(probs[0])

    def subtrees(depth: int, rho: float) -> list[tuple[int, float]]:
        # every prefix-closed subtree rooted at a node of this depth: (size, sum of rho)
        options = [(1, rho)]
        if depth == k_depth:
            return options
        for tok in range(vocab):
            child = [(0, 0.0)] + subtrees(depth + 1, rho * probs[depth][tok])
            options = [(a + b, x + y) for a, x in options for b, y in child]
        return options

    best: dict[int, float] = {}
    for size, total in subtrees(0, 1.0):
        best[size] = max(best.get(size, -1.0), total)
    return [best[n] for n in range(1, max(best) + 1)]


def path_log_score(m: Marginals, tree: Tree, node: int) -> float:
    """Sum of log q_d(token) over the path to ``node`` (root excluded), in float64."""
    lp = m.log_probs.double()
    return sum(float(lp[int(tree.depths[i]) - 1, int(tree.tokens[i])]) for i in tree.path(node)[1:])


def rank_path(m: Marginals, tree: Tree, node: int) -> tuple[int, ...]:
    """The rank path (rank of each token within its depth's sorted marginal) of ``node``."""
    order = torch.argsort(m.log_probs, dim=-1, descending=True, stable=True)  # [K, V]
    rank = torch.argsort(order, dim=-1)  # [K, V]: token -> rank
    return tuple(int(rank[int(tree.depths[i]) - 1, int(tree.tokens[i])]) for i in tree.path(node)[1:])


def assert_prefix_closed_everywhere(tree: Tree) -> None:
    """Every prefix of the node order is a valid, prefix-closed tree: the root comes first and every
    parent precedes its child (checked for all nodes at once), and full validation passes for the
    whole tree and for its middle prefix."""
    n = len(tree)
    assert int(tree.parents[0]) == -1
    idx = torch.arange(1, n)
    assert bool(((tree.parents[1:] >= 0) & (tree.parents[1:] < idx)).all())
    tree.validate()
    tree.truncate(max(1, n // 2)).validate()
