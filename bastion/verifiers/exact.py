"""The exact verifier: greedy matching at temperature 0, sample-and-match at temperature > 0.

Acceptance rule
---------------
Let ``y_i`` be the target's own choice at node ``i``: the argmax of its logits when greedy, otherwise one
draw from the target's processed distribution (temperature, top-k, top-p) at that node. Every node gets
exactly one independent draw. Starting at the root, move to the child whose token equals ``y_current``
(siblings hold distinct tokens, so there is at most one); stop when no child matches. The nodes visited
form the accepted path and ``y_last`` is the bonus token.

Why it is lossless: every emitted token is ``y`` of the node it follows, and the target computed that
node's logits with exactly the committed prefix in view (ancestor-only mask). So each emitted token is
the target's greedy choice / a fresh sample from the target's distribution given everything before it,
whatever the tree looked like; the tree only decides how many such tokens one forward pass yields.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import Verifier, check_batch_logits, check_node_logits, single_is_nearer
from bastion.contract.sampling import sample_rows, sample_tokens
from bastion.utils.sync import to_host
from bastion.contract.tree import Tree
from bastion.contract.types import SamplingConfig, Verdict

__all__ = ["ExactVerifier", "walk_tree"]


def walk_tree(tokens: list[int], parents: list[int], choices: list[int]) -> list[int]:
    """Accepted path (node indices, root first) when node ``i``'s target choice is ``choices[i]``.

    Pure host-side walk over one pass of the node list: since parents precede children, a node is on
    the path iff its parent is the current path end and its token equals that parent's choice.
    """
    path = [0]
    for i in range(1, len(tokens)):
        if parents[i] == path[-1] and tokens[i] == choices[path[-1]]:
            path.append(i)
    return path


class ExactVerifier(Verifier):
    """Lossless tree verification: greedy (T = 0) or sample-and-match (T > 0)."""

    supports_sampling = True

    def verify(
        self,
        tree: Tree,
        logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> Verdict:
        check_node_logits(tree, logits)
        choices = sample_tokens(logits, sampling, generator)  # [n], one target choice per node
        # one device -> host transfer per step: the walk itself is a handful of integer compares
        return _verdict(tree, to_host(choices, "verify"))  # the step's one read of the target's choices

    def verify_batch(
        self,
        trees: Sequence[Tree],
        logits: torch.Tensor,
        sampling: Sequence[SamplingConfig],
        generators: Sequence[torch.Generator | None],
    ) -> list[Verdict]:
        """Greedy batches take one argmax over ``logits`` [B, W, V] and one host transfer for all rows;
        sampled rows draw row by row from their own streams (and so does every row of a subclass that
        overrides only :meth:`verify`)."""
        if not all(s.greedy for s in sampling) or single_is_nearer(self, "verify", "verify_batch"):
            return super().verify_batch(trees, logits, sampling, generators)  # row by row through verify
        check_batch_logits(trees, logits)
        choices = to_host(logits.argmax(dim=-1), "verify")  # [B][W], the one host transfer of the step
        return [_verdict(tree, row) for tree, row in zip(trees, choices)]


    def next_tokens(
        self,
        roots: Sequence[int],
        logits: torch.Tensor,
        sampling: Sequence[SamplingConfig],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """A plain step (batched, or one sequence): each row's own choice from ``logits`` [B, V] (one
        argmax when greedy, else each row's draw from its stream) and one host transfer; no trees, no
        verdicts."""
        if logits.dim() != 2 or logits.shape[0] != len(roots):
            raise InvalidInputError(f"logits must be [B, V] with B = {len(roots)} rows, got {tuple(logits.shape)}")
        return to_host(sample_rows(logits, sampling, generators), "verify")  # [B]


def _verdict(tree: Tree, choices: list[int]) -> Verdict:
    """The accepted path and bonus token when node ``i``'s target choice is ``choices[i]`` (the tree's
    host copy gives tokens and parents: no device read)."""
    host = tree.on_host()
    tokens = list(host.tokens)
    path = walk_tree(tokens, list(host.parents), choices)
    return Verdict(
        accepted_nodes=torch.tensor(path, dtype=torch.long),
        accepted_tokens=tuple(tokens[i] for i in path[1:]),
        bonus_token=choices[path[-1]],
    )
