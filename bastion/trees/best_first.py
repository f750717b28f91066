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

from bastion.core.interfaces import TreeBuilder
from bastion.core.tree import Tree
from bastion.core.types import Marginals
from bastion.trees.common import NEG_INF, Candidates, check_build_args, check_optional_positive, make_tree, top_candidates

__all__ = ["BestFirstBuilder", "expand_best_first"]


def expand_best_first(cand: Candidates, root_token: int, max_nodes: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """Run the best-first heap over host candidates; return (tokens, parents, depths, log scores) lists
    of at most ``max_nodes`` nodes, root first, in non-increasing score order."""
    values, tokens_at = cand.values, cand.tokens
    n_depth, width = cand.depth, cand.width
    tokens = [root_token]
    parents = [-1]
    depths = [0]
    scores = [0.0]
    # heap entries: (-score, depth index d (node depth d + 1), rank r, parent node, parent score)
    heap: list[tuple[float, int, int, int, float]] = []
    if n_depth and max_nodes > 1 and values[0][0] != NEG_INF:
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
        if r + 1 < width:  # next sibling: same parent, next rank
            v = values[d][r + 1]
            if v != NEG_INF:
                push(heap, (-(ps + v), d, r + 1, p, ps))
        if d + 1 < n_depth:  # first child: rank 0 one level deeper
            v = values[d + 1][0]
            if v != NEG_INF:
                push(heap, (-(s + v), d + 1, 0, n, s))
        n += 1
    return tokens, parents, depths, scores


class BestFirstBuilder(TreeBuilder):
    """Best-first BASTION tree builder.

    Options (all optional):

    * ``max_depth``: deepest node depth (default: the marginals' depth K).
    * ``top_k``: at most this many candidate tokens per depth (default ``min(max_nodes - 1, V)``; a
      larger value is clamped to the vocabulary size V). With a cap the tree is optimal among trees
      using only the top-k tokens of each depth.
    """

    def __init__(self, max_depth: int | None = None, top_k: int | None = None) -> None:
        self.max_depth = check_optional_positive("max_depth", max_depth)
        self.top_k = check_optional_positive("top_k", top_k)

    def candidates(self, marginals: Marginals, max_nodes: int) -> Candidates:
        """Phase 1 (device): per-depth top-k candidates, one host transfer."""
        depth = marginals.depth if self.max_depth is None else min(marginals.depth, self.max_depth)
        k = max_nodes - 1 if self.top_k is None else min(self.top_k, max_nodes - 1)
        return top_candidates(marginals.log_probs, depth, k)

    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        root, n = check_build_args(marginals, root_token, max_nodes)
        cand = self.candidates(marginals, n)
        tokens, parents, depths, scores = expand_best_first(cand, root, n)
        return make_tree(tokens, parents, depths, scores, marginals.log_probs.device)

    def __repr__(self) -> str:
        return f"BestFirstBuilder(max_depth={self.max_depth}, top_k={self.top_k})"
