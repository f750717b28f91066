"""Candidate trees: the proposal kind of autoregressive drafters.

A block drafter (DFlash, Medusa-style heads, n-gram lookup) proposes :class:`~bastion.core.Marginals`:
independent per-depth distributions, from which a tree builder may combine any tokens. An autoregressive
drafter (a small LM, an EAGLE-style head) knows more: each child's probability *given its own path*. It
proposes a :class:`CandidateTree`, the nodes it expanded with their conditional log-probabilities

    log_q[i] = log q(tokens[i] | tokens on the path root -> parent(i))

so a node's path score is still rho(i) = prod of q along its path (``log_scores()``), and a tree builder
selects a prefix-closed subtree of the candidates. Because q <= 1, rho never grows along a path: taking
candidates in non-increasing rho (parents first among ties) is optimal under A_hat for every size and
every prefix of that order is prefix-closed (see :mod:`bastion.trees.best_first`).

Layout: node 0 is the root (the step's root token, log q 0, parent -1); every parent precedes its
children. ``log_q`` may hold ``-inf`` for a candidate the drafter gives no probability (builders never
select it).
"""

from __future__ import annotations

import math
from typing import Final, Literal

import torch
from attrs import field, frozen

from bastion.contract.errors import InvalidInputError, TreeValidationError

__all__ = ["CandidateTree", "ProposalKind", "PROPOSAL_KINDS", "check_pairing", "proposal_kind"]

ProposalKind = Literal["marginals", "candidate_tree"]

#: every proposal kind a drafter may return, in the order the docs list them
PROPOSAL_KINDS: Final[tuple[str, ...]] = ("marginals", "candidate_tree")

#: log q above this is rejected as "not a log-probability" (rounding may leave a hair above 0)
_POSITIVE_TOLERANCE = 1e-4


