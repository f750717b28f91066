"""Benchmark output: markdown tables (stdout and ``results.md``), ``results.json`` and CSV files."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import attrs

from bastion.bench.methods import ADAPTIVE, AR
from bastion.bench.metrics import (
    ALL_DATASETS,
    MATCH_TOLERANCE,
    STAGES,
    TARGET_ACCEPT_VS_CHAIN,
    TARGET_SPEEDUP_VS_CHAIN,
    DatasetSummary,
    MethodStats,
    cost_gap,
    stage_seconds,
)
from bastion.bench.runner import BenchRun

__all__ = [
    "markdown_report",
    "methods_table",
    "stages_table",
    "summary_table",
    "budget_table",
    "targets_table",
    "reliability_table",
    "temperatures_table",
    "write_temperatures_report",
    "to_json",
    "write_json",
    "write_csv",
    "write_report",
]


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _yes_no(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "no")


def methods_table(stats: Sequence[MethodStats]) -> str:
    """One row per dataset x method: acceptance, throughput, speedup, budget, equality, A_hat correlation."""
    header = ["dataset", "method", "accept len", "tok/s", "speedup", "mean N", "drafted", "= ar", "A_hat corr", "prompts", "tokens"]
    rows = []
    for s in stats:
        eq = "ref" if s.method == AR else ("-" if s.equal_to_ref is None else f"{s.equal_to_ref}/{s.prompts}")
        rows.append(
            [
                s.dataset,
                s.method,
                _f(s.acceptance_length),
                _f(s.tokens_per_s, "{:.1f}"),
                _f(s.speedup, "{:.2f}x"),
                _f(s.mean_budget, "{:.1f}"),
                f"{100 * s.drafted_share:.0f}%",
                eq,
                _f(s.accept_corr),
                str(s.prompts),
                str(s.new_tokens),
            ]
        )
    return _table(header, rows)


def stages_table(stats: Sequence[MethodStats], dataset: str | None = None) -> str:
    """Per-stage share of wall time (percent) per method, pooled over ``dataset`` (default: all)."""
    ds = dataset or (ALL_DATASETS if any(s.dataset == ALL_DATASETS for s in stats) else stats[0].dataset)
    header = ["method", *STAGES, "ms/step"]
    rows = []
    for s in stats:
        if s.dataset != ds:
            continue
        frac = s.stage_frac
        per_step = (sum(s.stage_s.values()) - s.stage_s["prefill"]) / s.steps * 1e3 if s.steps else None
        rows.append([s.method, *(f"{100 * frac[k]:.1f}" for k in STAGES), _f(per_step)])
    return _table(header, rows)


def _part_names(summary: Sequence[DatasetSummary]) -> tuple[str, str, str]:
    """The methods playing the adaptive, chain and static parts (their default names where none did)."""

    def first(attr: str, default: str) -> str:
        return next((getattr(d, attr) for d in summary if getattr(d, attr) is not None), default)

    return first("adaptive_method", ADAPTIVE), first("chain_method", "chain"), first("static_method", "static")


def summary_table(summary: Sequence[DatasetSummary]) -> str:
    """The comparison the method is judged by: baselines, best fixed budget and bastion, per dataset;
    the columns name the methods that played each part (``chain@fixed`` for the chain, ``static@bastion``
    for the adaptive controller, ...)."""
    ours, chain, static = _part_names(summary)
    header = [
        "dataset",
        chain,
        static,
        "best fixed N",
        ours,
        f"accept len {chain} / {static} / best N / {ours}",
        f"{ours}/{chain} accept",
        f"{ours}/{chain} speed",
        f"{ours}/best",
        f"beat {chain}",
        f"matched best (>= {100 * (1 - MATCH_TOLERANCE):.0f}%)",
    ]
    rows = []
    for d in summary:
        best = "-" if d.best_fixed_budget is None else f"{_f(d.best_fixed_speedup, '{:.2f}x')} (N={d.best_fixed_budget})"
        rows.append(
            [
                d.dataset,
                _f(d.chain_speedup, "{:.2f}x"),
                _f(d.static_speedup, "{:.2f}x"),
                best,
                _f(d.bastion_speedup, "{:.2f}x"),
                " / ".join(_f(x) for x in (d.chain_accept, d.static_accept, d.best_fixed_accept, d.bastion_accept)),
                _f(d.accept_vs_chain),
                _f(d.speedup_vs_chain),
                _f(d.speedup_vs_best),
                _yes_no(d.beat_chain),
                _yes_no(d.matched_best),
            ]
        )
    return _table(header, rows)


def _gap_text(mine: MethodStats | None, other: MethodStats | None, top: int = 2) -> str:
    if mine is None or other is None:
        return "-"
    gaps = [(k, d) for k, d in cost_gap(mine, other) if d > 0][:top]
    if not gaps:
        return "none"
    return ", ".join(f"{k} +{1e3 * d:.2f}" for k, d in gaps)


def targets_table(stats: Sequence[MethodStats], summary: Sequence[DatasetSummary]) -> str:
    """Each dataset next to the gains the BASTION paper reports (acceptance and speedup vs chain; a
    speedup matching the best fixed budget): reference figures, not guarantees of this setup; with the
    stages where the adaptive method spends more time per token than the chain and than the best fixed
    budget (ms per generated token). The methods in each part are those of the summary."""
    ours, chain, _ = _part_names(summary)
    header = [
        "dataset",
        f"accept vs {chain} (paper: >= {TARGET_ACCEPT_VS_CHAIN:.2f})",
        f"speedup vs {chain} (paper: >= {TARGET_SPEEDUP_VS_CHAIN:.2f})",
        f"speedup vs best N (paper: matches, >= {1 - MATCH_TOLERANCE:.2f})",
        f"{ours} extra ms/token vs {chain}",
        f"{ours} extra ms/token vs best N",
    ]

    def mark(x: float | None, goal: float) -> str:
        return "-" if x is None else f"{x:.2f} {'at or above' if x >= goal else 'below'}"

    rows = []
    for d in summary:
        by = {s.method: s for s in stats if s.dataset == d.dataset}
        pick = lambda m: by.get(m) if m is not None else None  # noqa: E731
        rows.append(
            [
                d.dataset,
                mark(d.accept_vs_chain, TARGET_ACCEPT_VS_CHAIN),
                mark(d.speedup_vs_chain, TARGET_SPEEDUP_VS_CHAIN),
                mark(d.speedup_vs_best, 1 - MATCH_TOLERANCE),
                _gap_text(pick(d.adaptive_method), pick(d.chain_method)),
                _gap_text(pick(d.adaptive_method), pick(d.best_fixed_method)),
            ]
        )
    return _table(header, rows)


def budget_table(stats: Sequence[MethodStats], method: str = ADAPTIVE, buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256)) -> str:
    """Histogram of the budgets ``method`` chose, per dataset, in power-of-two buckets (N <= bucket)."""
    mine = [s for s in stats if s.method == method]
    if not mine:
        return ""
    top = max(max(s.budget_hist, default=1) for s in mine)
    edges = [b for b in buckets if b < top] + [max(top, 1)]
    labels = []
    lo = 1
    for e in edges:
        labels.append(f"{lo}" if lo == e else f"{lo}-{e}")
        lo = e + 1
    rows = []
    for s in mine:
        counts = [0] * len(edges)
        for n, c in s.budget_hist.items():
            k = next(i for i, e in enumerate(edges) if n <= e)
            counts[k] += c
        total = sum(counts) or 1
        rows.append([s.dataset, _f(s.mean_budget, "{:.1f}"), *(f"{100 * c / total:.0f}%" for c in counts)])
    return _table(["dataset", "mean N", *labels], rows)


def reliability_table(stats: Sequence[MethodStats]) -> str:
    """Predicted against realized tokens per step for every method that calibrates (pooled datasets):
    the raw surrogate A_hat, the calibrated A_cal the controller decided with, and what verification
    realized, over the steps that drafted."""
    pooled = ALL_DATASETS if any(s.dataset == ALL_DATASETS for s in stats) else (stats[0].dataset if stats else "")
    rows = [
        [s.method, _f(r[0]), _f(r[1]), _f(r[2]), f"{100 * s.drafted_share:.0f}%"]
        for s in stats
        if s.dataset == pooled and (r := s.reliability) is not None
    ]
    if not rows:
        return ""
    return _table(["method", "raw A_hat", "calibrated A_cal", "realized", "steps drafted"], rows)


def temperatures_table(runs: Sequence[BenchRun]) -> str:
    """Every method at every temperature side by side (all datasets pooled): speedup over ar of the same
    temperature, acceptance length and share of steps that drafted."""
    temps = [r.config.temperature for r in runs]
    methods = list(dict.fromkeys(s.name for r in runs for s in r.specs))
    header = ["method", *(f"T={t:g} {col}" for t in temps for col in ("speedup", "accept len", "drafted"))]
    rows = []
    for m in methods:
        row = [m]
        for r in runs:
            pooled = ALL_DATASETS if any(s.dataset == ALL_DATASETS for s in r.stats) else r.stats[0].dataset
            st = next((s for s in r.stats if s.method == m and s.dataset == pooled), None)
            row += ["-", "-", "-"] if st is None else [
                _f(st.speedup, "{:.2f}x"), _f(st.acceptance_length), f"{100 * st.drafted_share:.0f}%"
            ]
        rows.append(row)
    return _table(header, rows)


def _dtypes(meta: Mapping[str, Any]) -> str:
    """``float32``, or ``float32, drafter bfloat16`` when the drafter runs in another dtype."""
    drafter = meta.get("drafter_dtype")
    return meta["dtype"] if not drafter or drafter == meta["dtype"] else f"{meta['dtype']}, drafter {drafter}"


def markdown_report(run: BenchRun) -> str:
    cfg = run.config
    parts = [
        (
            f"## bastion bench: {len(run.prompts)} prompts x {len(run.specs)} methods, "
            f"max {cfg.max_new_tokens} new tokens, T = {cfg.temperature:g}, fastest of {cfg.repeats} per prompt, "
            f"device {run.meta['device']} ({_dtypes(run.meta)}, {run.meta['threads']} threads), {run.meta['total_s']:.0f} s"
        ),
        *(
            [
                "",
                f"Pooled over {run.meta['ranks']} ranks (torchrun): each rank measured its share of the prompts on "
                "its own device, every speedup against ar on that same device.",
            ]
            if run.meta.get("ranks", 1) > 1
            else []
        ),
        "",
        "### Speedup over ar (same run) and acceptance length",
        "",
        summary_table(run.summary),
        "",
        "### Compared with the paper's reported gains",
        "",
        "The BASTION paper reports these gains on GPUs with large targets; this run's ratios are shown next "
        "to them for reference, not as guarantees.",
        "",
        targets_table(run.stats, run.summary),
        "",
        "### Per method and dataset",
        "",
        methods_table(run.stats),
        "",
        "### Time split per stage (% of wall time, all prompts)",
        "",
        stages_table(run.stats),
    ]
    parts += _category_sections(run)
    rel = reliability_table(run.stats)
    if rel:
        parts += ["", "### Predicted against realized tokens per step (steps that drafted)", "", rel]
    families = list(dict.fromkeys(s.drafter for s in run.specs if s.drafter is not None))
    if families:
        from bastion.bench.families import families_table, family_summaries

        parts[2:2] = [
            "### Drafter families: acceptance length and speedup over ar (same run)",
            "",
            families_table(family_summaries(run.stats, families)),
            "",
        ]
    hist = budget_table(run.stats, method=_part_names(run.summary)[0])
    if hist:
        parts += ["", "### Budgets chosen by the adaptive controller (share of steps)", "", hist]
    if run.latency is not None and run.latency.mean_abs_rel_error is not None:
        parts += [
            "",
            (
                "Latency model (bastion's, as calibrated at the end of the run) against every measured verify "
                f"step: mean |relative error| {100 * run.latency.mean_abs_rel_error:.1f}% over "
                f"{len(run.latency.points)} steps."
            ),
        ]
    return "\n".join(parts) + "\n"


def _category_sections(run: BenchRun) -> list[str]:
    """Spec-Bench's figures for each dataset of :data:`~bastion.bench.categories.CATEGORY_DATASETS` in the
    run: speedup and mean accepted tokens per task and per category."""
    from bastion.bench.categories import CATEGORY_DATASETS, category_stats, category_table

    parts: list[str] = []
    for ds in dict.fromkeys(p.dataset for p in run.prompts):
        if ds not in CATEGORY_DATASETS or not category_stats(run, ds):
            continue
        parts += [
            "",
            f"### {ds}: speedup over ar / mean accepted tokens per step, per task and per category",
            "",
            category_table(category_stats(run, ds, tasks=True), label="task"),
            "",
            category_table(category_stats(run, ds), label="category"),
        ]
    return parts


def _jsonable(x: Any) -> Any:
    if attrs.has(type(x)):
        return _jsonable(x.as_dict() if hasattr(x, "as_dict") else attrs.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and math.isnan(x):  # NaN is not JSON
        return None
    return x


def to_json(run: BenchRun) -> dict[str, Any]:
    """A JSON-ready dict: config, machine, methods, per method x dataset stats, summary, per prompt rows,
    and the latency fit points."""
    prompts = []
    ref = {(r.dataset, r.prompt_id): r.tokens for r in run.runs if r.method == AR}
    for r in run.runs:
        res = r.result
        prompts.append(
            {
                "method": r.method,
                "dataset": r.dataset,
                "prompt_id": r.prompt_id,
                "prompt_len": res.prompt_len,
                "new_tokens": len(res.tokens),
                "steps": len(res.steps),
                "wall_s": res.wall_s,
                "prefill_s": res.prefill_s,
                "acceptance_length": res.acceptance_length,
                "mean_budget": res.mean_budget,
                "stop_reason": res.stop_reason,
                "equal_to_ar": None
                if r.method == AR or run.config.temperature > 0 or (r.dataset, r.prompt_id) not in ref
                else ref[(r.dataset, r.prompt_id)] == r.tokens,
                "budgets": [s.budget for s in res.steps],
                "accepted": [s.accepted for s in res.steps],
                "predicted_accept": [round(s.predicted_accept, 5) for s in res.steps],
                "calibrated_accept": [None if s.calibrated_accept is None else round(s.calibrated_accept, 5) for s in res.steps],
                "drafted": [s.drafted for s in res.steps],
                "stage_s": stage_seconds(res),
            }
        )
    lat = None
    if run.latency is not None:
        lat = {
            "mean_abs_rel_error": run.latency.mean_abs_rel_error,
            "points": [
                {"budget": n, "context_len": c, "measured_s": s, "predicted_s": p}
                for (n, c, s), p in zip(run.latency.points, run.latency.predicted)
            ],
        }
    return _jsonable(
        {
            "config": attrs.asdict(run.config),
            "meta": run.meta,
            "methods": [attrs.asdict(s) for s in run.specs],
            "stats": list(run.stats),
            "summary": list(run.summary),
            "categories": _category_json(run),
            "latency_fit": lat,
            "prompts": prompts,
        }
    )


def _category_json(run: BenchRun) -> dict[str, dict[str, list[MethodStats]]]:
    """``{dataset: {"tasks": stats, "categories": stats}}`` for the datasets with per-category tables."""
    from bastion.bench.categories import CATEGORY_DATASETS, category_stats

    return {
        ds: {"tasks": category_stats(run, ds, tasks=True), "categories": category_stats(run, ds)}
        for ds in dict.fromkeys(p.dataset for p in run.prompts)
        if ds in CATEGORY_DATASETS
    }


def write_json(run: BenchRun, path: Path) -> Path:
    path.write_text(json.dumps(to_json(run), indent=1) + "\n", encoding="utf-8")
    return path


def write_csv(run: BenchRun, out_dir: Path) -> list[Path]:
    """``stats.csv`` (one row per method x dataset, stage shares as columns), ``summary.csv`` and
    ``prompts.csv`` (one row per method x prompt)."""
    stats_path = out_dir / "stats.csv"
    with stats_path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(
            ["method", "dataset", "prompts", "new_tokens", "steps", "wall_s", "acceptance_length", "tokens_per_s",
             "speedup", "mean_budget", "equal_to_ar", "predicted_accept", "accept_corr",
             *(f"frac_{k}" for k in STAGES)]
        )
        for s in run.stats:
            frac = s.stage_frac
            w.writerow(
                [s.method, s.dataset, s.prompts, s.new_tokens, s.steps, f"{s.wall_s:.6f}", f"{s.acceptance_length:.4f}",
                 f"{s.tokens_per_s:.3f}", "" if s.speedup is None else f"{s.speedup:.4f}", f"{s.mean_budget:.3f}",
                 "" if s.equal_to_ref is None else s.equal_to_ref,
                 "" if s.predicted_accept is None else f"{s.predicted_accept:.4f}",
                 "" if s.accept_corr is None else f"{s.accept_corr:.4f}",
                 *(f"{frac[k]:.4f}" for k in STAGES)]
            )
    summary_path = out_dir / "summary.csv"
    with summary_path.open("w", newline="", encoding="utf-8") as fh:
        fields = [a.name for a in attrs.fields(DatasetSummary)]
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for d in run.summary:
            w.writerow({k: ("" if v is None else v) for k, v in d.as_dict().items()})
    prompts_path = out_dir / "prompts.csv"
    with prompts_path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["method", "dataset", "prompt_id", "prompt_len", "new_tokens", "steps", "wall_s", "acceptance_length",
                    "mean_budget", "stop_reason"])
        for r in run.runs:
            res = r.result
            w.writerow([r.method, r.dataset, r.prompt_id, res.prompt_len, len(res.tokens), len(res.steps),
                        f"{res.wall_s:.6f}", f"{res.acceptance_length:.4f}", f"{res.mean_budget:.3f}", res.stop_reason])
    return [stats_path, summary_path, prompts_path]


def write_report(run: BenchRun, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """Write ``results.md``, ``results.json``, the CSV files and (optionally) the PNG plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "results.md"
    md.write_text(markdown_report(run), encoding="utf-8")
    files = [md, write_json(run, out / "results.json"), *write_csv(run, out)]
    if plots:
        from bastion.bench.plots import write_plots

        files += write_plots(run, out)
    return files


