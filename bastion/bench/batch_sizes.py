"""``bastion bench --batch-sizes``: every method at every batch size on the same prompts, in one run.

For each batch size B the prompts are cut into consecutive groups of B and every method decodes every
group with ``generate_batch`` (batched ``ar`` included: one target forward per step for all rows), in
balanced orders (:func:`bastion.bench.runner.balanced_orders`, one per group), after one unrecorded
batch per method at that size. A method's throughput
at B is its total new tokens over its total wall seconds; the speedup is over batched ``ar`` at the
same B. The same ratios are also reported over the decoding thread's CPU seconds (with one torch
thread that is all the compute, and other processes on a shared machine barely move it). With
``repeats > 1`` each (group, method) keeps its fastest run and its least CPU time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

from attrs import asdict, field, frozen

from bastion.bench.methods import ADAPTIVE, AR, build_decoder, parse_method
from bastion.bench.reporting import _f, _table
from bastion.bench.runner import BenchConfig, _progress, balanced_orders, drafter_dtype, load_prompts
from bastion.bench.templates import TemplateStyle, encode_prompt
from bastion.contract.errors import InvalidInputError
from bastion.contract.target import Target
from bastion.contract.types import GenerationResult

__all__ = ["BatchPoint", "BatchSweep", "run_batch_sweep", "batch_table", "write_batch_report"]


@frozen
class BatchPoint:
    """One method at one batch size."""

    batch_size: int
    method: str
    tokens: int  # new tokens over all prompts
    seconds: float  # wall seconds over all groups (prefill included)
    tokens_per_s: float
    speedup: float | None  # over batched ar at the same batch size
    #: CPU seconds of the decoding thread over all groups (with one torch thread, all the compute; far
    #: less disturbed than wall time by other processes on a shared machine)
    cpu_seconds: float = field(kw_only=True, default=0.0)
    cpu_speedup: float | None = field(kw_only=True, default=None)  # tokens per CPU second over batched ar's
    mean_width: float  # mean verified tree width per step (1 for ar)
    acceptance: float  # mean tokens committed per row step
    equal_to_ar: bool | None  # greedy: every row's tokens equal batched ar's


@frozen
class BatchSweep:
    config: BenchConfig
    batch_sizes: tuple[int, ...]
    methods: tuple[str, ...]
    points: tuple[BatchPoint, ...] = field(eq=False)
    meta: dict[str, Any] = field(eq=False)

    def point(self, batch_size: int, method: str) -> BatchPoint:
        return next(p for p in self.points if p.batch_size == batch_size and p.method == method)


def run_batch_sweep(
    config: BenchConfig,
    batch_sizes: Sequence[int],
    target: Target,
    drafter: Any,
    tokenizer: Any = None,
    *,
    progress: bool = True,
    registry: Any = None,
) -> BatchSweep:
    """Run every method of ``config`` at every batch size on the same prompts."""
    sizes = tuple(int(b) for b in batch_sizes)
    if not sizes or any(b < 1 for b in sizes):
        raise InvalidInputError(f"batch sizes must be integers >= 1, got {list(batch_sizes)}")
    specs = [parse_method(m, max_nodes=config.max_nodes, tree_options=config.tree_options) for m in config.methods]
    if not any(s.is_ar for s in specs):
        raise InvalidInputError("the methods must include 'ar': speedups are measured against batched ar")
    decoders = {s.name: build_decoder(s, target, drafter, tokenizer, registry) for s in specs}
    prompts = load_prompts(config)
    room = target.max_positions - config.max_new_tokens - 1
    if room < 1:
        raise InvalidInputError(f"max_new_tokens {config.max_new_tokens} leaves no room for a prompt")
    style: TemplateStyle = config.template  # type: ignore[assignment]
    encoded = [encode_prompt(p, tokenizer, target.vocab_size, style, max_tokens=room)[0] for p in prompts]
    names = [s.name for s in specs]
    kw = dict(max_new_tokens=config.max_new_tokens, temperature=config.temperature, seed=config.seed, top_p=config.top_p, top_k=config.top_k)
    t0 = time.perf_counter()
    groups_total = sum(-(-len(encoded) // b) for b in sizes)
    bar = _progress(groups_total * len(names) * config.repeats, progress)
    points: list[BatchPoint] = []
    orders = balanced_orders(len(names))
    try:
        for b in sizes:
            if config.warmup_tokens > 0:  # one unrecorded batch per method at this size: first-call costs stay out
                for dec in decoders.values():
                    dec.generate_batch(encoded[:b], **{**kw, "max_new_tokens": config.warmup_tokens})
            groups = [encoded[i : i + b] for i in range(0, len(encoded), b)]
            runs: dict[str, list[_Run]] = {n: [] for n in names}
            for g, group in enumerate(groups):
                order = [names[j] for j in orders[g % len(orders)]]
                best: dict[str, _Run] = {}
                for _ in range(config.repeats):
                    for name in order:
                        bar.set_postfix_str(f"B={b} {name}", refresh=False)
                        cpu, start = time.thread_time(), time.perf_counter()
                        out = decoders[name].generate_batch(group, **kw)
                        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
                        kept = best.get(name)
                        if kept is None or wall < kept[0]:
                            best[name] = (wall, min(cpu, kept[1]) if kept else cpu, out)
                        else:
                            best[name] = (kept[0], min(cpu, kept[1]), kept[2])
                        bar.update(1)
                for name in names:
                    runs[name].append(best[name])
            points.extend(_points(b, names, runs, greedy=config.temperature == 0.0))
    finally:
        bar.close()
    meta = {"device": str(target.device), "dtype": str(target.dtype).replace("torch.", ""), "drafter_dtype": drafter_dtype(drafter),
            "prompts": len(prompts),
            "total_s": time.perf_counter() - t0, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    return BatchSweep(config=config, batch_sizes=sizes, methods=tuple(names), points=tuple(points), meta=meta)


#: one (group, method): its fastest wall seconds, its least CPU seconds (over the repeats), its results
_Run = tuple[float, float, list[GenerationResult]]


def _points(b: int, names: list[str], runs: dict[str, list[_Run]], greedy: bool) -> list[BatchPoint]:
    ref = [r.tokens for _, _, out in runs[AR] for r in out]
    ar_rate = ar_cpu_rate = None
    out: list[BatchPoint] = []
    for name in [AR] + [n for n in names if n != AR]:
        results = [r for _, _, group in runs[name] for r in group]
        seconds = sum(w for w, _, _ in runs[name])
        cpu = sum(c for _, c, _ in runs[name])
        tokens = sum(len(r.tokens) for r in results)
        steps = [s for r in results for s in r.steps]
        rate = tokens / seconds if seconds > 0 else 0.0
        cpu_rate = tokens / cpu if cpu > 0 else 0.0
        if name == AR:
            ar_rate, ar_cpu_rate = rate, cpu_rate
        out.append(
            BatchPoint(
                batch_size=b,
                method=name,
                tokens=tokens,
                seconds=seconds,
                tokens_per_s=rate,
                speedup=rate / ar_rate if ar_rate else None,
                cpu_seconds=cpu,
                cpu_speedup=cpu_rate / ar_cpu_rate if ar_cpu_rate else None,
                mean_width=sum((s.width or s.budget) for s in steps) / len(steps) if steps else 0.0,
                acceptance=sum(s.accepted + 1 for s in steps) / len(steps) if steps else 0.0,
                equal_to_ar=([r.tokens for r in results] == ref) if greedy else None,
            )
        )
    order = {n: k for k, n in enumerate(names)}
    return sorted(out, key=lambda p: order[p.method])


def batch_table(sweep: BatchSweep) -> str:
    """Markdown: one row per batch size x method, and which fixed setting bastion is up against."""
    header = ["batch", "method", "tok/s", "speedup vs batched ar", "CPU-time speedup", "mean W", "accept len", "= ar"]
    rows = []
    for p in sweep.points:
        eq = "ref" if p.method == AR else ("-" if p.equal_to_ar is None else ("yes" if p.equal_to_ar else "NO"))
        rows.append([
            str(p.batch_size), p.method, _f(p.tokens_per_s, "{:.1f}"), _f(p.speedup), _f(p.cpu_speedup),
            _f(p.mean_width, "{:.1f}"), _f(p.acceptance), eq,
        ])
    return _table(header, rows)


def best_table(sweep: BatchSweep) -> str:
    """Markdown: per batch size, the best fixed method and bastion's ratio to it and to batched ar, in
    wall time and in CPU time (each with its own best fixed method)."""
    rows = []
    for b in sweep.batch_sizes:
        fixed = [sweep.point(b, m) for m in sweep.methods if m != ADAPTIVE]
        best = max(fixed, key=lambda p: p.tokens_per_s)
        best_cpu = max(fixed, key=lambda p: p.cpu_speedup or 0.0)
        ar = sweep.point(b, AR)
        mine = sweep.point(b, ADAPTIVE) if ADAPTIVE in sweep.methods else None
        rows.append([
            str(b),
            best.method,
            _f(best.tokens_per_s, "{:.1f}"),
            "-" if mine is None else _f(mine.tokens_per_s / best.tokens_per_s),
            "-" if mine is None else _f(mine.tokens_per_s / ar.tokens_per_s),
            best_cpu.method,
            "-" if mine is None or not best_cpu.cpu_speedup else _f((mine.cpu_speedup or 0.0) / best_cpu.cpu_speedup),
            "-" if mine is None else _f(mine.cpu_speedup),
            "-" if mine is None else _f(mine.mean_width, "{:.1f}"),
        ])
    header = [
        "batch", "best fixed method", "its tok/s", "bastion / best", "bastion / batched ar",
        "best fixed (CPU time)", "bastion / best (CPU time)", "bastion / batched ar (CPU time)", "bastion mean W",
    ]
    return _table(header, rows)


def write_batch_report(sweep: BatchSweep, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """``batch_sizes.json``, ``batch_sizes.md`` and (with ``plots``) two PNG plots."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "batch_sizes.json", out / "batch_sizes.md"]
    data = {"batch_sizes": list(sweep.batch_sizes), "methods": list(sweep.methods), "meta": sweep.meta,
            "config": asdict(sweep.config), "points": [asdict(p) for p in sweep.points]}
    files[0].write_text(json.dumps(data, indent=2, default=str))
    files[1].write_text(batch_table(sweep) + "\n\n" + best_table(sweep) + "\n")
    if plots:
        files += _plots(sweep, out)
    return files


def _plots(sweep: BatchSweep, out: Path) -> list[Path]:
    from bastion.bench.plots import _plt, log2_axis

    plt = _plt()
    sizes = list(sweep.batch_sizes)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in sweep.methods:
        ys = [sweep.point(b, m).tokens_per_s for b in sizes]
        ax.plot(sizes, ys, marker="o", label=m, linewidth=2.5 if m == ADAPTIVE else 1.2)
    log2_axis(ax, sizes)  # plain batch sizes: 1, 2, 4, ...
    ax.set_xlabel("batch size")
    ax.set_ylabel("total tokens / s")
    ax.set_title("Throughput against batch size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p1 = out / "throughput_vs_batch.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    files = [p1]
    if ADAPTIVE in sweep.methods:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(sizes, [sweep.point(b, ADAPTIVE).mean_width for b in sizes], marker="o")
        log2_axis(ax, sizes)  # plain batch sizes: 1, 2, 4, ...
        ax.set_xlabel("batch size")
        ax.set_ylabel("bastion's mean width W")
        ax.set_title("Chosen tree width against batch size")
        fig.tight_layout()
        p2 = out / "width_vs_batch.png"
        fig.savefig(p2, dpi=120)
        plt.close(fig)
        files.append(p2)
    return files
