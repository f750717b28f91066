"""An n-gram (prompt-lookup) drafter that emits position-wise marginals.

Each step it takes the newest tokens of the sequence (committed context plus the root) as an n-gram
query, finds every earlier occurrence of that n-gram in the sequence, and counts which token followed
each occurrence 1, 2, ..., K positions later. Depth k's marginal q_k is those counts (longer n-grams
weigh more) mixed with a small uniform pseudo-count, so every log-probability is finite. Drafting needs
no target features and no weights; the cost is a few vectorized comparisons over the context.

It is written against bastion's batch-first drafter interface: :meth:`NGramDrafter.open_batch` starts
an :class:`NGramBatch` holding one history per row (rows join with ``extend`` and leave with ``keep``
between steps). The single-sequence calls (``begin``, ``propose``, ``commit``) come from bastion's
adapters, a batch of one.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from bastion.core import DraftBatch, DraftContext, DraftStep, Drafter, InvalidInputError, Marginals
from bastion.contract.target import Target

__all__ = ["NGramBatch", "NGramDrafter"]


class NGramDrafter(Drafter):
    """Prompt-lookup drafter.

    Args:
        vocab_size: V; ``None`` takes the target's vocabulary size when the pipeline binds the drafter.
        depth: K, the number of drafted positions below the root.
        max_ngram: longest query n-gram (the root plus up to ``max_ngram - 1`` committed tokens).
        min_ngram: shortest query n-gram.
        smoothing: uniform pseudo-count mass added at every depth (> 0 keeps log-probs finite).
        ngram_weight: a match of an n-gram one token longer counts this many times more (>= 1).
    """

    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        vocab_size: int | None = None,
        depth: int = 8,
        max_ngram: int = 3,
        min_ngram: int = 1,
        smoothing: float = 0.05,
        ngram_weight: float = 4.0,
    ) -> None:
        if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < 1):
            raise InvalidInputError(f"vocab_size must be a positive int or None, got {vocab_size!r}")
        if not _is_int(depth) or depth < 1:
            raise InvalidInputError(f"depth must be an int >= 1, got {depth!r}")
        if not (_is_int(min_ngram) and _is_int(max_ngram) and 1 <= min_ngram <= max_ngram):
            raise InvalidInputError(f"need ints 1 <= min_ngram <= max_ngram, got {min_ngram!r}, {max_ngram!r}")
        if not (isinstance(smoothing, (int, float)) and math.isfinite(smoothing) and smoothing > 0):
            raise InvalidInputError(f"smoothing must be a finite number > 0, got {smoothing!r}")
        if not (isinstance(ngram_weight, (int, float)) and math.isfinite(ngram_weight) and ngram_weight >= 1):
            raise InvalidInputError(f"ngram_weight must be a finite number >= 1, got {ngram_weight!r}")
        self._vocab_size = vocab_size
        self.depth = int(depth)
        self.max_ngram = int(max_ngram)
        self.min_ngram = int(min_ngram)
        self.smoothing = float(smoothing)
        self.ngram_weight = float(ngram_weight)

    # ------------------------------------------------------------------ Drafter interface
    def bind(self, target: Target) -> None:
        if self._vocab_size is None:
            self._vocab_size = int(target.vocab_size)

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            raise InvalidInputError("vocab_size is unknown: pass vocab_size= or bind the drafter to a target")
        return self._vocab_size

    def open_batch(self, contexts: Sequence[DraftContext]) -> "NGramBatch":
        return NGramBatch(self, [self._history_of(c) for c in contexts])

    # ------------------------------------------------------------------ internals
    def _history_of(self, context: DraftContext) -> torch.Tensor:
        """A row's committed tokens [L], checked."""
        tokens = context.tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.numel() < 1:
            raise InvalidInputError("DraftContext.tokens must be a non-empty 1-D LongTensor [L]")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.vocab_size:
            raise InvalidInputError(f"context tokens must lie in [0, {self.vocab_size}), found [{lo}, {hi}]")
        return tokens.detach().to(torch.long).clone()

    def _propose_one(self, history: torch.Tensor, step: DraftStep) -> Marginals:
        """One row's marginals [K, V] after ``history`` [L] and the step's root."""
        root = step.root_token
        if not _is_int(root) or not 0 <= root < self.vocab_size:
            raise InvalidInputError(f"root_token must be an int in [0, {self.vocab_size}), got {root!r}")
        seq = torch.cat([history, history.new_tensor([root])])  # [L + 1]
        counts = self._continuation_counts(seq)  # [K, V]
        v = self.vocab_size
        total = counts.sum(dim=-1, keepdim=True)  # [K, 1]
        log_probs = torch.log(counts + self.smoothing / v) - torch.log(total + self.smoothing)  # [K, V]
        return Marginals.from_logits(log_probs, temperature=step.temperature)

    def _continuation_counts(self, seq: torch.Tensor) -> torch.Tensor:
        """Weighted counts ``[K, V]`` of the tokens found k = 1..K positions after earlier occurrences of
        the sequence's last n tokens, summed over n = min_ngram..max_ngram."""
        k_max, length = self.depth, seq.shape[0]
        counts = torch.zeros(k_max, self.vocab_size, dtype=torch.float32, device=seq.device)  # [K, V]
        offsets = torch.arange(1, k_max + 1, device=seq.device)  # [K]
        for n in range(self.min_ngram, min(self.max_ngram, length - 1) + 1):
            query = seq[-n:]  # [n]
            windows = seq.unfold(0, n, 1)  # [P, n], P = length - n + 1; window p covers seq[p : p + n]
            match = (windows == query).all(dim=-1)  # [P]
            follow = torch.arange(windows.shape[0], device=seq.device)[:, None] + (n - 1) + offsets  # [P, K]
            valid = match[:, None] & (follow < length)  # [P, K]; the query itself has no continuation
            tokens = seq[follow.clamp(max=length - 1)]  # [P, K]
            weight = valid.to(torch.float32) * self.ngram_weight ** (n - self.min_ngram)  # [P, K]
            counts.scatter_add_(1, tokens.T, weight.T)  # [K, V] += per-depth counts
        return counts


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class NGramBatch(DraftBatch):
    """The rows of one batch: each row's committed tokens, searched for its own n-grams."""

    def __init__(self, drafter: NGramDrafter, histories: list[torch.Tensor]) -> None:
        self.drafter = drafter
        self.histories = histories  # per row [L_i] long

    def propose(self, steps: Sequence[DraftStep]) -> list[Marginals]:
        if len(steps) != len(self.histories):
            raise InvalidInputError(f"propose() takes one step per row ({len(self.histories)}), got {len(steps)}")
        return [self.drafter._propose_one(h, step) for h, step in zip(self.histories, steps)]

    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor | None]) -> None:
        if len(tokens) != len(self.histories):
            raise InvalidInputError(f"commit() takes one token tensor per row ({len(self.histories)}), got {len(tokens)}")
        for i, tok in enumerate(tokens):
            if not isinstance(tok, torch.Tensor) or tok.dim() != 1:
                raise InvalidInputError("commit() takes a 1-D LongTensor [m] of tokens per row")
            h = self.histories[i]
            self.histories[i] = torch.cat([h, tok.detach().to(device=h.device, dtype=torch.long)])

    def keep(self, rows: Sequence[int]) -> None:
        self.histories = [self.histories[i] for i in rows]

    def extend(self, other: DraftBatch) -> None:
        if not isinstance(other, NGramBatch):
            raise NotImplementedError(f"NGramBatch cannot take in rows of a {type(other).__name__}")
        self.histories.extend(other.histories)
        other.histories = []
