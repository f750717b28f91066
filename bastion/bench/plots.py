"""PNG plots of a benchmark run (matplotlib, headless backend)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Sequence

from bastion.bench.methods import ADAPTIVE, AR
from bastion.bench.metrics import ALL_DATASETS, STAGES, sweep_budget
from bastion.bench.runner import BenchRun

__all__ = [
    "write_plots",
    "plot_speedup",
    "plot_acceptance_vs_budget",
    "plot_latency_fit",
    "plot_stages",
    "plot_reliability",
    "reliability_points",
]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _datasets(run: BenchRun) -> list[str]:
    return [d for d in dict.fromkeys(s.dataset for s in run.stats) if d != ALL_DATASETS]


def plot_speedup(run: BenchRun, path: Path) -> Path:
    """Grouped bars: speedup over ar per dataset, one bar per method."""
    plt = _plt()
    datasets = _datasets(run)
    methods = [s.name for s in run.specs if s.name != AR]
    speed = {(s.dataset, s.method): (s.speedup or 0.0) for s in run.stats}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.5 * len(methods) * len(datasets)), 4.0))
    width = 0.8 / max(1, len(methods))
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        ys = [speed.get((d, m), 0.0) for d in datasets]
        bars = ax.bar(xs, ys, width, label=m, color=cmap(j), edgecolor="black" if m == ADAPTIVE else None)
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=6)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("speedup over ar (same run)")
    ax.set_title("Speedup per dataset")
    ax.legend(fontsize=7, ncol=min(5, len(methods)), loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_acceptance_vs_budget(run: BenchRun, path: Path) -> Path:
    """Per dataset: acceptance length and speedup of the fixed-budget sweep vs N, the adaptive
    controller's result marked at its mean budget, and the histogram of the budgets it chose."""
    plt = _plt()
    datasets = _datasets(run)
    fig, axes = plt.subplots(2, len(datasets), figsize=(4.2 * len(datasets), 5.6), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1]}, sharex="col")
    for k, ds in enumerate(datasets):
        ax, hax = axes[0][k], axes[1][k]
        by = {s.method: s for s in run.stats if s.dataset == ds}
        sweep = sorted((b, s) for m, s in by.items() if (b := sweep_budget(m)) is not None)
        ax2 = ax.twinx()
        if sweep:
            ax.plot([b for b, _ in sweep], [s.acceptance_length for _, s in sweep], "o-", color="tab:blue", label="accept len (fixed N)")
            ax2.plot([b for b, _ in sweep], [s.speedup or 0.0 for _, s in sweep], "s--", color="tab:orange", label="speedup (fixed N)")
        ours = by.get(ADAPTIVE)
        if ours is not None:
            ax.plot([ours.mean_budget], [ours.acceptance_length], "*", ms=14, color="tab:blue", mec="black", label="bastion accept len")
            ax2.plot([ours.mean_budget], [ours.speedup or 0.0], "*", ms=14, color="tab:orange", mec="black", label="bastion speedup")
            ns = sorted(ours.budget_hist)
            hax.bar(ns, [ours.budget_hist[n] / max(1, ours.steps) for n in ns], width=[max(0.8, 0.08 * n) for n in ns], color="gray")
        chain = by.get("chain")
        if chain is not None:
            ax.axhline(chain.acceptance_length, color="tab:blue", lw=0.8, ls=":", label="chain accept len")
        ax.set_xscale("log", base=2)
        hax.set_xscale("log", base=2)
        ax.set_title(ds)
        ax.set_ylabel("acceptance length (tokens/step)")
        ax2.set_ylabel("speedup over ar")
        hax.set_xlabel("budget N (nodes verified)")
        hax.set_ylabel("bastion steps")
        if k == 0:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency_fit(run: BenchRun, path: Path) -> Path | None:
    """Measured verify times of every tree method vs budget, with the adaptive pipeline's latency
    model curve at the median context length."""
    if run.latency is None or not run.latency.points or run.latency_model is None:
        return None
    plt = _plt()
    pts = run.latency.points
    ctx = int(statistics.median(c for _, c, _ in pts))
    nmax = max(max(n for n, _, _ in pts), 2)
    grid = sorted({1, *range(1, nmax + 1, max(1, nmax // 64)), nmax})
    fig, ax = plt.subplots(figsize=(6, 4))
    sc = ax.scatter([n for n, _, _ in pts], [1e3 * s for _, _, s in pts], c=[c for _, c, _ in pts], s=8, cmap="viridis", alpha=0.6)
    fig.colorbar(sc, ax=ax, label="context length")
    ax.plot(grid, [1e3 * float(run.latency_model.predict(n, ctx)) for n in grid], "r-", label=f"model at context {ctx}")
    lo, hi, clipped = latency_axis_range([1e3 * s for _, _, s in pts])
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    if clipped:
        ax.plot([], [], " ", label=f"{clipped} outlier(s) above the axis not shown")
    err = run.latency.mean_abs_rel_error
    ax.set_title("Verify latency: measured vs model" + ("" if err is None else f" (mean |rel err| {100 * err:.0f}%)"))
    ax.set_xlabel("tree tokens verified (N)")
    ax.set_ylabel("verify time (ms)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def latency_axis_range(values_ms: Sequence[float], *, spread: float = 10.0) -> tuple[float, float, int]:
    """A log-axis range (lo, hi) that keeps the bulk of ``values_ms`` readable: from half the smallest
    value to 1.5 x the largest value within ``spread`` x the median; and the count of points left above it
    (bursts of foreign load, not the latency law)."""
    vals = sorted(v for v in values_ms if v > 0)
    if not vals:
        return 0.1, 1.0, 0
    median = vals[len(vals) // 2]
    hi = 1.5 * max(v for v in vals if v <= spread * median)
    return vals[0] / 2, hi, sum(1 for v in vals if v > hi)


def plot_stages(run: BenchRun, path: Path) -> Path:
    """Stacked bars: share of wall time per stage for each method (all datasets pooled)."""
    plt = _plt()
    pooled = ALL_DATASETS if any(s.dataset == ALL_DATASETS for s in run.stats) else run.stats[0].dataset
    rows = [s for s in run.stats if s.dataset == pooled]
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.5))
    left = [0.0] * len(rows)
    cmap = plt.get_cmap("tab10")
    for j, stage in enumerate(STAGES):
        vals = [100 * s.stage_frac[stage] for s in rows]
        ax.barh(range(len(rows)), vals, left=left, color=cmap(j), label=stage)
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(rows)), [s.method for s in rows])
    ax.invert_yaxis()
    ax.set_xlabel("% of wall time")
    ax.set_title("Time split per stage")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def reliability_points(
    predicted: list[float], realized: list[float], bins: int = 10
) -> list[tuple[float, float, int]]:
    """(mean predicted, mean realized, steps) per bin of equal step counts, sorted by prediction."""
    pairs = sorted(zip(predicted, realized))
    if not pairs:
        return []
    bins = max(1, min(bins, len(pairs)))
    out = []
    for b in range(bins):
        chunk = pairs[b * len(pairs) // bins : (b + 1) * len(pairs) // bins]
        if chunk:
            out.append((statistics.fmean(p for p, _ in chunk), statistics.fmean(r for _, r in chunk), len(chunk)))
    return out


def plot_reliability(run: BenchRun, path: Path, method: str = ADAPTIVE) -> Path | None:
    """Reliability diagram of ``method``'s acceptance predictions over its drafted steps: mean realized
    tokens per step against the mean prediction, in bins of equal step counts, for the raw surrogate
    A_hat and for the calibrated A_cal the controller decided with. The diagonal is a perfect forecast."""
    steps = [s for r in run.runs if r.method == method for s in r.result.steps if s.calibrated_accept is not None]
    if not steps:
        return None
    plt = _plt()
    realized = [float(s.accepted + 1) for s in steps]
    raw = reliability_points([s.predicted_accept for s in steps], realized)
    cal = reliability_points([float(s.calibrated_accept) for s in steps], realized)  # type: ignore[arg-type]
    top = max(max(p for p, _, _ in raw), max(r for _, r, _ in raw), max(p for p, _, _ in cal), 1.5)
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    ax.plot([1, top], [1, top], color="gray", lw=0.8, ls="--", label="perfect forecast")
    ax.plot([p for p, _, _ in raw], [r for _, r, _ in raw], "o-", color="tab:red", label="raw A_hat")
    ax.plot([p for p, _, _ in cal], [r for _, r, _ in cal], "s-", color="tab:blue", label="calibrated A_cal")
    ax.set_xlabel("predicted tokens per step")
    ax.set_ylabel("realized tokens per step (bin mean)")
    ax.set_title(f"{method}: acceptance reliability, T = {run.config.temperature:g} ({len(steps)} drafted steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(run: BenchRun, out_dir: Path) -> list[Path]:
    """Write every plot that the run has data for; returns the files written."""
    files = [
        plot_speedup(run, out_dir / "speedup.png"),
        plot_acceptance_vs_budget(run, out_dir / "acceptance_vs_budget.png"),
        plot_latency_fit(run, out_dir / "latency_fit.png"),
        plot_stages(run, out_dir / "stages.png"),
        plot_reliability(run, out_dir / "reliability.png"),
    ]
    return [f for f in files if f is not None]
