"""Tree selection over a drafter's :class:`~bastion.core.CandidateTree` (autoregressive drafters).

Each candidate's path score is log rho = the sum of its path's conditional log q. Since q <= 1, rho never
grows from a parent to its child, so ordering candidates by non-increasing rho (ties: shallower first,
then candidate order) lists every parent before its children. The first n of that order is therefore a
prefix-closed subtree, and it has the largest A_hat = sum of rho among all prefix-closed subtrees of the
candidates with n nodes: any such subtree holds n candidates, and no n candidates sum to more rho.
"""

from __future__ import annotations

from bastion.contract.candidates import CandidateTree
from bastion.contract.errors import InvalidInputError
from bastion.contract.tree import Tree
from bastion.trees.common import NEG_INF, check_max_nodes, make_tree

__all__ = ["check_candidate_args", "select_best_first", "select_chain"]


def check_candidate_args(cand: CandidateTree, root_token: object, max_nodes: object) -> int:
    """Validate ``build`` arguments for a candidate tree (it must hang below ``root_token``); return
    ``max_nodes`` as an int."""
    n = check_max_nodes(max_nodes)
    if cand.root_token != root_token:
        raise InvalidInputError(f"the candidate tree's root holds token {cand.root_token}, expected the root {root_token!r}")
    return n


def _scores_and_depths(cand: CandidateTree) -> tuple[list[int], list[int], list[float], list[int]]:
    tokens, parents, log_q = cand.host_lists()
    scores, depths = [0.0] * len(tokens), [0] * len(tokens)
    for i in range(1, len(tokens)):
        p = parents[i]
        # clamp a rounding hair above 0 so a child never outscores its parent
        scores[i] = scores[p] + min(log_q[i], 0.0)
        depths[i] = depths[p] + 1
    return tokens, parents, scores, depths


def _pack(order: list[int], tokens: list[int], parents: list[int], scores: list[float], depths: list[int], device) -> Tree:
    """Candidates ``order`` (root first, parents before children) -> a :class:`Tree`, renumbered."""
    index = {old: new for new, old in enumerate(order)}
    return make_tree(
        [tokens[i] for i in order],
        [-1 if i == 0 else index[parents[i]] for i in order],
        [depths[i] for i in order],
        [scores[i] for i in order],
        device,
    )


def select_best_first(cand: CandidateTree, max_nodes: int, max_depth: int | None = None) -> Tree:
    """The ``max_nodes`` candidates of highest rho (root included), in non-increasing rho order."""
    tokens, parents, scores, depths = _scores_and_depths(cand)
    limit = max_depth if max_depth is not None else max(depths)
    pool = [i for i in range(1, len(tokens)) if scores[i] != NEG_INF and depths[i] <= limit]
    pool.sort(key=lambda i: (-scores[i], depths[i], i))
    return _pack([0, *pool[: max_nodes - 1]], tokens, parents, scores, depths, cand.device)


def select_chain(cand: CandidateTree, max_nodes: int, max_depth: int | None = None) -> Tree:
    """The drafter's greedy path: from the root, the child of highest q at every depth."""
    tokens, parents, scores, depths = _scores_and_depths(cand)
    best_child: dict[int, int] = {}
    for i in range(1, len(tokens)):
        p = parents[i]
        if scores[i] != NEG_INF and (p not in best_child or scores[i] > scores[best_child[p]]):
            best_child[p] = i
    limit = max_nodes - 1 if max_depth is None else min(max_nodes - 1, max_depth)
    order = [0]
    while len(order) - 1 < limit and order[-1] in best_child:
        order.append(best_child[order[-1]])
    return _pack(order, tokens, parents, scores, depths, cand.device)
