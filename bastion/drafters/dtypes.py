"""Drafter options shared by the built-in drafters."""

from __future__ import annotations

import torch

from bastion.contract.errors import InvalidInputError

__all__ = ["as_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return None
    if name not in _DTYPES:
        raise InvalidInputError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]
