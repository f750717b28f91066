"""One device synchronisation helper for every timer (gpt-fast's ``device_sync``)."""

from __future__ import annotations

import torch

__all__ = ["device_sync"]


def device_sync(device: torch.device | str) -> None:
    """Wait for the queued work on ``device`` (CUDA, XPU, MPS); a no-op on the CPU. Call it only
    around timed regions, never inside a step's logic."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.synchronize(dev)
    elif dev.type == "mps" and hasattr(torch, "mps"):
        torch.mps.synchronize()
