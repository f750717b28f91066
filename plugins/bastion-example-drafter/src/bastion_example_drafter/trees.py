"""Example tree builder: a fan of the ``width`` most likely first tokens, each followed by its greedy chain."""

from __future__ import annotations

import math

import torch

from bastion.core import InvalidInputError, Marginals, Tree, TreeBuilder


class FanBuilder(TreeBuilder):
    """Node 0 is the root; then the ``width`` most likely depth-1 tokens; then, depth by depth, the most
    likely next token below each branch (the drafter's marginal at that depth, the same for every branch).

    Nodes are listed depth by depth, so parents come before children and every prefix is itself a tree.
    ``log_scores`` is log rho, the sum of ``log q_d`` along each node's path; a token whose log q is
    ``-inf`` (the drafter rules it out; the contract kit sends such marginals) is never added, so every
    score stays finite."""

    accepts = frozenset({"marginals"})

    def __init__(self, width: int = 3) -> None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise InvalidInputError(f"width must be an int >= 1, got {width!r}")
        self.width = width

    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        if not isinstance(marginals, Marginals):
            raise InvalidInputError(f"FanBuilder takes Marginals, got {type(marginals).__name__}")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise InvalidInputError(f"max_nodes must be an int >= 1 (the root), got {max_nodes!r}")
        lp = marginals.log_probs.detach().float().cpu()  # [K, V]
        if not 0 <= int(root_token) < lp.shape[1]:
            raise InvalidInputError(f"root token {root_token} is outside the vocabulary [0, {lp.shape[1]})")
        tokens, parents, scores = [int(root_token)], [-1], [0.0]
        if lp.shape[0] >= 1 and max_nodes > 1:
            vals, idx = lp[0].topk(min(self.width, lp.shape[1], max_nodes - 1))
            frontier = []
            for v, t in zip(vals.tolist(), idx.tolist()):
                if math.isfinite(v):
                    tokens.append(t), parents.append(0), scores.append(v)
                    frontier.append(len(tokens) - 1)
            best_v, best_t = lp.max(dim=-1)  # [K]: the greedy token of every depth
            for d in range(1, lp.shape[0]):
                if not math.isfinite(float(best_v[d])):
                    break
                nxt = []
                for node in frontier:
                    if len(tokens) >= max_nodes:
                        break
                    tokens.append(int(best_t[d])), parents.append(node), scores.append(scores[node] + float(best_v[d]))
                    nxt.append(len(tokens) - 1)
                frontier = nxt
        tokens, parents, scores = tokens[:max_nodes], parents[:max_nodes], scores[:max_nodes]
        device = marginals.log_probs.device
        return Tree.from_parents(torch.tensor(tokens, device=device), torch.tensor(parents, device=device),
                                 torch.tensor(scores, device=device))

    def __repr__(self) -> str:
        return f"FanBuilder(width={self.width})"
