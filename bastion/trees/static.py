"""Static (fixed-topology) trees, EAGLE / Medusa style, filled with the per-depth top-k tokens.

A topology is a set of **rank paths**: ``(r1, ..., rd)`` is the node reached by taking the rank-r1 token
at depth 1, then the rank-r2 token at depth 2, and so on (rank 0 = most likely token at that depth).
Give it either as

* ``choices``: an explicit list of rank paths (every proper prefix must be listed too), or
* ``branching``: children per node at each depth, e.g. ``(4, 2, 1)`` = every node at depth d - 1 gets
  the top ``branching[d - 1]`` tokens of depth d.

The default (no option) is :data:`DEFAULT_CHOICES`: every rank path of depth <= 6 whose ranks sum to at
most 2 (83 nodes + root). Like EAGLE's hand-made trees it is wide near the root and spends its depth
on the most likely continuations.

Nodes come out ordered by decreasing path score (ties: shallower first), so every prefix is
prefix-closed and ``max_nodes`` keeps the most likely part of the topology. Nodes deeper than the
marginals' depth K, ranks beyond the vocabulary, and zero-probability tokens are dropped together
with their subtrees.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

from bastion.utils.checks import check_int
from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import TreeBuilder
from bastion.contract.tree import Tree
from bastion.contract.types import Marginals
from bastion.trees.common import NEG_INF, check_build_args, make_tree, top_candidates

__all__ = ["StaticBuilder", "DEFAULT_CHOICES", "choices_from_branching", "default_choices"]

#: refuse topologies larger than this (a typo like branching=(100, 100, 100) would build 10**6 nodes)
MAX_TOPOLOGY_NODES = 1 << 16


def default_choices(max_depth: int = 6, max_rank_sum: int = 2) -> tuple[tuple[int, ...], ...]:
    """Rank paths of depth 1..``max_depth`` whose ranks sum to at most ``max_rank_sum``."""
    out: list[tuple[int, ...]] = []
    for d in range(1, max_depth + 1):
        out.extend(p for p in itertools.product(range(max_rank_sum + 1), repeat=d) if sum(p) <= max_rank_sum)
    return tuple(out)


DEFAULT_CHOICES: tuple[tuple[int, ...], ...] = default_choices()


def choices_from_branching(branching: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Expand per-depth branching factors into the full list of rank paths."""
    widths = [check_int(f"branching[{i}]", b) for i, b in enumerate(branching)]
    if not widths:
        raise InvalidInputError("branching must list at least one depth")
    total, level = 0, 1
    for w in widths:
        level *= w
        total += level
        if total > MAX_TOPOLOGY_NODES:
            raise InvalidInputError(f"branching {tuple(widths)} describes more than {MAX_TOPOLOGY_NODES} nodes")
    out: list[tuple[int, ...]] = []
    for d in range(1, len(widths) + 1):
        out.extend(itertools.product(*(range(w) for w in widths[:d])))
    return tuple(out)


def _normalize_choices(choices: Iterable[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    paths: list[tuple[int, ...]] = []
    for c in choices:
        if isinstance(c, (str, bytes)) or not isinstance(c, Sequence):
            raise InvalidInputError(f"each choice must be a sequence of ranks, got {c!r}")
        path = tuple(c)
        if not path:
            raise InvalidInputError("choices list the non-root nodes; the empty path (the root) is implicit")
        for r in path:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise InvalidInputError(f"ranks must be ints >= 0, got {r!r} in choice {list(path)}")
        paths.append(path)
    if not paths:
        raise InvalidInputError("choices must list at least one node")
    if len(paths) > MAX_TOPOLOGY_NODES:
        raise InvalidInputError(f"choices list {len(paths)} nodes; at most {MAX_TOPOLOGY_NODES} are allowed")
    seen = set(paths)
    if len(seen) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise InvalidInputError(f"choice {list(dup)} is listed twice")
    for p in paths:
        if len(p) > 1 and p[:-1] not in seen:
            raise InvalidInputError(f"choice {list(p)} has no parent: its prefix {list(p[:-1])} is not listed")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))  # breadth-first: parents precede children


class StaticBuilder(TreeBuilder):
    """Fixed-topology builder; see the module docstring for ``choices`` / ``branching``."""

    builds_valid_trees = True  # checked by check_tree_builder in the test suite

    def __init__(
        self, choices: Sequence[Sequence[int]] | None = None, branching: Sequence[int] | None = None
    ) -> None:
        if choices is not None and branching is not None:
            raise InvalidInputError("give the static topology as choices or as branching, not both")
        if branching is not None:
            if isinstance(branching, (str, bytes)) or not isinstance(branching, Sequence):
                raise InvalidInputError(f"branching must be a sequence of ints, got {branching!r}")
            raw = choices_from_branching(branching)
        else:
            raw = DEFAULT_CHOICES if choices is None else choices
        self.choices = _normalize_choices(raw)
        index = {p: i for i, p in enumerate(self.choices)}
        # topology arrays in breadth-first order; parent -1 means "the root"
        self._parent = [index[p[:-1]] if len(p) > 1 else -1 for p in self.choices]
        self._depth = [len(p) for p in self.choices]
        self._rank = [p[-1] for p in self.choices]
        self.depth = max(self._depth)
        self.width = max(self._rank) + 1

    def __len__(self) -> int:
        """Nodes in the full topology, root included."""
        return len(self.choices) + 1

    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        root, n = check_build_args(marginals, root_token, max_nodes)
        cand = top_candidates(marginals.log_probs, min(self.depth, marginals.depth), self.width)
        depth_limit, width = cand.depth, cand.width
        score = [NEG_INF] * len(self.choices)  # -inf marks a dropped node (its subtree follows)
        for i, (p, d, r) in enumerate(zip(self._parent, self._depth, self._rank)):
            if d > depth_limit or r >= width:
                continue
            base = 0.0 if p < 0 else score[p]
            if base == NEG_INF:
                continue
            score[i] = base + cand.values[d - 1][r]
        kept = [i for i in range(len(self.choices)) if score[i] != NEG_INF]
        kept.sort(key=lambda i: (-score[i], self._depth[i], i))  # parents first: child score <= parent score
        kept = kept[: n - 1]
        node_of = {i: j + 1 for j, i in enumerate(kept)}
        tokens, parents, depths, scores = [root], [-1], [0], [0.0]
        for i in kept:
            d = self._depth[i]
            tokens.append(cand.tokens[d - 1][self._rank[i]])
            parents.append(0 if self._parent[i] < 0 else node_of[self._parent[i]])
            depths.append(d)
            scores.append(score[i])
        return make_tree(tokens, parents, depths, scores, marginals.log_probs.device)

    def __repr__(self) -> str:
        return f"StaticBuilder({len(self.choices)} nodes, depth {self.depth})"
