"""Tokenize documents once into a flat id stream (EOS-separated) and cut fixed-length training windows."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from bastion.training.corpus import Document

__all__ = ["encode_documents", "load_or_encode", "sample_windows", "eval_windows"]


def encode_documents(tokenizer, docs: Sequence[Document]) -> np.ndarray:
    """One uint16/int32 array holding every document's ids back to back (documents end in EOS)."""
    enc = tokenizer._tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    dtype = np.uint16 if len(tokenizer) <= 65535 else np.int32
    parts = [np.asarray(e.ids, dtype=dtype) for e in enc]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def load_or_encode(path: Path, tokenizer, docs: Sequence[Document]) -> np.ndarray:
    if path.exists():
        return np.load(path)
    ids = encode_documents(tokenizer, docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, ids)
    return ids


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