@frozen
class CandidateTree:
    """Candidate nodes below the root with per-node conditional log-probabilities (root first, parents
    before children)."""

    tokens: torch.Tensor = field(eq=False)  # [n] long; tokens[0] is the root token
    parents: torch.Tensor = field(eq=False)  # [n] long; parents[0] == -1, 0 <= parents[i] < i
    log_q: torch.Tensor = field(eq=False)  # [n] float; log q of the node given its path; log_q[0] == 0

    def __attrs_post_init__(self) -> None:
        for name in ("tokens", "parents", "log_q"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise InvalidInputError(
                    f"CandidateTree.{name} must be a 1-D tensor, got {getattr(t, 'shape', type(t).__name__)}"
                )
        n = int(self.tokens.shape[0])
        if n < 1:
            raise InvalidInputError("a CandidateTree needs at least its root node")
        if self.parents.shape[0] != n or self.log_q.shape[0] != n:
            raise InvalidInputError(
                f"CandidateTree fields differ in length: tokens {n}, parents {self.parents.shape[0]}, "
                f"log_q {self.log_q.shape[0]}"
            )
        if self.tokens.dtype != torch.long or self.parents.dtype != torch.long:
            raise InvalidInputError("CandidateTree.tokens and .parents must be int64 (long) tensors")
        if not self.log_q.is_floating_point():
            raise InvalidInputError(f"CandidateTree.log_q must be floating point, got {self.log_q.dtype}")

    @classmethod
    def from_lists(
        cls,
        tokens: list[int],
        parents: list[int],
        log_q: list[float],
        device: torch.device | str = "cpu",
    ) -> "CandidateTree":
        """Pack host lists into a candidate tree on ``device``."""
        return cls(
            torch.tensor(tokens, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
            torch.tensor(log_q, dtype=torch.float32, device=device),
        )

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def root_token(self) -> int:
        return int(self.tokens[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def host_lists(self) -> tuple[list[int], list[int], list[float]]:
        """``(tokens, parents, log_q)`` as host lists (one transfer each)."""
        return self.tokens.tolist(), self.parents.tolist(), self.log_q.double().tolist()

    def depths(self) -> list[int]:
        """Depth of every node below the root (host list; the root is 0)."""
        out = [0] * len(self)
        for i, p in enumerate(self.parents.tolist()):
            if i:
                out[i] = out[p] + 1
        return out

    def log_scores(self) -> list[float]:
        """log rho of every node: the sum of ``log_q`` along its path (host list; the root is 0.0)."""
        parents, log_q = self.parents.tolist(), self.log_q.double().tolist()
        out = [0.0] * len(self)
        for i in range(1, len(out)):
            out[i] = out[parents[i]] + log_q[i]
        return out

    @property
    def max_depth(self) -> int:
        return max(self.depths())

    def prune_depth(self, max_depth: int) -> "CandidateTree":
        """The candidates at depth <= ``max_depth`` (parents stay before children; indices renumbered)."""
        depths = self.depths()
        if max(depths) <= max_depth:
            return self
        keep = [i for i, d in enumerate(depths) if d <= max_depth]
        new_index = {old: new for new, old in enumerate(keep)}
        parents = self.parents.tolist()
        new_parents = [-1 if i == 0 else new_index[parents[i]] for i in keep]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        return CandidateTree(
            self.tokens.index_select(0, idx),
            torch.tensor(new_parents, dtype=torch.long, device=self.device),
            self.log_q.index_select(0, idx),
        )

    def validate(self, vocab_size: int | None = None, root_token: int | None = None) -> "CandidateTree":
        """Check every invariant; raise :class:`TreeValidationError` naming the broken one.

        Invariants: root first (parent -1, log q 0, the expected ``root_token`` when given); parents
        precede children; distinct sibling tokens; log q a log-probability (no NaN, <= 0); the
        probabilities of one node's children sum to at most 1 (they are distinct outcomes of the same
        conditional distribution); tokens inside the vocabulary when ``vocab_size`` is given.
        Returns ``self`` so calls can be chained.
        """
        tokens, parents, log_q = self.host_lists()
        n = len(tokens)
        if parents[0] != -1:
            raise TreeValidationError(f"root first: node 0 must have parent -1, got {parents[0]}")
        if log_q[0] != 0.0:
            raise TreeValidationError(f"root first: node 0 must have log q 0.0, got {log_q[0]!r}")
        if root_token is not None and tokens[0] != root_token:
            raise TreeValidationError(f"root first: node 0 holds token {tokens[0]}, expected the root {root_token}")
        seen: set[tuple[int, int]] = set()
        mass = [0.0] * n
        for i in range(1, n):
            p, lq = parents[i], log_q[i]
            if not 0 <= p < i:
                raise TreeValidationError(f"parents precede children: node {i} has parent {p}")
            if (p, tokens[i]) in seen:
                raise TreeValidationError(f"distinct siblings: node {i} repeats token {tokens[i]} under parent {p}")
            seen.add((p, tokens[i]))
            if lq != lq or lq > _POSITIVE_TOLERANCE:
                raise TreeValidationError(
                    f"log q must be a log-probability (<= 0, not NaN): node {i} has log q {lq!r}"
                )
            mass[p] += math.exp(lq)
        for p, total in enumerate(mass):
            if total > 1.0 + 1e-3:
                raise TreeValidationError(
                    f"the children of node {p} carry probability {total:.4f} > 1: log q must be each child's "
                    "probability given its path (one conditional distribution per parent)"
                )
        if vocab_size is not None:
            lo, hi = min(tokens), max(tokens)
            if lo < 0 or hi >= vocab_size:
                raise TreeValidationError(f"tokens must lie in [0, {vocab_size}), found range [{lo}, {hi}]")
        return self


def proposal_kind(proposal: object) -> str:
    """``"marginals"`` or ``"candidate_tree"`` for a drafter's proposal; :class:`InvalidInputError`
    for anything else."""
    from bastion.contract.types import Marginals

    if isinstance(proposal, Marginals):
        return "marginals"
    if isinstance(proposal, CandidateTree):
        return "candidate_tree"
    raise InvalidInputError(
        f"a drafter must propose bastion.core.Marginals or bastion.core.CandidateTree, got {type(proposal).__name__}"
    )


def check_pairing(builder: object, kind: str, drafter: object | None = None) -> None:
    """Raise :class:`IncompatibleComponentsError` when ``builder`` does not take proposals of ``kind``;
    the message names the builder, the drafter and the builders' alternatives."""
    from bastion.contract.errors import IncompatibleComponentsError

    accepts = getattr(builder, "accepts", frozenset({"marginals"}))
    if kind in accepts:
        return
    who = "the drafter" if drafter is None else f"drafter {type(drafter).__name__}"
    raise IncompatibleComponentsError(
        f"tree builder {type(builder).__name__} takes {' and '.join(sorted(accepts)) or 'no proposals'}, but "
        f"{who} proposes {kind.replace('_', ' ')}s; pair it with a builder that takes them "
        "(best-first and chain take both kinds)"
    )
