"""A reproducible competing load for benchmarks: what a shared machine does to the clock, on purpose.

``bastion bench --contention SPEC`` starts the load before the first prompt and stops it after the
last, so every method is measured beside the same neighbour (methods are interleaved per prompt). A
spec is ``KIND:WORKERS[@ON/OFF]``:

- ``torch:2@1.5/1`` -- one process running float32 matrix products on 2 torch threads for 1.5 s, idle
  for 1 s, over and over (bursts that oversubscribe the cores);
- ``busy:1`` -- one process spinning a plain Python loop, all the time (a steady load on one core);
- ``busy:2@3/3`` -- two spinning processes, 3 s on and 3 s off;
- ``none`` -- no load.

The load runs in child processes of its own (``python -m bastion.bench.contention``), so it competes
for the cores, the memory bandwidth and the caches exactly as another tenant would; stopping it kills
the children.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from typing import Literal

from attrs import frozen

from bastion.core.errors import InvalidInputError

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
        args = ["--on", str(spec.on_s or 0.0), "--off", str(spec.off_s)]
        if spec.kind == "torch":
            cmds = [[sys.executable, "-m", "bastion.bench.contention", "torch", "--threads", str(spec.workers), *args]]
        else:
            cmds = [[sys.executable, "-m", "bastion.bench.contention", "busy", *args] for _ in range(spec.workers)]
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
def _periods(on_s: float, off_s: float):  # type: ignore[no-untyped-def]
    """Yield True while the load should run (always when ``on_s`` is 0)."""
    start = time.perf_counter()
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the bench that started this load is gone: stop with it
            return
        if on_s <= 0:
            yield True
            continue
        phase = (time.perf_counter() - start) % (on_s + off_s)
        if phase < on_s:
            yield True
        else:
            time.sleep(on_s + off_s - phase)
            yield False


def _torch_worker(threads: int, on_s: float, off_s: float) -> None:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(512, 512)
    b = torch.randn(512, 512)
    for active in _periods(on_s, off_s):
        if active:
            a = (a @ b).tanh_()


def _busy_worker(on_s: float, off_s: float) -> None:
    x = 0
    for active in _periods(on_s, off_s):
        if active:
            for _ in range(20000):
                x += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bastion.bench.contention", description="run one competing load until killed")
    parser.add_argument("kind", choices=("torch", "busy"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--on", type=float, default=0.0, help="seconds on per period (0: always on)")
    parser.add_argument("--off", type=float, default=0.0, help="seconds off per period")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.kind == "torch":
        _torch_worker(args.threads, args.on, args.off)
    else:
        _busy_worker(args.on, args.off)
    return 0


if __name__ == "__main__":  # pragma: no cover - the child process
    sys.exit(main())

