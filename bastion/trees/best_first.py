"""The BASTION best-first tree: the optimal tree under A_hat for every size at once.

Each node's path score is rho = prod of q_k over its path (log rho = sum of log q_k). A candidate at
depth d is "rank r below parent p"; its score is log rho(p) + log q_d(rank-r token). Among the
candidates below one parent, rank r + 1 never beats rank r, and a child never beats its parent. So a
max-heap seeded with the root's first child, where popping a node pushes

* its **next sibling** (same parent, next rank at the same depth) and
* its **first child** (rank 0 at the next depth),

pops candidates in non-increasing rho, each after its parent. The first n pops form the tree of size
n with the largest sum of rho (A_hat) among all prefix-closed trees of that size: one run to
``max_nodes`` serves every smaller budget through ``Tree.truncate``.
"""

from __future__ import annotations

import heapq

import torch

from bastion.contract.candidates import CandidateTree
from bastion.contract.interfaces import TreeBuilder
from bastion.utils.sync import to_device
from bastion.contract.tree import Tree
from bastion.contract.types import Marginals
from bastion.trees.candidates import check_candidate_args, select_best_first
from bastion.trees.common import NEG_INF, Candidates, check_build_args, check_optional_positive, make_tree, top_candidates

__all__ = ["BestFirstBuilder", "Expansion", "expand_best_first", "threshold_candidates"]

#: thresholds are lowered by this much so that float rounding never drops a candidate on the boundary
_SLACK = 1e-4


class Expansion:
    """Host result of a best-first run: node lists plus what the run had to leave out."""

    __slots__ = ("tokens", "parents", "depths", "scores", "cut_best")

    def __init__(
        self, tokens: list[int], parents: list[int], depths: list[int], scores: list[float], cut_best: float
    ) -> None:
        self.tokens = tokens
        self.parents = parents
        self.depths = depths
        self.scores = scores
        #: best score of a sibling the run could not push because it lay past the probed ranks (-inf: none)
        self.cut_best = cut_best

    def lists(self) -> tuple[list[int], list[int], list[int], list[float]]:
        return self.tokens, self.parents, self.depths, self.scores

    def is_exact(self, max_nodes: int) -> bool:
        """True when no unprobed candidate could have entered the tree: the tree is full and every cut
        sibling scores strictly below its last node."""
        if self.cut_best == NEG_INF:
            return True
        return len(self.tokens) == max_nodes and self.cut_best < self.scores[-1]


def expand_best_first(cand: Candidates, root_token: int, max_nodes: int, width: int | None = None) -> Expansion:
    """Run the best-first heap over host candidates: at most ``max_nodes`` nodes, root first, in
    non-increasing score order.

    Rows of ``cand`` may differ in length (a row holds every candidate its depth can need). Only ranks
    ``< width`` (default: all) become nodes. When a row holds more ranks than ``width``, rank ``width``
    is a sentinel: the exact score of the first sibling past ``width`` is recorded in
    :attr:`Expansion.cut_best` so the caller can tell whether probing more ranks could change the tree.
    """
    values, tokens_at = cand.values, cand.tokens
    n_depth = cand.depth
    widths = [len(row) if width is None else min(width, len(row)) for row in values]  # usable ranks per depth
    cut_best = NEG_INF
    tokens = [root_token]
    parents = [-1]
    depths = [0]
    scores = [0.0]
    # heap entries: (-score, depth index d (node depth d + 1), rank r, parent node, parent score)
    heap: list[tuple[float, int, int, int, float]] = []
    if n_depth and max_nodes > 1 and widths[0] and values[0][0] != NEG_INF:
        heap.append((-values[0][0], 0, 0, 0, 0.0))
    push, pop = heapq.heappush, heapq.heappop
    n = 1
    while heap and n < max_nodes:
        neg, d, r, p, ps = pop(heap)
        s = -neg
        tokens.append(tokens_at[d][r])
        parents.append(p)
        depths.append(d + 1)
        scores.append(s)
        if r + 1 < widths[d]:  # next sibling: same parent, next rank
            v = values[d][r + 1]
            if v != NEG_INF:
                push(heap, (-(ps + v), d, r + 1, p, ps))
        elif r + 1 < len(values[d]):  # the next sibling lies past the probed ranks: remember its score
            cut = ps + values[d][r + 1]
            if cut > cut_best:
                cut_best = cut
        if d + 1 < n_depth and widths[d + 1]:  # first child: rank 0 one level deeper
            v = values[d + 1][0]
            if v != NEG_INF:
                push(heap, (-(s + v), d + 1, 0, n, s))
        n += 1
    return Expansion(tokens, parents, depths, scores, cut_best)


