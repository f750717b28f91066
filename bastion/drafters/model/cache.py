"""The autoregressive drafter's own KV cache: committed tokens, then this step's fed tree nodes.

Layout of every layer's keys/values: ``[committed tokens | fed tree nodes]``. A step first runs the
pending committed tokens and the root as one causal chain, then one forward per depth over the newly
expanded nodes, each appended under a 4D mask (committed part fully visible, tree part ancestor-only).
:meth:`DraftKV.keep` moves the accepted path's entries right after the committed part and drops the
other tree nodes, so a commit never recomputes the context.
"""

from __future__ import annotations

from typing import Any

import torch

from bastion.contract.errors import InvalidInputError
from bastion.huggingface.compat import cache_kwargs

__all__ = ["DraftKV"]


class DraftKV:
    """A ``DynamicCache`` plus the bookkeeping of committed entries and fed tree nodes."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache: Any = None
        self.committed = 0  # committed tokens in the cache
        self.fed = 0  # tree nodes at the cache tail (slot j sits at cache index committed + j)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def reset(self) -> None:
        self.cache, self.committed, self.fed = None, 0, 0

    def _call(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None) -> torch.Tensor:
        if self.cache is None:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         **cache_kwargs(self.model, self.cache))
        return out.logits[0]  # [n, V]

    def chain(self, ids: torch.Tensor, n_committed: int) -> torch.Tensor:
        """Run ``ids`` [m] as a causal chain right after the committed part (no tree nodes may be fed).
        The first ``n_committed`` become committed, the rest tree slots 0.. . Returns logits [m, V]."""
        if self.fed:
            raise InvalidInputError("DraftKV.chain() with tree nodes still fed; call drop_tree() first")
        logits = self._call(ids.to(self.device)[None], None, None)  # causal mask after the cache
        self.committed += n_committed
        self.fed = int(ids.shape[0]) - n_committed
        return logits

    def tree(self, ids: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
        """Feed ``ids`` [n] at ``positions`` [n] as new tree slots; ``ancestors`` BoolTensor[n, fed + n]
        says which fed slots (and new nodes) each new node sees. Returns logits [n, V]."""
        n, ctx = int(ids.shape[0]), self.committed
        dev = self.device
        mask = torch.zeros(1, 1, n, ctx + self.fed + n, dtype=self.dtype, device=dev)  # [1, 1, n, ctx + fed + n]
        mask[0, 0, :, ctx:].masked_fill_(~ancestors.to(dev), torch.finfo(self.dtype).min)
        logits = self._call(ids.to(dev)[None], mask, positions.to(dev)[None])
        self.fed += n
        return logits

    def drop_tree(self) -> None:
        """Forget every fed tree node."""
        if self.fed:
            self.cache.crop(-self.fed)
            self.fed = 0

    def keep(self, slots: list[int]) -> None:
        """Commit the fed slots ``slots`` (increasing: a root-to-node path) right after the committed part
        and drop the other tree nodes. Moves ``len(slots)`` entries per layer, never the context."""
        m, ctx = len(slots), self.committed
        if m and slots != list(range(m)):  # a chain prefix is already in place
            src = torch.tensor(slots, dtype=torch.long, device=self.device) + ctx  # [m]
            for layer in self.cache.layers:
                # keys / values: [1, H_kv, ctx + fed, D]; index_select copies before the in-place write
                layer.keys[:, :, ctx : ctx + m] = layer.keys.index_select(2, src)
                layer.values[:, :, ctx : ctx + m] = layer.values.index_select(2, src)
        if self.fed > m:
            self.cache.crop(-(self.fed - m))
        self.committed += m
        self.fed = 0
