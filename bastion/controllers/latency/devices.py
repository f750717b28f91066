"""Peak compute and memory bandwidth of the device a target runs on.

Known GPUs come from a table of vendor figures (dense, no sparsity). A CPU or an unknown accelerator is
measured once with a short micro-benchmark (a matmul and a large copy, well under a second) whose result
is cached on disk, keyed by device name, thread count and dtype. Set ``BASTION_NO_DEVICE_PROBE=1`` (or pass
``probe=False``) to skip the measurement and use conservative defaults instead.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from attrs import field, frozen

from bastion.utils.checks import positive_number
from bastion.utils.dtypes import dtype_bytes, dtype_name, parse_dtype
from bastion.contract.errors import InvalidInputError
from bastion.utils.files import update_json_cache
from bastion.utils.folders import cache_dir
from bastion.utils.sync import device_sync

__all__ = ["DevicePeaks", "GPU_TABLE", "NO_PROBE_ENV", "device_name", "device_peaks", "lookup_gpu", "probe_device"]

NO_PROBE_ENV = "BASTION_NO_DEVICE_PROBE"
_CACHE_FILE = "device_peaks.json"


@frozen
class DevicePeaks:
    """Peak FLOP/s and bytes/s of a device for one dtype, and where the numbers came from."""

    flops_per_s: float = field(converter=float, validator=positive_number)
    bytes_per_s: float = field(converter=float, validator=positive_number)
    name: str = "unknown"
    source: str = "given"  # "table", "probe", "cache" (an earlier probe), "default" or "given"


#: (name fragments, dense 16-bit tensor TFLOP/s, fp32 TFLOP/s, memory bandwidth GB/s); first match wins,
#: so more specific names come first
GPU_TABLE: tuple[tuple[tuple[str, ...], float, float, float], ...] = (
    (("gb200",), 2500.0, 80.0, 8000.0),
    (("b200",), 2250.0, 75.0, 8000.0),
    (("h200",), 989.0, 67.0, 4800.0),
    (("gh200",), 989.0, 67.0, 4000.0),
    (("h100", "pcie"), 756.0, 51.0, 2000.0),
    (("h100", "nvl"), 835.0, 60.0, 3900.0),
    (("h100",), 989.0, 67.0, 3350.0),
    (("h800",), 989.0, 67.0, 3350.0),
    (("a100", "80gb"), 312.0, 19.5, 2039.0),
    (("a100",), 312.0, 19.5, 1555.0),
    (("a800",), 312.0, 19.5, 2039.0),
    (("l40s",), 362.0, 91.6, 864.0),
    (("l40",), 181.0, 90.5, 864.0),
    (("l4",), 121.0, 30.3, 300.0),
    (("a10g",), 70.0, 31.2, 600.0),
    (("a10",), 125.0, 31.2, 600.0),
    (("a6000", "ada"), 364.0, 91.1, 960.0),
    (("a6000",), 155.0, 38.7, 768.0),
    (("rtx 5090",), 210.0, 105.0, 1792.0),
    (("rtx 4090",), 165.0, 82.6, 1008.0),
    (("rtx 3090",), 71.0, 35.6, 936.0),
    (("v100",), 125.0, 15.7, 900.0),
    (("t4",), 65.0, 8.1, 320.0),
    (("mi300x",), 1307.0, 163.4, 5300.0),
    (("mi250",), 362.0, 47.9, 3200.0),
)

#: used when probing is disabled: a modest CPU and a mid-range accelerator
_DEFAULTS = {"cpu": (1.0e11, 2.0e10), "accelerator": (1.0e14, 1.0e12)}


def device_name(device: str | torch.device) -> str:
    """A human-readable name: the GPU product name, or the CPU model with its thread count."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type == "cpu":
        return f"{_cpu_model()} x{torch.get_num_threads()}"
    return dev.type


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def lookup_gpu(name: str, dtype: Any = torch.bfloat16) -> DevicePeaks | None:
    """Peaks of a known GPU by product name, or ``None`` when the table has no match."""
    low = name.lower()
    for fragments, tf16, tf32, gbs in GPU_TABLE:
        if all(f in low for f in fragments):
            tflops = tf32 if dtype_bytes(dtype) >= 4 else tf16
            return DevicePeaks(tflops * 1e12, gbs * 1e9, name=name, source="table")
    return None


def device_peaks(device: str | torch.device = "cpu", dtype: Any = torch.float32, *, probe: bool | None = None) -> DevicePeaks:
    """Peaks for ``device`` at ``dtype``: the GPU table, else a cached or fresh micro-benchmark, else
    defaults (``probe=False`` or ``BASTION_NO_DEVICE_PROBE=1``)."""
    dev = torch.device(device)
    name = device_name(dev)
    if dev.type == "cuda":
        known = lookup_gpu(name, dtype)
        if known is not None:
            return known
    if probe is None:
        probe = os.environ.get(NO_PROBE_ENV, "").strip().lower() not in ("1", "true", "yes")
    if not probe:
        flops, bw = _DEFAULTS["cpu" if dev.type == "cpu" else "accelerator"]
        return DevicePeaks(flops, bw, name=name, source="default")
    key = f"{name}|{dtype_name(dtype)}"
    cached = _read_cache().get(key)
    if cached is not None:
        try:
            return DevicePeaks(cached["flops_per_s"], cached["bytes_per_s"], name=name, source="cache")
        except (KeyError, TypeError, InvalidInputError):
            pass  # a corrupt entry is measured again
    peaks = probe_device(dev, dtype)
    _write_cache(key, {"flops_per_s": peaks.flops_per_s, "bytes_per_s": peaks.bytes_per_s, "measured": time.time()})
    return peaks


def probe_device(device: str | torch.device, dtype: Any = torch.float32, *, budget_s: float = 0.5) -> DevicePeaks:
    """Measure achievable FLOP/s (square matmul) and bytes/s (large copy); best of a few repeats."""
    dev = torch.device(device)
    dt = parse_dtype(dtype)
    size = 512 if dev.type == "cpu" else 4096
    a = torch.randn(size, size, device=dev, dtype=torch.float32).to(dt)
    b = torch.randn(size, size, device=dev, dtype=torch.float32).to(dt)
    src = torch.empty(16 * 2**20 if dev.type == "cpu" else 256 * 2**20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    best_mm, best_cp = float("inf"), float("inf")
    deadline = time.perf_counter() + budget_s
    for i in range(8):
        best_mm = min(best_mm, _time(lambda: torch.mm(a, b), dev))
        best_cp = min(best_cp, _time(lambda: dst.copy_(src), dev))
        if i >= 2 and time.perf_counter() > deadline:
            break
    flops = 2.0 * size**3 / best_mm
    bw = 2.0 * src.numel() / best_cp  # read + write
    return DevicePeaks(flops, bw, name=device_name(dev), source="probe")


def _time(fn: Any, dev: torch.device) -> float:
    device_sync(dev)
    t0 = time.perf_counter()
    fn()
    device_sync(dev)
    return max(time.perf_counter() - t0, 1e-9)


def _cache_path() -> Path:
    return cache_dir() / _CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    try:  # locked, merged at write time, replaced atomically (see update_json_cache)
        update_json_cache(_cache_path(), "device peaks cache", lambda data: {**data, key: entry})
    except OSError:
        pass  # a read-only home only costs a re-measurement next time
