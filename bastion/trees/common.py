"""Shared pieces of the built-in tree builders: argument checks, per-depth top-k candidates, assembly.

Every built-in builder works in two phases:

1. **Candidates (device).** One ``torch.topk`` over the first ``D`` rows of the marginals gives, per
   depth, the ``k`` most likely tokens and their log-probabilities, sorted. Because draft positions are
   independent given the context, these are the only tokens any optimal tree can use at that depth.
   The two ``[D, k]`` results travel to the host in ONE transfer.
2. **Selection (host).** Plain Python floats and ints decide the tree shape (a heap for best-first, a
   sort for static and beam trees); the result is packed into a :class:`~bastion.contract.tree.Tree` on the
   marginals' device.

Zero-probability candidates (log-probability ``-inf``, e.g. banned tokens) never become nodes.
"""

from __future__ import annotations

import math
from array import array
from typing import Sequence

import torch

from bastion.contract.candidates import CandidateTree
from bastion.utils.checks import check_int
from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.utils.sync import to_device, to_host
from bastion.contract.tree import HostTree, Tree
from bastion.contract.types import Marginals

__all__ = ["Candidates", "check_build_args", "check_max_nodes", "check_optional_positive", "top_candidates", "make_tree"]

#: log-probabilities above this are rejected as "not normalized" (rounding may leave a hair above 0)
_POSITIVE_TOLERANCE = 1e-3

NEG_INF = -math.inf


class Candidates:
    """Per-depth top-k candidates on the host: ``values[d][r]`` is the log-probability of the rank-``r``
    token ``tokens[d][r]`` at depth ``d + 1`` (ranks sorted by decreasing probability)."""

    __slots__ = ("values", "tokens")

    def __init__(self, values: list[list[float]], tokens: list[list[int]]) -> None:
        self.values = values
        self.tokens = tokens

    @property
    def depth(self) -> int:
        return len(self.values)

    @property
    def width(self) -> int:
        return len(self.values[0]) if self.values else 0


def check_optional_positive(name: str, value: object) -> int | None:
    """Validate a builder option that is either ``None`` (no limit) or an int >= 1."""
    return check_int(name, value, optional=True)


def check_build_args(marginals: object, root_token: object, max_nodes: object) -> tuple[int, int]:
    """Validate the arguments of ``TreeBuilder.build``; return ``(root_token, max_nodes)`` as ints."""
    if isinstance(marginals, CandidateTree):
        raise IncompatibleComponentsError(
            "this tree builder takes marginals only, not a candidate tree (an autoregressive drafter's "
            "proposal); use best-first or chain"
        )
    if not isinstance(marginals, Marginals):
        raise InvalidInputError(f"marginals must be a bastion.core.Marginals, got {type(marginals).__name__}")
    n = check_max_nodes(max_nodes)
    root = check_int("root_token", root_token, low=None)
    if not 0 <= root < marginals.vocab_size:
        raise InvalidInputError(f"root_token {root} is outside the vocabulary [0, {marginals.vocab_size})")
    return root, n


def check_max_nodes(max_nodes: object) -> int:
    """``max_nodes`` as an int >= 1 (the root counts as one node)."""
    return check_int("max_nodes (the root counts as one node)", max_nodes)


def top_candidates(log_probs: torch.Tensor, depth: int, k: int) -> Candidates:
    """Top-``k`` tokens of each of the first ``depth`` rows of ``log_probs`` [K, V], moved to the host in
    one transfer. ``k`` is clamped to ``V``. Raises :class:`InvalidInputError` on NaN or positive
    log-probabilities (the marginals were not normalized)."""
    if depth < 1 or k < 1:
        return Candidates([], [])
    k = min(k, int(log_probs.shape[1]))
    if k == 1:  # a max pass is several times cheaper than topk(k=1) on CPU
        vals, idx = log_probs[:depth].max(dim=-1, keepdim=True)  # [D, 1], [D, 1]
    else:
        vals, idx = torch.topk(log_probs[:depth], k, dim=-1, sorted=True)  # [D, k], [D, k]
    # one device -> host copy; token ids < 2**53 are exact in float64
    packed = to_host(torch.stack((vals.to(torch.float64), idx.to(torch.float64))), "tree candidates")  # [2][D][k]
    values: list[list[float]] = packed[0]
    tokens = [list(map(int, row)) for row in packed[1]]
    for d, row in enumerate(values):
        top = row[0]  # topk sorts NaN first and max propagates it: row[0] reveals NaN and +inf anywhere
        if top != top:
            raise InvalidInputError(f"marginals contain NaN at depth {d + 1}")
        if top > _POSITIVE_TOLERANCE:
            raise InvalidInputError(
                f"marginals are not log-probabilities: depth {d + 1} has a value {top!r} > 0 "
                "(build them with Marginals.from_logits)"
            )
        if top > 0.0:
            row[0] = 0.0  # rounding hair above zero: keeps child scores <= parent scores
    return Candidates(values, tokens)


def make_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    depths: Sequence[int],
    scores: Sequence[float],
    device: torch.device,
) -> Tree:
    """Pack host lists into a :class:`Tree` on ``device`` (tokens/parents/depths long, scores float32)."""
    # C arrays: the float32 rounding and the packing run in C, and the CPU tensors share their memory
    scores32 = array("f", scores)  # [n] rounded once: host and device agree
    packed = array("q", tokens)
    packed.extend(parents)
    packed.extend(depths)
    host = HostTree(tuple(tokens), tuple(parents), tuple(depths), tuple(scores32))
    fields = to_device(torch.frombuffer(packed, dtype=torch.int64).view(3, -1), torch.long, device)  # [3, n], one copy
    return Tree(
        tokens=fields[0],
        parents=fields[1],
        depths=fields[2],
        log_scores=to_device(torch.frombuffer(scores32, dtype=torch.float32), torch.float32, device),
        host=host,  # the step reads the shape from here, never back from the device
    )
