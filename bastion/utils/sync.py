"""Every point where the host waits for the device goes through this module: ``device_sync`` for timers
(gpt-fast's one helper) and ``to_host`` for every host read of a tensor inside a decode step. Both are
counted by :func:`count_syncs`, so a test can hold the step to its budget of synchronisations (the
count is the same on every device: it counts the calls, whether or not the CPU had to wait)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

__all__ = ["SyncCounter", "count_syncs", "device_sync", "to_device", "to_host"]


class SyncCounter:
    """Host reads and device synchronisations seen while :func:`count_syncs` is active."""

    def __init__(self) -> None:
        self.count = 0
        self.sites: list[str] = []  # what each one was for (the ``why`` given at the call)


_ACTIVE: contextvars.ContextVar[SyncCounter | None] = contextvars.ContextVar("bastion_sync_counter", default=None)


@contextlib.contextmanager
def count_syncs() -> Iterator[SyncCounter]:
    """Count every :func:`to_host` and :func:`device_sync` call made inside the ``with`` block."""
    counter = SyncCounter()
    token = _ACTIVE.set(counter)
    try:
        yield counter
    finally:
        _ACTIVE.reset(token)


def _note(why: str) -> None:
    counter = _ACTIVE.get()
    if counter is not None:
        counter.count += 1
        counter.sites.append(why)


def to_host(tensor: torch.Tensor, why: str = "") -> Any:
    """``tensor.tolist()``: the one way a step reads device values on the host (one synchronisation)."""
    _note(why or "to_host")
    return tensor.tolist()


def to_device(data: Any, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host data (a list or a CPU tensor) as a tensor on ``device`` without waiting for the device: an
    asynchronous copy (a blocking host-to-device copy waits for every queued kernel first, a hidden
    synchronisation per call). The CPU source is staged by the driver at the call, so it may be freed."""
    src = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return src.to(device=device, dtype=dtype, non_blocking=True)


def device_sync(device: torch.device | str) -> None:
    """Wait for the queued work on ``device`` (CUDA, XPU, MPS); a no-op on the CPU. Call it only
    around timed regions, never inside a step's logic."""
    dev = torch.device(device)
    _note("device_sync")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.synchronize(dev)
    elif dev.type == "mps" and hasattr(torch, "mps"):
        torch.mps.synchronize()
