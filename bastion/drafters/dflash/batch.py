"""Batched DFlash drafting: per-row draft-context caches in one padded buffer, one forward per step.

Row i's projected context keys/values sit in slots ``[0, len_i)`` of per-layer buffers
``[B, h_kv, capacity, D]`` (zero beyond, masked out). Newly committed features of every row are projected
in one :meth:`DFlashDraftModel.context_kv` call and written at each row's own tail; then all rows' blocks
``[root_i, MASK x (B - 1)]`` at positions ``len_i ..`` run through the draft network in one forward with a
per-row context mask. Row i's marginals equal what the single-sequence drafter proposes for it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from bastion.contract.batch_state import DraftBatch
from bastion.contract.errors import InvalidInputError
from bastion.utils.sync import to_device
from bastion.contract.types import DraftContext, DraftStep, Marginals
from bastion.drafters.dflash.model import ContextKV, DFlashDraftModel

__all__ = ["DFlashDraftBatch", "lean_draft"]

#: a row with more pending positions than this (a prompt that just joined) is projected on its own
_BATCHED_FLUSH = 64
#: a batch of one projects at most this many new positions in the draft's own pass (as the single drafter)
_FRESH_MAX = 32


def lean_draft(
    model: DFlashDraftModel,
    embed: torch.nn.Module,
    head: torch.nn.Module,
    block_size: int,
    step: DraftStep,
    committed: int,
    past: ContextKV,
    fresh: torch.Tensor | None = None,  # [1, P, F] features of positions not yet in ``past``, or None
) -> Marginals:
    """One sequence's marginals by the lean pass: the block ``[root, MASK x (B - 1)]`` at positions
    ``committed ..`` over ``past`` (whose scratch holds ``fresh``'s positions and the block), the head on
    the usable depths only (``step.max_depth``), no validation read (the tree builder's one transfer
    rejects NaN marginals). The single-sequence drafter and a batch of one both draft through it."""
    depth = block_size - 1 if step.max_depth is None else max(1, min(block_size - 1, step.max_depth))
    block = torch.full((1, block_size), model.config.mask_token_id, dtype=torch.long, device=model.device)
    block[0, :1].fill_(int(step.root_token))  # a kernel argument: no host-to-device copy
    logits = model.block_logits(
        None, block, embed=embed, head=head, block_positions=committed, past_context=past, depths=depth, fresh_context=fresh
    )[0]  # [depth, V]
    return Marginals.from_logits(logits[:depth], temperature=step.temperature, validate=False)


class DFlashDraftBatch(DraftBatch):
    """Per-row DFlash draft contexts of a batch (see the module doc)."""

    def __init__(
        self,
        model: DFlashDraftModel,
        embed: torch.nn.Module,
        head: torch.nn.Module,
        block_size: int,
        contexts: Sequence[DraftContext],
    ) -> None:
        self.model, self.embed, self.head, self.block_size = model, embed, head, block_size
        cfg = model.config
        self._keys: list[torch.Tensor] = []  # per layer [B, h_kv, capacity, D]
        self._values: list[torch.Tensor] = []
        self._lens = [0] * len(contexts)  # projected positions per row
        self._pending: list[list[torch.Tensor]] = [[] for _ in contexts]  # committed features not yet projected
        self._plain: list[torch.Tensor] = []  # plain steps' features since, each [B, F]: after every pending row entry
        for i, context in enumerate(contexts):
            feats = context.features
            if feats is None:
                raise InvalidInputError(f"row {i}: the DFlash drafter needs target features; prefill with its feature_layers")
            if feats.dim() != 2 or feats.shape[0] != context.tokens.shape[0] or feats.shape[1] != cfg.feature_size:
                raise InvalidInputError(
                    f"row {i}: features must be [{context.tokens.shape[0]}, {cfg.feature_size}], got {tuple(feats.shape)}"
                )
            self._pending[i].append(feats)

    # ---------------------------------------------------------------- interface
    def committed(self, row: int) -> int:
        return self._lens[row] + sum(int(f.shape[0]) for f in self._pending[row]) + len(self._plain)

    @torch.inference_mode()
    def propose(self, steps: Sequence[DraftStep]) -> list[Marginals]:
        b = len(self._lens)
        if len(steps) != b:
            raise InvalidInputError(f"got {len(steps)} draft steps for a batch of {b} rows")
        vocab = self.model.config.vocab_size
        for i, step in enumerate(steps):
            if not 0 <= step.root_token < vocab:
                raise InvalidInputError(f"row {i}: root token {step.root_token} lies outside the vocabulary [0, {vocab})")
            if step.context_len != self.committed(i):
                raise InvalidInputError(
                    f"row {i}: drafter holds {self.committed(i)} committed positions but the step's context length is {step.context_len}"
                )
        device = self.model.device
        if b == 1 and not torch.is_grad_enabled():
            return [self._propose_one(steps[0], device)]
        self._flush(device)
        lens = torch.tensor(self._lens, device=device)  # [B]
        longest = max(self._lens)
        block = torch.full((b, self.block_size), self.model.config.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = to_device([s.root_token for s in steps], torch.long, device)  # [B, bs]
        positions = lens[:, None] + torch.arange(self.block_size, device=device)  # [B, bs]
        visible = torch.arange(longest, device=device)[None] < lens[:, None]  # [B, C]
        past = ContextKV(tuple(k[:, :, :longest] for k in self._keys), tuple(v[:, :, :longest] for v in self._values))
        logits = self.model.block_logits(
            None, block, embed=self.embed, head=self.head, block_positions=positions, context_mask=visible, past_context=past
        )  # [B, bs - 1, V]
        k = self.block_size - 1
        temps = [s.temperature for s in steps]
        if len(set(temps)) == 1:  # one temperature for every row (the usual case): applied in one division
            flat = Marginals.from_logits(logits[:, :k].reshape(b * k, -1).float(), temperature=temps[0])
        else:  # rows sampling at different temperatures (a server's batch): each row's logits scaled by its own
            scale = to_device(temps, torch.float32, device)[:, None, None]  # [B, 1, 1]
            flat = Marginals.from_logits((logits[:, :k].float() / scale).reshape(b * k, -1))
        lp = flat.log_probs.view(b, k, -1)  # [B, K, V], checked once for the whole batch
        return [Marginals(lp[i]) for i in range(b)]

    def _propose_one(self, step: DraftStep, device: torch.device) -> Marginals:
        """A batch of one, as the single-sequence drafter drafts: the few positions committed since the
        last step are projected in the block's own pass (their keys/values land in the first scratch
        slots past the row's length: where they belong), the block runs the lean pass over the row's
        context (no mask; its own keys/values go to scratch slots that later projections overwrite),
        and the head runs on the usable depths only; the tree builder's one transfer rejects NaN
        marginals."""
        self._fold_plain()
        pending = sum(int(f.shape[0]) for f in self._pending[0])
        fresh = None
        if 0 < pending <= _FRESH_MAX and self._lens[0] > 0:
            fresh = torch.cat(self._pending[0], dim=0).to(device, self.model.dtype)[None]  # [1, P, F]
            self._pending[0] = []
        else:
            self._flush(device)
            pending = 0
        length = self._lens[0]
        spare = pending + self.block_size
        self._reserve(length + spare, ContextKV(self._keys, self._values))
        past = ContextKV(
            tuple(k[:, :, : length + spare] for k in self._keys), tuple(v[:, :, : length + spare] for v in self._values), tail=spare
        )
        marginals = lean_draft(self.model, self.embed, self.head, self.block_size, step, length + pending, past, fresh)
        self._lens[0] = length + pending
        return marginals

    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor | None]) -> None:
        if len(tokens) != len(self._lens) or len(features) != len(self._lens):
            raise InvalidInputError(f"commit needs tokens and features for each of the {len(self._lens)} rows")
        self._fold_plain()
        for i, (tok, feat) in enumerate(zip(tokens, features)):
            if feat is None:
                raise InvalidInputError(f"row {i}: the DFlash drafter needs the committed positions' target features")
            if feat.shape[0] != tok.shape[0]:
                raise InvalidInputError(f"row {i}: commit got {tok.shape[0]} tokens but {feat.shape[0]} feature rows")
            self._pending[i].append(feat)

    def commit_next(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """A plain step's features [B, F], kept as one tensor (no per-row work) until the next proposal."""
        b = len(self._lens)
        if features is None:
            raise InvalidInputError("the DFlash drafter needs the committed positions' target features")
        if tokens.shape != (b,) or features.dim() != 2 or features.shape[0] != b:
            raise InvalidInputError(f"commit_next needs tokens [{b}] and features [{b}, F], got {tuple(tokens.shape)} and {tuple(features.shape)}")
        self._plain.append(features)

    def keep(self, rows: Sequence[int]) -> None:
        rows = list(rows)
        if rows == list(range(len(self._lens))):
            return
        self._fold_plain()
        if self._keys:
            idx = torch.tensor(rows, device=self._keys[0].device)
            self._keys = [k.index_select(0, idx) for k in self._keys]
            self._values = [v.index_select(0, idx) for v in self._values]
        self._lens = [self._lens[r] for r in rows]
        self._pending = [self._pending[r] for r in rows]

    def extend(self, other: DraftBatch) -> None:
        """Append ``other``'s rows (a batch of the same drafter): buffers zero-padded to the larger
        capacity and stacked along the batch axis; pending features carried over."""
        if not isinstance(other, DFlashDraftBatch) or other.model is not self.model:
            raise InvalidInputError("extend() takes a DFlash batch of the same draft model")
        self._fold_plain()
        other._fold_plain()
        if self._keys or other._keys:
            ref = self._keys or other._keys
            cap = max(k.shape[2] for k in (self._keys + other._keys))

            def stacked(mine: list[torch.Tensor], theirs: list[torch.Tensor], b_mine: int, b_theirs: int) -> list[torch.Tensor]:
                out = []
                for i, r in enumerate(ref):
                    buf = r.new_zeros((b_mine + b_theirs, r.shape[1], cap, r.shape[3]))
                    if mine:
                        buf[:b_mine, :, : mine[i].shape[2]] = mine[i]
                    if theirs:
                        buf[b_mine:, :, : theirs[i].shape[2]] = theirs[i].to(buf.device)
                    out.append(buf)
                return out

            b_mine, b_theirs = len(self._lens), len(other._lens)
            self._keys = stacked(self._keys, other._keys, b_mine, b_theirs)
            self._values = stacked(self._values, other._values, b_mine, b_theirs)
        self._lens = self._lens + other._lens
        self._pending = self._pending + other._pending
        other._keys, other._values, other._lens, other._pending = [], [], [], []

    # ---------------------------------------------------------------- cache
    def _fold_plain(self) -> None:
        """Append the stacked plain-step features to each row's pending list (keeps their order)."""
        if not self._plain:
            return
        stacked = torch.stack(self._plain, dim=1)  # [B, P, F]
        for i, pending in enumerate(self._pending):
            pending.append(stacked[i])
        self._plain = []

    def _flush(self, device: torch.device) -> None:
        """Project every row's pending features and write them at each row's tail: the usual few
        positions per row in one call for the whole batch; a row with many (a prompt that just joined)
        in a call of its own, so the other rows are not padded to its length."""
        self._fold_plain()
        counts = [sum(int(f.shape[0]) for f in p) for p in self._pending]
        if max(counts) == 0:
            return
        long_rows = [i for i, c in enumerate(counts) if c > _BATCHED_FLUSH]
        short = [0 if i in long_rows else c for i, c in enumerate(counts)]
        if max(short) > 0:
            self._project(list(range(len(counts))), short, device)
        for i in long_rows:
            self._project([i], [counts[i]], device)
        self._lens = [n + c for n, c in zip(self._lens, counts)]
        self._pending = [[] for _ in counts]

    def _project(self, rows: list[int], counts: list[int], device: torch.device) -> None:
        """Project the pending features of ``rows`` (``counts[j]`` of row ``rows[j]``; either every row
        of the batch or one) and write them after each row's context."""
        width = max(counts)
        feat_size = self.model.config.feature_size
        feats = torch.zeros(len(rows), width, feat_size, dtype=self.model.dtype, device=device)  # [R, P, F]
        for j, (i, c) in enumerate(zip(rows, counts)):
            if c:
                feats[j, :c] = torch.cat(self._pending[i], dim=0).to(device, self.model.dtype)
        lens = torch.tensor([self._lens[i] for i in rows], device=device)  # [R]
        positions = lens[:, None] + torch.arange(width, device=device)  # [R, P]
        new = self.model.context_kv(feats, positions)  # per layer [R, h_kv, P, D]
        self._reserve(int(lens.max()) + width, new)
        dst = positions[:, None, :, None]  # [R, 1, P, 1]; padding entries land past each row's new length
        one = rows[0] if len(rows) == 1 else None
        for buf, k in zip(self._keys, new.keys):
            (buf if one is None else buf[one : one + 1]).scatter_(2, dst.expand_as(k), k)
        for buf, v in zip(self._values, new.values):
            (buf if one is None else buf[one : one + 1]).scatter_(2, dst.expand_as(v), v)

    def _reserve(self, need: int, like: ContextKV) -> None:
        """Grow the buffers (zero-filled, capacity doubling) to hold ``need`` slots."""
        cap = self._keys[0].shape[2] if self._keys else 0
        if need <= cap:
            return
        new_cap = max(need, 2 * cap, 64)

        def grow(old: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
            buf = ref.new_zeros((len(self._lens), ref.shape[1], new_cap, ref.shape[3]))  # zeros: masked slots stay finite
            if old is not None:
                buf[:, :, :cap] = old
            return buf

        olds_k = self._keys or [None] * len(like.keys)
        olds_v = self._values or [None] * len(like.values)
        self._keys = [grow(o, r) for o, r in zip(olds_k, like.keys)]
        self._values = [grow(o, r) for o, r in zip(olds_v, like.values)]
