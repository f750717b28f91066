"""Measure a target's verify-latency curve on the current device and fit the roofline model to it.

Used by ``bastion calibrate``; also callable from Python::

    from bastion.controllers.latency.calibrate import calibrate
    result = calibrate(target, sizes=(1, 4, 16, 64), context_lens=(64, 512))
    result.model.save_profile()        # later pipelines on this device and model start from it
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from attrs import field, frozen

from bastion.controllers.latency.fit import FitResult
from bastion.controllers.latency.roofline import RooflineLatency
from bastion.contract.errors import InvalidInputError
from bastion.contract.sampling import seeded_generator
from bastion.utils.sync import device_sync
from bastion.contract.target import Target
from bastion.contract.tree import Tree

__all__ = [
    "DEFAULT_SIZES",
    "DEFAULT_CONTEXTS",
    "CalibrationPoint",
    "CalibrationResult",
    "measure_verify_curve",
    "calibrate",
    "plot_calibration",
]

#: children per node of the probe trees: bushy, so that even large trees stay shallow
_BRANCHING = 4
#: the tree sizes and the committed context lengths a calibration measures unless told otherwise
DEFAULT_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_CONTEXTS: tuple[int, ...] = (64, 512)


@frozen
class CalibrationPoint:
    n_tokens: int
    context_len: int  # committed tokens when measured (the requested context plus the probes before it)
    seconds: float  # median over repeats
    requested_context: int | None = None  # the context length asked for (the plot's series)

    @property
    def series(self) -> int:
        return self.context_len if self.requested_context is None else self.requested_context


#: a fit is reported as bad above either error (relative to the measured latency)
BAD_FIT_MEDIAN = 0.25
BAD_FIT_MAX = 1.0


@frozen
class CalibrationResult:
    model: RooflineLatency = field(eq=False)
    points: tuple[CalibrationPoint, ...] = field(converter=tuple)
    fit: FitResult | None

    def bad_fit(self) -> str | None:
        """Why the fit is too poor to save (with advice), or None when it is usable."""
        err = self.rel_errors()
        median, worst = float(np.median(err)), float(err.max())
        if median <= BAD_FIT_MEDIAN and worst <= BAD_FIT_MAX:
            return None
        return (
            f"the fit is poor (median error {median:.0%}, max {worst:.0%}): timings this noisy usually mean other "
            "work on the machine or too few repeats. Retry with more --repeats (5 or more), on an idle machine, "
            "with contexts and sizes close to real use; pass --force to save it anyway"
        )

    def rel_errors(self) -> np.ndarray:
        """|model - measured| / measured per point [P]."""
        pred = np.array([self.model.predict(p.n_tokens, p.context_len) for p in self.points])
        meas = np.array([p.seconds for p in self.points])
        return np.abs(pred - meas) / meas


def probe_tree(n: int, vocab_size: int, generator: torch.Generator) -> Tree:
    """A bushy tree of ``n`` nodes with random tokens (verify cost depends on n, not on the tokens)."""
    tokens = torch.randint(0, vocab_size, (n,), generator=generator)
    parents = [-1] + [(i - 1) // _BRANCHING for i in range(1, n)]
    return Tree.from_parents(tokens, parents)


def _bushy_depth(n: int) -> int:
    depth, level, total = 0, 1, 1
    while total < n:
        level *= _BRANCHING
        total += level
        depth += 1
    return depth


def measure_verify_curve(
    target: Target,
    sizes: Iterable[int] = DEFAULT_SIZES,
    context_lens: Iterable[int] = DEFAULT_CONTEXTS,
    *,
    repeats: int = 3,
    warmup: int = 2,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> list[tuple[int, int, list[float]]]:
    """Time ``target.forward_tree`` for every (size, context) that fits; returns (n, c, [seconds...]).
    ``clock``: wall time by default; ``time.thread_time`` measures one CPU thread's own work, which
    other processes competing for the cores do not inflate (torch on one thread)."""
    curve = _measure(target, sizes, context_lens, repeats, warmup, seed, clock)
    return [(n, c, times) for n, c, times, _ in curve]


def _measure(
    target: Target, sizes: Iterable[int], context_lens: Iterable[int], repeats: int, warmup: int, seed: int,
    clock: Callable[[], float],
) -> list[tuple[int, int, list[float], int]]:
    """:func:`measure_verify_curve` with the requested context of each point: (n, c, [seconds], requested)."""
    sizes = sorted({int(n) for n in sizes})
    contexts = sorted({int(c) for c in context_lens})
    if not sizes or sizes[0] < 1 or not contexts or contexts[0] < 1:
        raise InvalidInputError("calibration needs tree sizes >= 1 and context lengths >= 1")
    if repeats < 1 or warmup < 0:
        raise InvalidInputError("repeats must be >= 1 and warmup >= 0")
    gen = seeded_generator(seed)
    sync = lambda: device_sync(target.device)  # noqa: E731
    results: list[tuple[int, int, list[float], int]] = []
    for c in contexts:
        growth = warmup + len(sizes) * (1 + repeats)  # each forward commits its root: the context grows by one
        fitting = [n for n in sizes if c + growth + _bushy_depth(n) + 1 < target.max_positions]
        if not fitting:
            continue
        target.reset()
        target.prefill(torch.randint(0, target.vocab_size, (1, c), generator=gen))
        for i, n in enumerate(fitting):
            tree = probe_tree(n, target.vocab_size, gen)
            times = []
            for r in range(warmup + repeats if i == 0 else 1 + repeats):  # warm the kernels once per context
                sync()
                t0 = clock()
                target.forward_tree(tree)
                sync()
                elapsed = clock() - t0
                ctx = target.context_len
                target.commit(torch.zeros(1, dtype=torch.long))  # keep the root: context grows by one
                if r >= (warmup if i == 0 else 1):
                    times.append(elapsed)
            results.append((n, ctx, times, c))
    target.reset()
    if not results:
        raise InvalidInputError(f"no (size, context) pair fits the target's {target.max_positions} positions")
    return results


def calibrate(
    target: Target,
    sizes: Iterable[int] = DEFAULT_SIZES,
    context_lens: Iterable[int] = DEFAULT_CONTEXTS,
    *,
    repeats: int = 3,
    warmup: int = 2,
    profile: str | Path | None = None,
    probe: bool | None = None,
) -> CalibrationResult:
    """Measure the verify curve of ``target`` and fit a fresh :class:`RooflineLatency` to it (built the
    way a pipeline builds it, so a saved profile matches). Nothing is saved here."""
    curve = _measure(target, sizes, context_lens, repeats, warmup, seed=0, clock=time.perf_counter)
    model = RooflineLatency(
        model_config=target.config,
        device=str(target.device),
        profile=None,
        probe=probe,
        window=max(512, sum(len(t) for _, _, t, _ in curve)),
    )
    if profile is not None:
        model.profile_path = Path(profile)
    for n, c, times, _ in curve:
        for s in times:
            model.observe(n, c, s)
    fit = model.refit()
    points = tuple(CalibrationPoint(n, c, statistics.median(t), requested) for n, c, t, requested in curve)
    return CalibrationResult(model, points, fit)


def plot_calibration(result: CalibrationResult, path: str | Path) -> Path:
    """Write a PNG of measured (dots) vs modelled (line) verify latency, one series per requested context
    length (the model line at the series' mean measured context)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInputError(
            "writing the calibration plot needs matplotlib: pip install 'bastion[plot]' (or pass --no-plot)"
        ) from None
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    by_ctx: dict[int, list[CalibrationPoint]] = {}
    for p in result.points:
        by_ctx.setdefault(p.series, []).append(p)
    for i, (ctx, pts) in enumerate(sorted(by_ctx.items())):
        color = f"C{i % 10}"
        ns = np.array([p.n_tokens for p in pts])
        ax.plot(ns, [p.seconds * 1e3 for p in pts], "o", color=color, label=f"measured, context {ctx}")
        grid = np.unique(np.geomspace(ns.min(), ns.max(), 64).round().astype(np.int64))
        at = int(round(float(np.mean([p.context_len for p in pts]))))
        model = result.model.predict_many(torch.from_numpy(grid), at).numpy() * 1e3
        ax.plot(grid, model, "-", color=color, alpha=0.8, label=f"model, context {ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree tokens verified (n)")
    ax.set_ylabel("verify latency (ms)")
    err = result.rel_errors()
    ax.set_title(f"{result.model.device_label}: median error {np.median(err):.1%}, max {err.max():.1%}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
