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
    "log2_axis",
    "plot_speedup",
    "plot_acceptance_vs_budget",
    "plot_latency_fit",
    "plot_stages",
    "plot_reliability",
    "reliability_points",
]


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        from bastion.contract.errors import InvalidInputError

        raise InvalidInputError(
            "the bench's PNG plots need matplotlib, which is not installed: pip install 'bastion[plot]' "
            "(or pass --no-plots)"
        ) from None

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


#: colours and markers of the methods drawn as single points (none is the sweep line's colour)
_POINT_STYLES: tuple[tuple[str, str], ...] = (
    ("tab:red", "*"), ("tab:green", "D"), ("tab:purple", "s"), ("tab:brown", "^"), ("tab:pink", "v"),
    ("tab:olive", "P"), ("tab:cyan", "X"), ("tab:gray", "h"),
)
_SWEEP_COLOUR = "tab:blue"


def log2_axis(ax: Any, ticks: Sequence[float] | None = None) -> None:
    """A base-2 log x axis labelled with plain numbers (1, 2, 4, ...), at ``ticks`` when given."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    if ticks is not None:
        ax.xaxis.set_major_locator(FixedLocator([float(t) for t in ticks]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())


def _figure_legend(fig: Any, axes: Sequence[Any]) -> Any:
    """One legend for the whole figure, below every panel (never over the data); None without entries."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    if not seen:
        return None
    return fig.legend(list(seen.values()), list(seen), loc="lower center", ncol=min(4, len(seen)), fontsize=8, frameon=False)


def plot_acceptance_vs_budget(run: BenchRun, path: Path) -> Path:
    """Per dataset, one panel each (one y axis per panel): acceptance length and speedup over ar against
    the budget N, the fixed-budget sweep of the adaptive method's tree builder as a line, every other
    method as a point at its mean budget (the adaptive method a star), and the histogram of the budgets
    the adaptive method chose. One legend below all panels."""
    from bastion.bench.metrics import method_roles

    plt = _plt()
    datasets = _datasets(run)
    names = [s.name for s in run.specs if not s.is_ar]
    roles = method_roles(names)
    swept = {m for _, m in roles.sweep}
    points = ([roles.adaptive] if roles.adaptive is not None else []) + [m for m in names if m not in swept and m != roles.adaptive]
    style = dict(zip(points, _POINT_STYLES * (1 + len(points) // len(_POINT_STYLES))))
    rows = 3 if roles.adaptive is not None else 2
    fig, axes = plt.subplots(rows, len(datasets), figsize=(4.2 * len(datasets), 2.6 * rows + 1.0), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 3, 1.4][:rows]}, sharex="col")
    panels = [("acceptance_length", "acceptance length (tokens/step)"), ("speedup", "speedup over ar")]
    for k, ds in enumerate(datasets):
        by = {s.method: s for s in run.stats if s.dataset == ds}
        sweep = [(b, by[m]) for b, m in roles.sweep if m in by]
        budgets = [b for b, _ in sweep] + [by[m].mean_budget for m in points if m in by]
        if roles.adaptive in by:
            budgets += list(by[roles.adaptive].budget_hist)
        for row, (attr, label) in enumerate(panels):
            ax = axes[row][k]
            if row == 1:
                ax.axhline(1.0, color="gray", lw=0.8, ls="--", label="ar")
            if sweep:
                ax.plot([b for b, _ in sweep], [getattr(s, attr) or 0.0 for _, s in sweep], "o-", color=_SWEEP_COLOUR,
                        label=f"{sweep[0][1].method.rpartition('@')[0]}@N (fixed budget N)")
            for m in points:
                if m in by:
                    colour, marker = style[m]
                    ax.plot([by[m].mean_budget], [getattr(by[m], attr) or 0.0], marker, ls="none", ms=13 if marker == "*" else 8,
                            color=colour, mec="black", label=f"{m} (at its mean N)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][k].set_title(ds)
        ours = by.get(roles.adaptive) if roles.adaptive is not None else None
        if ours is not None:
            hax = axes[2][k]
            ns = sorted(ours.budget_hist)
            # bars of equal width on the log axis: from n / 1.15 to n * 1.15
            hax.bar([n / 1.15 for n in ns], [ours.budget_hist[n] / max(1, ours.steps) for n in ns],
                    width=[n * 1.15 - n / 1.15 for n in ns], align="edge", color="gray")
            hax.set_ylabel(f"{roles.adaptive}\nshare of steps")
        bottom = axes[rows - 1][k]
        bottom.set_xlabel("budget N (nodes verified)")
        log2_axis(bottom, sorted({2 ** e for b in budgets if b > 0 for e in range(0, int(b).bit_length() + 1)}) or None)
    legend = _figure_legend(fig, [ax for row in axes for ax in row])
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(points) > 3) if legend is not None else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency_fit(run: BenchRun, path: Path) -> Path | None:
    """Measured verify times of every tree method against the budget N (colour: context length), and
    the adaptive pipeline's latency model at each measured step's own N and context: the model's
    prediction is compared point for point, never drawn as a line through N at one context (its residual
    correction is constant within (N, context) bins, so such a line jumps where no step was measured)."""
    if run.latency is None or not run.latency.points or run.latency_model is None:
        return None
    plt = _plt()
    pts = run.latency.points
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    sc = ax.scatter([n for n, _, _ in pts], [1e3 * s for _, _, s in pts], c=[c for _, c, _ in pts], s=10, cmap="viridis",
                    alpha=0.6, label="measured")
    fig.colorbar(sc, ax=ax, label="context length")
    ax.scatter([n for n, _, _ in pts], [1e3 * p for p in run.latency.predicted], s=14, marker="x", color="tab:red",
               linewidths=0.8, label="model at the step's N and context")
    lo, hi, clipped = latency_axis_range([1e3 * s for _, _, s in pts])
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    from matplotlib.ticker import LogFormatter

    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))  # plain milliseconds, not 6 x 10^0
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    if clipped:
        ax.plot([], [], " ", label=f"{clipped} outlier(s) above the axis not shown")
    err = run.latency.mean_abs_rel_error
    ax.set_title("Verify latency: measured vs model" + ("" if err is None else f" (mean |rel err| {100 * err:.0f}%)"))
    ax.set_xlabel("tree tokens verified (N)")
    ax.set_ylabel("verify time (ms)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.16), ncol=2, frameon=False)
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
