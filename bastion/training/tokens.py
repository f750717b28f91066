"""Tokenize documents once into a flat id stream (EOS-separated) and cut fixed-length training windows."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from bastion.utils.files import atomic_path, warn_cache
from bastion.training.corpus import Document

__all__ = ["encode_documents", "load_or_encode", "cached_token_array", "sample_windows", "eval_windows"]


def encode_documents(tokenizer, docs: Sequence[Document]) -> np.ndarray:
    """One uint16/int32 array holding every document's ids back to back (documents end in EOS)."""
    enc = tokenizer._tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    dtype = np.uint16 if len(tokenizer) <= 65535 else np.int32
    parts = [np.asarray(e.ids, dtype=dtype) for e in enc]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def load_or_encode(path: Path, tokenizer, docs: Sequence[Document]) -> np.ndarray:
    """The id stream of ``docs``, cached at ``path`` (see :func:`cached_token_array`)."""
    return cached_token_array(Path(path), lambda: encode_documents(tokenizer, docs), vocab_size=len(tokenizer))


def cached_token_array(path: Path, build: Callable[[], np.ndarray], *, vocab_size: int) -> np.ndarray:
    """The token-id array cached at ``path`` when it is a valid one (a 1-D integer ``.npy`` with ids in
    ``[0, vocab_size)``), else ``build()``, written atomically so an interrupted run never leaves a torn
    cache. A broken cache warns (:class:`~bastion.utils.files.CacheWarning`) and is rebuilt."""
    path = Path(path)
    if path.exists():
        problem = _token_cache_problem(path, vocab_size)
        if problem is None:
            return np.load(path, allow_pickle=False)
        warn_cache(f"token cache {path} {problem}")
    ids = build()
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # a file object: np.save would add ".npy" to a name
        np.save(f, ids)
    return ids


def _token_cache_problem(path: Path, vocab_size: int) -> str | None:
    try:
        ids = np.load(path, allow_pickle=False, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        return f"cannot be read ({exc})"
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        return f"holds a {ids.dtype} array of shape {ids.shape}, not a 1-D integer id stream"
    if ids.size == 0:
        return "is empty"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        return f"holds ids in [{lo}, {hi}], outside the tokenizer's vocabulary [0, {vocab_size})"
    return None


def sample_windows(stream: np.ndarray, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq_len`` ids from the stream -> LongTensor[batch, seq_len]."""
    hi = len(stream) - seq_len
    starts = torch.randint(0, max(1, hi), (batch,), generator=generator).tolist()
    rows = [torch.from_numpy(stream[s : s + seq_len].astype(np.int64)) for s in starts]
    return torch.stack(rows)


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Consecutive, non-overlapping windows from the start of the stream -> LongTensor[n, seq_len]."""
    n = min(max_windows, len(stream) // seq_len)
    return torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)
