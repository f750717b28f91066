"""EAGLE-2 style beam tree: expand the best nodes of each depth, then rerank everything drafted.

At depth d, each of the ``beam_width`` highest-scoring nodes of depth d - 1 (the root at d = 1) gets its
``top_k`` most likely children; all children join a candidate pool. Finally the pool is reranked by path
score and the best ``max_nodes - 1`` candidates become the tree (ties: shallower first, so parents precede
children). Unlike best-first, a node whose parent fell out of a beam is never considered, so the tree
is not always A_hat-optimal; it is here as a baseline.
"""

from __future__ import annotations

from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import TreeBuilder
from bastion.contract.tree import Tree
from bastion.contract.types import Marginals
from bastion.trees.common import NEG_INF, check_build_args, check_optional_positive, make_tree, top_candidates

__all__ = ["BeamBuilder"]


class BeamBuilder(TreeBuilder):
    """Options: ``top_k`` children per expanded node (default 10), ``beam_width`` nodes expanded per depth
    (default 10), ``max_depth`` (default: the marginals' depth K)."""

    builds_valid_trees = True  # checked by check_tree_builder in the test suite

    def __init__(self, top_k: int = 10, beam_width: int = 10, max_depth: int | None = None) -> None:
        if top_k is None or beam_width is None:
            raise InvalidInputError("the beam builder needs top_k and beam_width (ints >= 1), got None")
        self.top_k: int = check_optional_positive("top_k", top_k)  # type: ignore[assignment]
        self.beam_width: int = check_optional_positive("beam_width", beam_width)  # type: ignore[assignment]
        self.max_depth = check_optional_positive("max_depth", max_depth)

    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        root, n = check_build_args(marginals, root_token, max_nodes)
        depth = marginals.depth if self.max_depth is None else min(marginals.depth, self.max_depth)
        cand = top_candidates(marginals.log_probs, depth if n > 1 else 0, self.top_k)
        # pool entries: (score, depth, rank, parent pool index or -1 for the root)
        pool: list[tuple[float, int, int, int]] = []
        frontier: list[tuple[float, int]] = [(0.0, -1)]  # (score, pool index)
        for d in range(cand.depth):
            row = cand.values[d]
            start = len(pool)
            for fs, f in frontier:
                for r, v in enumerate(row):
                    if v == NEG_INF:
                        break  # ranks are sorted: the rest are -inf too
                    pool.append((fs + v, d + 1, r, f))
            if len(pool) == start:
                break
            best = sorted(range(start, len(pool)), key=lambda i: -pool[i][0])[: self.beam_width]
            frontier = [(pool[i][0], i) for i in best]
        order = sorted(range(len(pool)), key=lambda i: (-pool[i][0], pool[i][1], i))[: n - 1]
        node_of = {i: j + 1 for j, i in enumerate(order)}
        tokens, parents, depths, scores = [root], [-1], [0], [0.0]
        for i in order:
            s, d, r, f = pool[i]
            tokens.append(cand.tokens[d - 1][r])
            parents.append(0 if f < 0 else node_of[f])
            depths.append(d)
            scores.append(s)
        return make_tree(tokens, parents, depths, scores, marginals.log_probs.device)

    def __repr__(self) -> str:
        return f"BeamBuilder(top_k={self.top_k}, beam_width={self.beam_width}, max_depth={self.max_depth})"
