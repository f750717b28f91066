"""Several sequences in one Hugging Face ``DynamicCache``: the batched state of :class:`HFTarget`.

Layout: the cache holds ``S`` slots per row; row i's committed tokens sit in slots ``[0, ctx_i)`` and
everything after them is masked out. A step appends one padded block of ``W`` tree slots to every row
(row i's node j at slot ``S + j``, position ``ctx_i + depth_j``) under a 4D additive mask
``[B, 1, W, S + W]``: row i's own context visible, ancestor-only inside its tree, padding slots see only
themselves. :meth:`HFTargetBatch.commit` then gathers each row's accepted entries and writes them right
after that row's context (``m_i`` entries per row and layer move), and crops the cache to the longest
row. :meth:`HFTargetBatch.keep` drops finished rows from the batch dimension.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from bastion.contract.batch_state import BatchPrefill, BatchTargetOutput, TargetBatch
from bastion.contract.errors import InvalidInputError
from bastion.huggingface.kv_slab import SlabLayer, slab_cache
from bastion.contract.tree import Tree

if TYPE_CHECKING:
    from bastion.contract.target import Target

__all__ = ["HFTargetBatch", "padded_ancestors"]


def padded_ancestors(trees: Sequence[Tree], width: int, device: torch.device) -> torch.Tensor:
    """BoolTensor[B, W, W]: row i's ancestor mask in its top-left corner; padding slots see themselves."""
    b = len(trees)
    out = torch.eye(width, dtype=torch.bool, device=device).repeat(b, 1, 1)  # [B, W, W]
    for i, tree in enumerate(trees):
        n = len(tree)
        if n > 1:
            out[i, :n, :n] = tree.ancestor_mask().to(device)
    return out


def _pad_slots(buf: torch.Tensor, slots: int) -> torch.Tensor:
    """``buf`` [B, H_kv, S, D] zero-padded to ``slots`` along the slot axis (masked slots stay finite)."""
    extra = slots - buf.shape[2]
    if extra <= 0:
        return buf[:, :, :slots]
    return torch.cat([buf, buf.new_zeros(buf.shape[0], buf.shape[1], extra, buf.shape[3])], dim=2)


