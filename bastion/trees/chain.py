"""The chain baseline: the drafter's top-1 token at every depth (plain DFlash drafting)."""

from __future__ import annotations

from bastion.contract.candidates import CandidateTree
from bastion.contract.interfaces import TreeBuilder
from bastion.contract.tree import Tree
from bastion.contract.types import Marginals
from bastion.trees.candidates import check_candidate_args, select_chain
from bastion.trees.common import NEG_INF, check_build_args, check_optional_positive, make_tree, top_candidates

__all__ = ["ChainBuilder"]


class ChainBuilder(TreeBuilder):
    """A single path: root, then the most likely token at depths 1..D, D = min(K, ``max_depth``),
    cut to ``max_nodes`` nodes (root included) and before any zero-probability token.

    With a block size B drafter (K = B - 1) and a large enough budget, the chain has B nodes. From a
    :class:`~bastion.core.CandidateTree` it follows the most likely child at every depth (the drafter's
    greedy path).
    """

    builds_valid_trees = True  # checked by check_tree_builder in the test suite
    accepts = frozenset({"marginals", "candidate_tree"})

    def __init__(self, max_depth: int | None = None) -> None:
        self.max_depth = check_optional_positive("max_depth", max_depth)

    def build(self, marginals: Marginals | CandidateTree, root_token: int, max_nodes: int) -> Tree:
        if isinstance(marginals, CandidateTree):
            return select_chain(marginals, check_candidate_args(marginals, root_token, max_nodes), self.max_depth)
        root, n = check_build_args(marginals, root_token, max_nodes)
        depth = marginals.depth if self.max_depth is None else min(marginals.depth, self.max_depth)
        cand = top_candidates(marginals.log_probs, min(depth, n - 1), 1)
        tokens, parents, depths, scores = [root], [-1], [0], [0.0]
        for d in range(cand.depth):
            v = cand.values[d][0]
            if v == NEG_INF:
                break
            tokens.append(cand.tokens[d][0])
            parents.append(d)
            depths.append(d + 1)
            scores.append(scores[-1] + v)
        return make_tree(tokens, parents, depths, scores, marginals.log_probs.device)

    def __repr__(self) -> str:
        return f"ChainBuilder(max_depth={self.max_depth})"
