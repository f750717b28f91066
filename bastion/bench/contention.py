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

**Paired phases.** An on/off load that runs free lands its bursts wherever the clock puts them: with
runs of about a second and bursts of 1.5 s, one method's run of a prompt can fall in a burst and the
next method's in the pause, and the same-run ratios then follow the alignment, not the methods (on
the demo pair one prompt's ratio moved 0.6-2.3x between methods of equal speed). So by default the
bench re-phases the load before every run (:meth:`Contention.align`): every method's run of a prompt
(and round) starts at the same point of the load's period, and successive prompts start at spread
phases (:func:`round_phase`, a low-discrepancy sequence), so the bursts hit every method at the same
moments of its run while the prompts together sample the whole period. ``--contention-sync none``
lets the load run free.
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

__all__ = ["Contention", "ContentionSpec", "parse_contention", "round_phase"]

#: the golden ratio's fractional part: successive rounds' phases spread evenly over the period
_SPREAD = 0.6180339887498949

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

    @property
    def period_s(self) -> float | None:
        """Seconds of one on/off cycle (None: a steady load)."""
        return None if self.on_s is None else self.on_s + self.off_s


def round_phase(index: int, period_s: float) -> float:
    """Where in the load's period (seconds from the start of a burst, in ``[0, period_s)``) the runs of
    round ``index`` (a prompt and repeat) start: ``frac(index * 0.618...) * period_s``, so any run of
    consecutive rounds covers the period evenly."""
    if index < 0:
        raise InvalidInputError(f"round index must be >= 0, got {index}")
    return ((index * _SPREAD) % 1.0) * period_s


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

    def __init__(self, spec: ContentionSpec | None, *, sync: bool = True) -> None:
        self.spec = spec
        self.sync = bool(sync)  # re-phase the load before each run (see the module doc)
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
        self._procs = [
            subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for cmd in cmds
        ]

    def align(self, round_index: int) -> None:
        """Put an on/off load at round ``round_index``'s phase (:func:`round_phase`) now, before a run
        of that round starts; nothing for a steady load, a load that runs free (``sync=False``) or one
        not started. The workers hear it on their stdin within a millisecond, waiting or working."""
        spec = self.spec
        if spec is None or spec.period_s is None or not self.sync:
            return
        line = f"{round_phase(round_index, spec.period_s):.6f}\n".encode()
        for p in self._procs:
            if p.stdin is None or p.poll() is not None:
                continue
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except (BrokenPipeError, OSError):  # a worker that died leaves the others running
                pass

    def stop(self) -> None:
        for p in self._procs:
            if p.stdin is not None:
                try:
                    p.stdin.close()  # end of input: the worker exits by itself
                except OSError:
                    pass
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
import os, select, sys, time
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
def listen(timeout):
    # a line on stdin is the phase (seconds into the period) to be at now; end of input ends the load
    global start
    if not select.select([0], [], [], timeout)[0]:
        return
    data = os.read(0, 4096)
    if not data:
        sys.exit(0)
    lines = [x for x in data.split(b"\n") if x.strip()]
    if lines:
        start = time.perf_counter() - float(lines[-1])
while os.getppid() == parent:  # ends with the bench that started it
    if on_s > 0:
        phase = (time.perf_counter() - start) % (on_s + off_s)
        if phase >= on_s:
            listen(on_s + off_s - phase)
            continue
        listen(0)
    work()
"""