class HFTargetBatch(TargetBatch):
    """Ragged rows in one padded cache of an :class:`HFTarget` (see the module doc)."""

    def __init__(self, target: "Target") -> None:  # an HFTarget: its model, forward_rows and positions
        self.target = target
        self._cache: Any = None
        self._ctx: list[int] = []
        self._pending = 0  # W tree slots at the cache tail, until commit
        self._slots = 0  # S: cache length before the pending block

    # ------------------------------------------------------------------ state
    @property
    def context_lens(self) -> list[int]:
        return list(self._ctx)

    @property
    def cache(self) -> Any:
        """The underlying ``DynamicCache`` (tests inspect it; row i is valid in ``[0, ctx_i)``)."""
        return self._cache

    def _layers(self) -> list[Any]:
        return list(self._cache.layers)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, prompts: Sequence[torch.Tensor], feature_layers: tuple[int, ...] = ()) -> BatchPrefill:
        """Run every prompt (LongTensor [L_i]) into one right-padded cache in one forward."""
        t = self.target
        if not prompts:
            raise InvalidInputError("a batch needs at least one prompt")
        lens = [int(p.shape[-1]) for p in prompts]
        for i, n in enumerate(lens):
            if n < 1:
                raise InvalidInputError(f"prompt {i} is empty: every prompt needs at least one token")
            if n > t.max_positions:
                raise InvalidInputError(f"prompt {i} has {n} tokens; the target accepts at most {t.max_positions} positions")
        dev, b, s = t.device, len(prompts), max(lens)
        ids = torch.zeros(b, s, dtype=torch.long, device=dev)  # [B, S], pad id 0 in the masked tail
        for i, p in enumerate(prompts):
            ids[i, : lens[i]] = p.reshape(-1).to(dev)
        lens_t = torch.tensor(lens, device=dev)  # [B]
        q = torch.arange(s, device=dev)
        causal = q[None, :, None] >= q[None, None, :]  # [1, S, S] key <= query
        visible = causal & (q[None, None, :] < lens_t[:, None, None])  # [B, S, S]
        visible |= torch.eye(s, dtype=torch.bool, device=dev)[None]  # padding queries see themselves
        mask = self._additive(visible)  # [B, 1, S, S]
        positions = q[None].expand(b, -1)  # [B, S]
        last = lens_t - 1  # [B]
        keep = torch.unique(last)  # [U] sorted positions whose logits are needed
        cache = slab_cache(t.model.config)  # preallocated layers: a step writes only its own new entries
        logits, feats = t.forward_rows(ids, mask, positions, cache, feature_layers, logits_to_keep=keep)
        col = torch.searchsorted(keep, last)  # [B] column of each row's last position in the kept logits
        last_logits = logits[torch.arange(b, device=dev), col]  # [B, V]
        self._cache, self._ctx, self._slots, self._pending = cache, lens, s, 0
        features = None if feats is None else tuple(feats[i, : lens[i]] for i in range(b))  # per row [L_i, F]
        return BatchPrefill(last_logits=last_logits, features=features)

    # ------------------------------------------------------------------ steps
    @torch.inference_mode()
    def forward_trees(self, trees: Sequence[Tree], feature_layers: tuple[int, ...] = ()) -> BatchTargetOutput:
        t = self.target
        if self._cache is None:
            raise InvalidInputError("forward_trees() needs a prefilled batch")
        if len(trees) != len(self._ctx):
            raise InvalidInputError(f"got {len(trees)} trees for a batch of {len(self._ctx)} rows")
        self._drop_pending()
        dev, s = t.device, self._slots
        width = max(len(tree) for tree in trees)
        for i, (tree, ctx) in enumerate(zip(trees, self._ctx)):
            if ctx + tree.max_depth >= t.max_positions:
                raise InvalidInputError(
                    f"row {i}: tree of depth {tree.max_depth} after {ctx} committed tokens exceeds the target's "
                    f"{t.max_positions} positions"
                )
        ctx_t = torch.tensor(self._ctx, device=dev)  # [B]
        # padding slots hold token 0 at depth 0: masked from every real node, their outputs unused
        tokens = pad_sequence([t.tokens.to(dev) for t in trees], batch_first=True)  # [B, W]
        depths = pad_sequence([t.depths.to(dev) for t in trees], batch_first=True)  # [B, W]
        positions = ctx_t[:, None] + depths  # [B, W]
        ctx_visible = torch.arange(s, device=dev)[None, None, :] < ctx_t[:, None, None]  # [B, 1, S]
        visible = torch.cat(
            [ctx_visible.expand(-1, width, -1), padded_ancestors(trees, width, dev)], dim=-1
        )  # [B, W, S + W]
        logits, feats = t.forward_rows(tokens, self._additive(visible), positions, self._cache, feature_layers)
        self._pending = width
        return BatchTargetOutput(logits=logits, features=feats)  # [B, W, V], [B, W, F]

    @torch.inference_mode()
    def commit(self, accepted_nodes: Sequence[torch.Tensor]) -> None:
        if self._pending == 0:
            raise InvalidInputError("commit() without a pending tree block: call forward_trees() first")
        b, s, w = len(self._ctx), self._slots, self._pending
        if len(accepted_nodes) != b:
            raise InvalidInputError(f"got accepted nodes for {len(accepted_nodes)} rows; the batch has {b}")
        paths = [torch.as_tensor(n, dtype=torch.long).reshape(-1).tolist() for n in accepted_nodes]
        for i, path in enumerate(paths):
            if not path or path[0] != 0 or any(b_ <= a for a, b_ in zip(path, path[1:])) or path[-1] >= w:
                raise InvalidInputError(f"row {i}: accepted_nodes must start at the root (0) and increase below {w}, got {path}")
        m_max = max(len(p) for p in paths)
        src, dst = [], []
        for ctx, path in zip(self._ctx, paths):
            pad = m_max - len(path)  # repeat the last pair: the same value is written twice
            src.append([s + j for j in path] + [s + path[-1]] * pad)
            dst.append([ctx + k for k in range(len(path))] + [ctx + len(path) - 1] * pad)
        dev = self.target.device
        src_t = torch.tensor(src, device=dev)  # [B, M] cache slots of the accepted nodes
        dst_t = torch.tensor(dst, device=dev)  # [B, M] slots right after each row's context
        for layer in self._layers():
            for buf in (layer.keys, layer.values):  # each [B, H_kv, S + W, D], on its layer's device
                shape = (-1, buf.shape[1], -1, buf.shape[3])
                src_l, dst_l = src_t.to(buf.device), dst_t.to(buf.device)  # no-ops on a single device
                moved = buf.gather(2, src_l[:, None, :, None].expand(shape))  # [B, H_kv, M, D], a copy
                buf.scatter_(2, dst_l[:, None, :, None].expand(shape), moved)
        self._ctx = [ctx + len(path) for ctx, path in zip(self._ctx, paths)]
        self._pending = 0
        self._fit(s + w)

    @torch.inference_mode()
    def forward_next(self, tokens: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> BatchTargetOutput:
        """A plain step without trees: row i's token at slot ``S`` and position ``ctx_i``, seeing its own
        context and itself (mask ``[B, 1, 1, S + 1]``)."""
        t = self.target
        if self._cache is None:
            raise InvalidInputError("forward_next() needs a prefilled batch")
        b = len(self._ctx)
        if tokens.dim() != 1 or int(tokens.shape[0]) != b:
            raise InvalidInputError(f"forward_next() takes one token per row: a LongTensor [{b}], got {tuple(tokens.shape)}")
        self._drop_pending()
        longest = max(self._ctx)
        if longest >= t.max_positions:
            row = self._ctx.index(longest)
            raise InvalidInputError(f"row {row}: {longest} committed tokens leave no position below the target's {t.max_positions}")
        dev, s = t.device, self._slots
        ids = tokens.to(dev, torch.long)[:, None]  # [B, 1]
        if self._aligned():
            # every row's context fills the slots (a batch of one always): each new token sees every slot
            # before it and itself, plain causal decoding, no mask to build or apply
            mask, positions = None, torch.full((b, 1), s, dtype=torch.long, device=dev)  # [B, 1]
        else:
            ctx_t = torch.tensor(self._ctx, device=dev)  # [B]
            cols = torch.arange(s + 1, device=dev)  # [S + 1]
            visible = (cols[None, :] < ctx_t[:, None]) | (cols[None, :] == s)  # [B, S + 1]: own context, own new slot
            mask, positions = self._additive(visible[:, None, :]), ctx_t[:, None]
        logits, feats = t.forward_rows(ids, mask, positions, self._cache, feature_layers)
        self._pending = 1
        return BatchTargetOutput(logits=logits, features=feats)  # [B, 1, V], [B, 1, F]

    @torch.inference_mode()
    def commit_next(self) -> None:
        """Move every row's new entry from slot ``S`` to slot ``ctx_i`` (one indexed copy per layer
        buffer), then crop to the longest row."""
        if self._pending != 1:
            raise InvalidInputError("commit_next() needs the one-token block of forward_next() pending")
        b, s = len(self._ctx), self._slots
        if self._aligned():  # every row's new entry already sits at its own slot ctx_i == S
            self._ctx = [ctx + 1 for ctx in self._ctx]
            self._pending = 0
            self._slots = s + 1
            return
        dev = self.target.device
        ctx_t = torch.tensor(self._ctx, device=dev)  # [B] destination slots
        rows = torch.arange(b, device=dev)  # [B]
        for layer in self._layers():
            for buf in (layer.keys, layer.values):  # each [B, H_kv, S + 1, D], on its layer's device
                r, c = rows.to(buf.device), ctx_t.to(buf.device)  # no-ops on a single device
                buf[r, :, c] = buf[:, :, s].clone()  # [B, H_kv, D]; a row whose ctx_i == S rewrites itself
        self._ctx = [ctx + 1 for ctx in self._ctx]
        self._pending = 0
        self._fit(s + 1)

    @torch.inference_mode()
    def keep(self, rows: Sequence[int]) -> None:
        rows = list(rows)
        b = len(self._ctx)
        if not rows or any(not 0 <= r < b for r in rows):
            raise InvalidInputError(f"keep() needs row indices in [0, {b}), got {rows}")
        self._drop_pending()
        if rows == list(range(b)):
            return
        ascending = all(a < b for a, b in zip(rows, rows[1:]))
        for layer in self._layers():
            if ascending and isinstance(layer, SlabLayer):
                layer.keep_rows(rows)  # in place, filled slots only
            else:
                layer.batch_select_indices(torch.tensor(rows, device=layer.keys.device))
        self._ctx = [self._ctx[r] for r in rows]
        self._fit(self._slots)

    @torch.inference_mode()
    def prefill_more(self, tokens: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One row's next prompt chunk ``tokens`` [k] after its context: a plain causal forward over the
        cache (the row has no padding), logits kept for the last position only."""
        if len(self._ctx) != 1:
            raise InvalidInputError(f"prefill_more() extends a batch of one row, this one has {len(self._ctx)}")
        self._drop_pending()
        t = self.target
        k, ctx = int(tokens.shape[0]), self._ctx[0]
        if ctx + k > t.max_positions:
            raise InvalidInputError(f"{ctx} + {k} prompt tokens exceed the target's {t.max_positions} positions")
        ids = tokens.to(t.device, torch.long)[None]  # [1, k]
        positions = torch.arange(ctx, ctx + k, device=t.device)[None]  # [1, k]
        logits, feats = t.forward_rows(ids, None, positions, self._cache, feature_layers, logits_to_keep=1)
        self._ctx = [ctx + k]
        self._slots = ctx + k
        return logits[:, -1], None if feats is None else feats[0]  # [1, V], [k, F]

    @torch.inference_mode()
    def extend(self, other: TargetBatch) -> None:
        """Append the rows of ``other`` (a batch of the same target, e.g. newcomers prefilled on their
        own) after this batch's rows; ``other`` is spent. Both caches are padded to the longer one's
        slots and stacked along the batch dimension: one copy of each layer, once per join."""
        if not isinstance(other, HFTargetBatch) or other.target is not self.target:
            raise InvalidInputError("extend() takes a batch opened on the same target")
        if other._cache is None or self._cache is None:
            raise InvalidInputError("extend() needs two prefilled batches")
        self._drop_pending()
        other._drop_pending()
        s = max(self._slots, other._slots)
        for mine, theirs in zip(self._cache.layers, other._cache.layers, strict=True):
            keys = torch.cat([_pad_slots(mine.keys, s), _pad_slots(theirs.keys, s).to(mine.keys.device)])  # [B+B', H, S, D]
            values = torch.cat([_pad_slots(mine.values, s), _pad_slots(theirs.values, s).to(mine.values.device)])
            if isinstance(mine, SlabLayer):
                mine.adopt(keys, values)
            else:
                mine.keys, mine.values = keys, values
        self._ctx = self._ctx + other._ctx
        self._slots = s
        other._cache, other._ctx = None, []

    # ------------------------------------------------------------------ internals
    def _fit(self, length: int) -> None:
        """Crop the cache from ``length`` slots to the longest row's context."""
        longest = max(self._ctx)
        if length > longest:
            self._cache.crop(-(length - longest))
        self._slots = longest

    def _aligned(self) -> bool:
        """Whether every row's context is exactly the cache's slots (no row is padded)."""
        s = self._slots
        return all(ctx == s for ctx in self._ctx)

    def _drop_pending(self) -> None:
        if self._pending:
            self._cache.crop(-self._pending)
            self._pending = 0

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """Bool [B, q, k] (True = visible) -> additive float mask [B, 1, q, k]."""
        t = self.target
        mask = torch.zeros(visible.shape, dtype=t.dtype, device=visible.device)
        return mask.masked_fill_(~visible, torch.finfo(t.dtype).min)[:, None]
