"""A reproducible competing load for benchmarks: what a shared machine does to the clock, on purpose.

``bastion bench --contention SPEC`` starts the load before the first prompt and stops it after the
last, so every method is measured beside the same neighbour (methods are interleaved per prompt). A
spec is ``KIND:WORKERS[@ON/OFF]``:

- ``torch:2@1.5/1`` -- one process running float32 matrix products on 2 torch threads for 1.5 s, idle
  for 1 s, over and over (bursts that oversubscribe the cores);
- ``busy:1`` -- one process spinning a plain Python loop, all the time (a steady load on one core);
- ``busy:2@3/3`` -- two spinning processes, 3 s on and 3 s off;
- ``none`` -- no load.

The load runs in child processes of its own (:data:`WORKER`), so it competes
for the cores, the memory bandwidth and the caches exactly as another tenant would; stopping it kills
the children.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Literal

from attrs import frozen

from bastion.contract.errors import InvalidInputError

__all__ = ["Contention", "ContentionSpec", "parse_contention"]

_SPEC = re.compile(r"^(torch|busy):(\d+)(?:@([0-9.]+)/([0-9.]+))?$")


@frozen
class ContentionSpec:
    """What load to run: ``kind`` ``"torch"`` (matrix products on ``workers`` threads in one process) or
    ``"busy"`` (``workers`` spinning processes); on for ``on_s`` seconds then off for ``off_s``, or all the
    time when ``on_s`` is None."""

    kind: Literal["torch", "busy"]
    workers: int
    on_s: float | None = None
    off_s: float = 0.0

    def __str__(self) -> str:
        period = "" if self.on_s is None else f"@{self.on_s:g}/{self.off_s:g}"
        return f"{self.kind}:{self.workers}{period}"


def parse_contention(text: str) -> ContentionSpec | None:
    """``KIND:WORKERS[@ON/OFF]`` -> a :class:`ContentionSpec`; ``"none"`` (or empty) -> None."""
    text = (text or "").strip()
    if text in ("", "none"):
        return None
    m = _SPEC.match(text)
    if m is None:
        raise InvalidInputError(
            f"--contention {text!r}: expected KIND:WORKERS[@ON/OFF] with KIND torch or busy, e.g. torch:2@1.5/1 or busy:1"
        )
    kind, workers, on, off = m.groups()
    n = int(workers)
    if not 1 <= n <= 64:
        raise InvalidInputError(f"--contention {text!r}: WORKERS must lie in 1..64, got {n}")
    if on is None:
        return ContentionSpec(kind, n)  # type: ignore[arg-type]
    on_s, off_s = float(on), float(off)
    if on_s <= 0 or off_s < 0:
        raise InvalidInputError(f"--contention {text!r}: ON must be > 0 seconds and OFF >= 0")
    return ContentionSpec(kind, n, on_s, off_s)  # type: ignore[arg-type]


class Contention:
    """The load of ``spec`` in child processes, as a context manager (``None``: no load)."""

    def __init__(self, spec: ContentionSpec | None) -> None:
        self.spec = spec
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> "Contention":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return any(p.poll() is None for p in self._procs)

    def start(self) -> None:
        spec = self.spec
        if spec is None or self._procs:
            return
        period = [str(spec.on_s or 0.0), str(spec.off_s)]
        if spec.kind == "torch":
            cmds = [[sys.executable, "-c", WORKER, "torch", str(spec.workers), *period]]
        else:
            cmds = [[sys.executable, "-c", WORKER, "busy", "1", *period] for _ in range(spec.workers)]
        env = {**os.environ, "OMP_NUM_THREADS": str(spec.workers)}
        self._procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in cmds]

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []


# ---------------------------------------------------------------------- the worker processes
#: the load process's whole program, run with ``python -c`` so that it imports nothing of bastion (the
#: package imports torch and transformers: seconds of CPU the load would spend before it starts)
WORKER = r"""
import os, sys, time
kind, threads, on_s, off_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
parent = os.getppid()
if kind == "torch":
    import torch
    torch.set_num_threads(threads)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    def work():
        global a
        a = (a @ b).tanh_()
else:
    def work():
        x = 0
        for _ in range(20000):
            x += 1
start = time.perf_counter()
while os.getppid() == parent:  # ends with the bench that started it
    if on_s > 0:
        phase = (time.perf_counter() - start) % (on_s + off_s)
        if phase >= on_s:
            time.sleep(on_s + off_s - phase)
            continue
    work()
"""