def _temperature_dir(t: float) -> str:
    return f"T{t:g}"


def write_temperatures_report(runs: Sequence[BenchRun], out_dir: str | Path, plots: bool = True) -> tuple[str, list[Path]]:
    """One full report per temperature in ``out_dir/T<t>/`` and a ``results.md`` in ``out_dir`` with every
    method at every temperature side by side, followed by each temperature's report. Returns the
    combined markdown and the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    sections = []
    for r in runs:
        files += write_report(r, out / _temperature_dir(r.config.temperature), plots=plots)
        sections.append(markdown_report(r).replace("## bastion bench:", f"## T = {r.config.temperature:g}:", 1))
    first = runs[0]
    head = (
        f"# bastion bench at temperatures {', '.join(f'{r.config.temperature:g}' for r in runs)}: "
        f"{len(first.prompts)} prompts x {len(first.specs)} methods, max {first.config.max_new_tokens} new tokens, "
        f"fastest of {first.config.repeats} per prompt\n\n"
        "Speedup over ar at the same temperature, acceptance length and share of steps that drafted, all "
        "datasets pooled.\n\n"
    )
    md = head + temperatures_table(runs) + "\n\n" + "\n".join(sections)
    path = out / "results.md"
    path.write_text(md, encoding="utf-8")
    return md, [path, *files]