def threshold_candidates(
    log_probs: torch.Tensor, probe: Candidates, floor: float, k: int, max_nodes: int
) -> Candidates:
    """Every candidate of an optimal tree whose last node scores at least ``floor``, per depth, sorted.

    A node at depth ``d`` below a parent scoring ``s_p`` scores ``s_p + log q_d(x)``, and no parent at
    depth ``d - 1`` scores more than ``B[d - 1]`` (the sum of each shallower depth's best
    log-probability, read off ``probe``'s rank 0). So a token can only enter the tree when
    ``log q_d(x) >= floor - B[d - 1]``, and a depth whose best token misses its bound holds no node at
    all. The depths that can hold a node take their top-``k`` in ONE top-k over just those rows and
    ONE host transfer; the host then keeps the tokens that clear their bound. Depth 1 keeps all its
    ``k`` ranks (its bound is the floor itself; when it holds ``max_nodes - 1`` ranks they alone make a
    full tree). No rank cap beyond ``k``: the result is exact.
    """
    best = [row[0] for row in probe.values]  # [D] rank-0 log-probability per depth
    limits, above = [], 0.0
    for top in best:
        limits.append(floor - above - _SLACK)
        above += top
    live = [0] + [d for d in range(1, len(best)) if limits[d] <= best[d]]  # depths that can hold a node
    rows = log_probs.index_select(0, to_device(live, torch.long, log_probs.device))  # [L, V]
    picked = top_candidates(rows, len(live), k)  # one top-k, one host transfer
    values: list[list[float]] = [[] for _ in best]
    tokens: list[list[int]] = [[] for _ in best]
    values[0], tokens[0] = picked.values[0], picked.tokens[0]
    if len(values[0]) >= max_nodes - 1:  # depth 1 alone fills a tree: the optimal last score is at least this
        floor = max(floor, values[0][max_nodes - 2])
        limits = [lim + (floor - limits[0] - _SLACK) for lim in limits]
    for r, d in enumerate(live[1:], start=1):
        keep = sum(1 for v in picked.values[r] if v >= limits[d])
        values[d], tokens[d] = picked.values[r][:keep], picked.tokens[r][:keep]
    return Candidates(values, tokens)


class BestFirstBuilder(TreeBuilder):
    """Best-first BASTION tree builder.

    Options (all optional):

    * ``max_depth``: deepest node depth (default: the marginals' depth K).
    * ``top_k``: at most this many candidate tokens per depth (default ``min(max_nodes - 1, V)``; a
      larger value is clamped to the vocabulary size V). With a cap the tree is optimal among trees
      using only the top-k tokens of each depth.
    * ``probe_k``: ranks fetched by the first, cheap top-k (default 32). When the heap would need a
      rank past it (checked exactly with one extra sentinel rank), the probe's tree still bounds the
      optimal tree's last score from below, and one comparison pass collects exactly the tokens that
      can reach that bound (:func:`threshold_candidates`); no second top-k and no rank cap, so the
      result never depends on ``probe_k``; only the time does.

    It also takes a :class:`~bastion.core.CandidateTree` (autoregressive drafters): the ``max_nodes``
    candidates of highest rho, in non-increasing rho order (``max_depth`` applies; ``top_k`` and
    ``probe_k`` concern marginals only).
    """

    builds_valid_trees = True  # checked by check_tree_builder in the test suite
    accepts = frozenset({"marginals", "candidate_tree"})

    def __init__(self, max_depth: int | None = None, top_k: int | None = None, probe_k: int | None = 32) -> None:
        self.max_depth = check_optional_positive("max_depth", max_depth)
        self.top_k = check_optional_positive("top_k", top_k)
        self.probe_k = check_optional_positive("probe_k", probe_k)

    def _depth(self, marginals: Marginals) -> int:
        return marginals.depth if self.max_depth is None else min(marginals.depth, self.max_depth)

    def _full_k(self, marginals: Marginals, max_nodes: int) -> int:
        k = max_nodes - 1 if self.top_k is None else min(self.top_k, max_nodes - 1)
        return min(k, marginals.vocab_size)

    def candidates(self, marginals: Marginals, max_nodes: int) -> Candidates:
        """Phase 1 (device), full width: per-depth top-k candidates, one host transfer."""
        return top_candidates(marginals.log_probs, self._depth(marginals), self._full_k(marginals, max_nodes))

    def expand(self, marginals: Marginals, root_token: int, max_nodes: int) -> Expansion:
        """Both phases: probe ``probe_k`` ranks first; when that is not provably enough, collect exactly the
        tokens that can still enter the tree (:func:`threshold_candidates`)."""
        depth, k = self._depth(marginals), self._full_k(marginals, max_nodes)
        if self.probe_k is not None and self.probe_k < k:
            # probe_k ranks plus one sentinel rank
            probe = top_candidates(marginals.log_probs, depth, self.probe_k + 1)
            result = expand_best_first(probe, root_token, max_nodes, width=self.probe_k)
            if result.is_exact(max_nodes):
                return result
            if len(result.tokens) == max_nodes:
                # the probe's last score bounds the optimal tree's last score from below: keep only the
                # tokens that can reach it (exact, and far fewer than k ranks on every depth)
                cand = threshold_candidates(marginals.log_probs[:depth], probe, result.scores[-1], k, max_nodes)
                return expand_best_first(cand, root_token, max_nodes)
        cand = top_candidates(marginals.log_probs, depth, k)
        return expand_best_first(cand, root_token, max_nodes)

    def build(self, marginals: Marginals | CandidateTree, root_token: int, max_nodes: int) -> Tree:
        if isinstance(marginals, CandidateTree):
            return select_best_first(marginals, check_candidate_args(marginals, root_token, max_nodes), self.max_depth)
        root, n = check_build_args(marginals, root_token, max_nodes)
        result = self.expand(marginals, root, n)
        return make_tree(*result.lists(), marginals.log_probs.device)

    def __repr__(self) -> str:
        return f"BestFirstBuilder(max_depth={self.max_depth}, top_k={self.top_k}, probe_k={self.probe_k})"
