"""The verification tree: a prefix tree of draft tokens below the last committed token.

Node 0 is the root (the last committed token, whose slot produces the bonus token). Every node's
parent precedes it, so every prefix of the node order is itself a prefix-closed tree: truncating to
the first ``n`` nodes is always valid, and best-first builders make it the optimal tree of size ``n``.
"""

from __future__ import annotations

import math

import torch
from attrs import field, frozen

from bastion.contract.errors import InvalidInputError, TreeValidationError

__all__ = ["Tree", "HostTree"]


@frozen
class HostTree:
    """The same tree as host tuples. Builders that decide the tree shape on the host attach it, so the
    decode step never reads the tree back from the device (controllers, verifiers, checks use it)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    log_scores: tuple[float, ...]

    def truncate(self, n: int) -> "HostTree":
        return HostTree(self.tokens[:n], self.parents[:n], self.depths[:n], self.log_scores[:n])


@frozen
class Tree:
    tokens: torch.Tensor = field(eq=False)  # [n] long, node tokens; tokens[0] is the root token
    parents: torch.Tensor = field(eq=False)  # [n] long, parent index; parents[0] == -1
    depths: torch.Tensor = field(eq=False)  # [n] long, depth below the root; depths[0] == 0
    log_scores: torch.Tensor = field(eq=False)  # [n] float, log rho = sum of log q_k on the path; root 0.0
    #: optional host copy of the four fields (see :meth:`on_host`); never compared
    host: HostTree | None = field(default=None, eq=False, repr=False, kw_only=True)

    def on_host(self) -> HostTree:
        """The tree as host tuples: the attached copy, or one counted host read of the device tensors."""
        if self.host is not None:
            return self.host
        from bastion.utils.sync import to_host

        tok, par, dep, sco = to_host(
            torch.stack((self.tokens, self.parents, self.depths, self.log_scores.double())).double(), "tree"
        )
        return HostTree(
            tuple(int(t) for t in tok), tuple(int(p) for p in par), tuple(int(d) for d in dep), tuple(sco)
        )

    def log_scores_cpu(self) -> torch.Tensor:
        """``log_scores`` as a CPU FloatTensor [n] (from the host copy when there is one)."""
        if self.host is not None:
            return torch.tensor(self.host.log_scores, dtype=torch.float32)
        return torch.tensor(self.on_host().log_scores, dtype=torch.float32)

    @classmethod
    def root_only(cls, token: int, device: torch.device | str = "cpu") -> "Tree":
        """The one-node tree of a plain step: ``token`` alone, its host copy attached (no device read;
        the token written by a fill, no host-to-device copy)."""
        tokens = torch.full((1,), int(token), dtype=torch.long, device=device)  # [1]
        parents = torch.full((1,), -1, dtype=torch.long, device=device)  # [1]
        depths = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        scores = torch.zeros(1, dtype=torch.float32, device=device)  # [1]
        return cls(tokens, parents, depths, scores, host=HostTree((int(token),), (-1,), (0,), (0.0,)))

    @classmethod
    def from_parents(
        cls, tokens: torch.Tensor | list[int], parents: torch.Tensor | list[int], log_scores: torch.Tensor | None = None
    ) -> "Tree":
        """Build a tree from tokens and parent indices, deriving depths (log scores default to 0)."""
        tok = torch.as_tensor(tokens, dtype=torch.long)
        par = torch.as_tensor(parents, dtype=torch.long, device=tok.device)
        if tok.dim() != 1 or par.shape != tok.shape or tok.numel() < 1:
            raise InvalidInputError("tokens and parents must be non-empty 1-D sequences of equal length")
        par_list = par.tolist()
        depth = [0] * len(par_list)
        for i, p in enumerate(par_list):
            if i == 0:
                continue
            if not 0 <= p < i:
                raise TreeValidationError(f"node {i}: parent {p} does not precede it (parents must precede children)")
            depth[i] = depth[p] + 1
        scores = (
            torch.zeros(tok.shape, dtype=torch.float32, device=tok.device)
            if log_scores is None
            else torch.as_tensor(log_scores, dtype=torch.float32, device=tok.device)
        )
        return cls(tok, par, torch.tensor(depth, dtype=torch.long, device=tok.device), scores)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def max_depth(self) -> int:
        if self.host is not None:
            return max(self.host.depths)
        return int(self.depths.max().item())

    def truncate(self, n: int) -> "Tree":
        """The first ``n`` nodes (1 <= n <= len(self)); prefix-closed by construction."""
        if not isinstance(n, int) or isinstance(n, bool):
            raise InvalidInputError(f"truncate() takes an int, got {type(n).__name__}")
        if not 1 <= n <= len(self):
            raise InvalidInputError(f"cannot truncate a tree of {len(self)} nodes to {n} (need 1 <= n <= {len(self)})")
        if n == len(self):
            return self
        host = None if self.host is None else self.host.truncate(n)
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], self.log_scores[:n], host=host)

    def ancestor_mask(self) -> torch.Tensor:
        """BoolTensor[n, n]: ``mask[i, j]`` is True iff node j is node i or one of its ancestors."""
        n = len(self)
        # device ops only (no host scalar written by indexing: each such write is a blocking copy)
        cur = torch.arange(n, device=self.device)  # [n]
        mask = torch.eye(n, dtype=torch.bool, device=self.device)
        parents = self.parents.clamp(min=0)  # root points to itself; harmless since mask[i, 0] is True anyway
        for _ in range(self.max_depth):
            cur = parents[cur]  # [n], ancestor one level up (saturates at the root)
            mask.scatter_(1, cur[:, None], True)
        return mask

    def position_ids(self, context_len: int) -> torch.Tensor:
        """LongTensor[n]: absolute positions ``context_len + depth`` of the nodes."""
        return self.depths + int(context_len)

    def path(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` (both included)."""
        if not 0 <= node < len(self):
            raise InvalidInputError(f"node {node} out of range for a tree of {len(self)} nodes")
        parents = self.parents.tolist()
        out = [node]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out[::-1]

    def children(self, node: int) -> list[int]:
        """Indices of the direct children of ``node``, in node order."""
        return (self.parents == node).nonzero().flatten().tolist()

    def children_lists(self) -> list[list[int]]:
        """Children of every node, computed in one pass (host lists)."""
        out: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                out[p].append(i)
        return out

    def accept_curve(self) -> torch.Tensor:
        """DoubleTensor[n]: ``curve[m - 1]`` = A_hat of the first ``m`` nodes (cumulative sum of rho)."""
        return self.log_scores.double().exp().cumsum(0)  # [n]

    def accept_score(self) -> float:
        """A_hat(T) = sum of rho over the nodes (root included, so >= 1)."""
        if self.host is not None:  # no device read
            return math.fsum(math.exp(s) for s in self.host.log_scores)
        return float(self.log_scores.double().exp().sum().item())

    def validate(self, vocab_size: int | None = None) -> "Tree":
        """Check every structural invariant; raise :class:`TreeValidationError` naming the broken one.

        Invariants: 1-D tensors of equal length; at least one node; root first (parent -1, depth 0);
        parents precede children (so every prefix is prefix-closed); depth = parent depth + 1; sibling
        tokens distinct; log scores finite; tokens inside the vocabulary when ``vocab_size`` is given.
        Returns ``self`` so calls can be chained.
        """
        fields = {"tokens": self.tokens, "parents": self.parents, "depths": self.depths, "log_scores": self.log_scores}
        for name, t in fields.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise TreeValidationError(f"tree.{name} must be a 1-D tensor")
        n = len(self)
        if n < 1:
            raise TreeValidationError("tree is empty: it needs at least the root node")
        for name, t in fields.items():
            if t.shape[0] != n:
                raise TreeValidationError(f"tree.{name} has {t.shape[0]} entries, tree.tokens has {n}")
        if self.tokens.dtype != torch.long or self.parents.dtype != torch.long or self.depths.dtype != torch.long:
            raise TreeValidationError("tree.tokens, tree.parents and tree.depths must be int64 (long) tensors")
        par = self.parents.tolist()
        dep = self.depths.tolist()
        tok = self.tokens.tolist()
        if par[0] != -1 or dep[0] != 0:
            raise TreeValidationError("root first: node 0 must have parent -1 and depth 0")
        seen: set[tuple[int, int]] = set()
        for i in range(1, n):
            p = par[i]
            if not 0 <= p < i:
                raise TreeValidationError(
                    f"parents precede children: node {i} has parent {p} (every prefix must be prefix-closed)"
                )
            if dep[i] != dep[p] + 1:
                raise TreeValidationError(f"depth: node {i} has depth {dep[i]} but its parent {p} has depth {dep[p]}")
            if (p, tok[i]) in seen:
                raise TreeValidationError(f"distinct siblings: node {i} repeats token {tok[i]} under parent {p}")
            seen.add((p, tok[i]))
        if not bool(torch.isfinite(self.log_scores).all()):
            raise TreeValidationError("tree.log_scores must be finite")
        if vocab_size is not None:
            lo, hi = int(self.tokens.min()), int(self.tokens.max())
            if lo < 0 or hi >= vocab_size:
                raise TreeValidationError(f"tokens must lie in [0, {vocab_size}), found range [{lo}, {hi}]")
        return self
