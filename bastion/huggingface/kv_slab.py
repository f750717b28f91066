"""A preallocated, in-place key/value cache layer for Hugging Face models.

transformers' ``DynamicLayer`` concatenates the whole cache with the new keys and values on every
forward, so each verify step copies the full context once per layer: cost that grows with the context
for reasons that are not attention work. :class:`SlabLayer` keeps per-layer storage with spare capacity
(doubling when full, like a vector) and writes each forward's new entries into it in place; ``keys`` /
``values`` are views of the filled part, so readers (attention, bastion's commit) see the usual
``[B, H_kv, length, D]`` tensors and ``crop`` is a view change. A step copies only its own new entries.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["SlabLayer", "slab_cache"]

#: spare slots allocated past the first forward's length (a verify tree never needs more than this at once)
_INITIAL_SPARE = 256


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` whose storage is preallocated and filled in place."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._slab_k: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self._slab_v: torch.Tensor | None = None
        self._length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._length = 0
        self._slab_k = self._slab_v = None
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def _reserve(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        capacity = 0 if self._slab_k is None else self._slab_k.shape[-2]
        if need <= capacity:
            return
        new_cap = max(need + _INITIAL_SPARE, 2 * capacity)
        b, h, _, d = like_k.shape
        slab_k = like_k.new_empty((b, h, new_cap, d))
        slab_v = like_v.new_empty((b, h, new_cap, like_v.shape[-1]))
        if self._length:
            slab_k[..., : self._length, :] = self._slab_k[..., : self._length, :]  # type: ignore[index]
            slab_v[..., : self._length, :] = self._slab_v[..., : self._length, :]  # type: ignore[index]
        self._slab_k, self._slab_v = slab_k, slab_v

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self._length + n
        self._reserve(end, key_states, value_states)
        assert self._slab_k is not None and self._slab_v is not None
        self._slab_k[..., self._length : end, :] = key_states  # only the new entries are copied
        self._slab_v[..., self._length : end, :] = value_states
        self._length = end
        self.keys = self._slab_k[..., :end, :]
        self.values = self._slab_v[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def reset(self) -> None:
        self._slab_k = self._slab_v = None
        self._length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` entries (transformers 5 convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("SlabLayer.crop takes a negative count of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._length = max(0, self._length + tokens_to_remove)
        assert self._slab_k is not None and self._slab_v is not None
        self.keys = self._slab_k[..., : self._length, :]
        self.values = self._slab_v[..., : self._length, :]

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys`` / ``values`` [B, H_kv, S, D] as the filled part (copied into fresh storage with
        spare capacity): how a batch takes in rows prefilled elsewhere."""
        b, h, length, d = keys.shape
        cap = length + _INITIAL_SPARE
        self._slab_k = keys.new_empty((b, h, cap, d))
        self._slab_v = values.new_empty((b, h, cap, values.shape[-1]))
        self._slab_k[..., :length, :] = keys
        self._slab_v[..., :length, :] = values
        self._length = length
        self.device = keys.device
        self.is_initialized = True
        self.keys = self._slab_k[..., :length, :]
        self.values = self._slab_v[..., :length, :]

    def keep_rows(self, rows: list[int]) -> None:
        """Keep batch rows ``rows`` (ascending row indices, host ints), in place: the rows from the first
        one that left onward move down over it, their filled slots only (``batch_select_indices`` copies
        every row's whole capacity, spare slots included, into new storage). A batch whose rows finish
        one at a time (a server's) compacts its cache at every finish: at 16 rows of about 200 slots
        in a slab of 456, one moved row costs a sixteenth of that copy's bytes, the last row leaving
        none."""
        if self._slab_k is None or not rows:
            return
        if any(b <= a for a, b in zip(rows, rows[1:])) or rows[0] < 0 or rows[-1] >= self._slab_k.shape[0]:
            raise ValueError(f"keep_rows needs ascending row indices within the batch, got {rows}")
        first = next((k for k, r in enumerate(rows) if r != k), len(rows))  # rows before it stay where they are
        n = self._length
        if first < len(rows):
            src = torch.tensor(rows[first:], device=self._slab_k.device)  # [M] rows moving down
            for slab in (self._slab_k, self._slab_v):
                assert slab is not None
                slab[first : len(rows), :, :n] = slab[src, :, :n]  # [M, H_kv, n, D]: gathered first, then written
        self._slab_k = self._slab_k[: len(rows)]  # a view: the storage (and its spare) stays
        self._slab_v = self._slab_v[: len(rows)]  # type: ignore[index]
        self.keys = self._slab_k[..., :n, :]
        self.values = self._slab_v[..., :n, :]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._slab_k is None:
            return
        self._slab_k = self._slab_k[indices]
        self._slab_v = self._slab_v[indices]  # type: ignore[index]
        self.keys = self._slab_k[..., : self._length, :]
        self.values = self._slab_v[..., : self._length, :]


def slab_cache(config: Any) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose plain full-attention layers are :class:`SlabLayer` (other
    layer kinds, e.g. sliding windows, keep transformers' own implementation)."""
    cache = DynamicCache(config=config)
    cache.layers = [SlabLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
