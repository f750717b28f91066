"""Floating-point dtype names: one parser for options, configs and the command line."""

from __future__ import annotations

import logging
import sys
from typing import Any

from attrs import frozen
import torch

from bastion.contract.errors import InvalidInputError

__all__ = [
    "AutoDtype",
    "CLI_DTYPES",
    "DTYPE_BYTES",
    "auto_dtype",
    "dtype_bytes",
    "dtype_name",
    "fast_bfloat16",
    "parse_dtype",
    "show_dtype_choices",
]

log = logging.getLogger("bastion.dtype")

#: dtypes offered on the command line
CLI_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
    "double": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

#: bytes per element of the dtypes bastion models
DTYPE_BYTES: dict[torch.dtype, int] = {
    torch.float32: 4,
    torch.float16: 2,
    torch.bfloat16: 2,
    torch.float64: 8,
    torch.float8_e4m3fn: 1,
    torch.float8_e5m2: 1,
}


def parse_dtype(value: Any, *, allow_auto: bool = False) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"bf16"``, ``"torch.float16"``...).
    With ``allow_auto``, ``None`` and ``"auto"`` mean "keep the checkpoint's own" and give None."""
    if isinstance(value, torch.dtype):
        return value
    if allow_auto and (value is None or value == "auto"):
        return None
    if isinstance(value, str):
        dtype = _NAMES.get(value.strip().lower().removeprefix("torch."))
        if dtype is not None:
            return dtype
    known = ", ".join(sorted(_NAMES) + (["auto"] if allow_auto else []))
    raise InvalidInputError(f"unknown dtype {value!r}; use a torch.dtype or one of {known}")


def dtype_name(dtype: Any) -> str:
    """The canonical name (``"bfloat16"``) of a dtype or any accepted name of it."""
    parsed = parse_dtype(dtype)
    assert parsed is not None
    return str(parsed).removeprefix("torch.")


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype or its name."""
    parsed = parse_dtype(dtype)
    if parsed not in DTYPE_BYTES:
        raise InvalidInputError(f"no byte size known for dtype {parsed}")
    return DTYPE_BYTES[parsed]


def fast_bfloat16(device: torch.device | str) -> bool:
    """Whether ``device`` runs bfloat16 matrix products natively (CUDA GPUs from Ampere on; CPUs with
    the AVX-512 BF16 or AMX instructions that oneDNN uses), so a bfloat16 model there is faster than a
    float32 one rather than emulated and slower."""
    dev = torch.device(device)
    try:
        if dev.type == "cuda":
            return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if dev.type == "cpu":
            return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without the query: assume emulation
        return False
    return False


@frozen
class AutoDtype:
    """What dtype ``auto`` computes a checkpoint in on a device: ``dtype`` None keeps the stored one."""

    dtype: torch.dtype | None
    reason: str

    def log(self, what: str) -> None:
        """One ``bastion.dtype`` INFO line naming ``what`` was loaded, the dtype chosen and why (only when
        the choice differs from the stored dtype)."""
        if self.dtype is not None:
            log.info("%s: dtype auto -> %s (%s)", what, dtype_name(self.dtype), self.reason)


def auto_dtype(stored: Any, device: torch.device | str) -> AutoDtype:
    """The dtype ``auto`` computes a checkpoint stored in ``stored`` (a dtype, its name, or None when
    unknown) in on ``device``: a float16 checkpoint on a CPU computes in float32, since CPUs have no fast
    float16 matrix products (PyTorch emulates them) and float32 holds every float16 value exactly, so
    the weights are unchanged; anything else keeps its stored dtype. A dtype the user names is never
    passed through here."""
    parsed = None if stored is None else parse_dtype(stored)
    if parsed == torch.float16 and torch.device(device).type == "cpu":
        return AutoDtype(
            torch.float32,
            "the checkpoint stores float16, which CPUs compute slowly; float32 holds its weights exactly; "
            "name a dtype to override",
        )
    return AutoDtype(None, "the checkpoint's own dtype")


def show_dtype_choices() -> None:
    """Print the ``bastion.dtype`` lines (what dtype ``auto`` chose and why) on stderr, for command-line
    tools; nothing changes when logging already has a handler for them."""
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
