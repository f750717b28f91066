"""Per-category figures of a benchmark run, as Spec-Bench reports them.

Spec-Bench's 480 questions fall into 13 categories: its own translation, summarization, qa,
math_reasoning and rag (80 each), and the 80 MT-bench questions in 8 categories of 10, which Spec-Bench
pools as one task, multi-turn conversation. Spec-Bench reports each method's speedup over autoregressive
decoding and its mean accepted tokens per step (the bonus token included) per task; this module gives
the same figures per task and per category, measured on the run's own prompts of each.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import attrs

from bastion.bench.methods import AR
from bastion.bench.metrics import ALL_DATASETS, MethodStats, aggregate
from bastion.bench.runner import BenchRun

__all__ = ["CATEGORY_DATASETS", "SPEC_BENCH_TASKS", "spec_bench_task", "category_stats", "category_table"]

#: datasets whose report gets per-category tables
CATEGORY_DATASETS: tuple[str, ...] = ("spec_bench",)

#: Spec-Bench's own tasks (a category outside this map is one of MT-bench's, pooled as one task)
SPEC_BENCH_TASKS: Mapping[str, str] = {
    "translation": "translation",
    "summarization": "summarization",
    "qa": "qa",
    "math_reasoning": "math_reasoning",
    "rag": "rag",
}

#: the task Spec-Bench pools the MT-bench categories into
MULTI_TURN = "multi-turn conversation"


def spec_bench_task(category: str) -> str:
    """The Spec-Bench task a category belongs to."""
    return SPEC_BENCH_TASKS.get(category, MULTI_TURN)


def category_stats(run: BenchRun, dataset: str = "spec_bench", *, tasks: bool = False) -> list[MethodStats]:
    """Per (method, category) statistics of ``dataset``'s prompts in ``run``, with pooled ``"all"`` rows
    when there are several categories; ``tasks`` groups the categories into Spec-Bench's tasks. Each
    speedup is against ``ar`` on the same prompts; empty when no prompt of ``dataset`` has a category."""
    group = {
        (p.dataset, p.id): (spec_bench_task(p.category) if tasks else p.category)
        for p in run.prompts
        if p.dataset == dataset and p.category is not None
    }
    runs = [attrs.evolve(r, dataset=group[(r.dataset, r.prompt_id)]) for r in run.runs if (r.dataset, r.prompt_id) in group]
    return aggregate(runs, reference=AR, check_equal=run.config.temperature == 0.0)


def _cell(s: MethodStats | None) -> str:
    if s is None:
        return "-"
    speed = "-" if s.speedup is None else f"{s.speedup:.2f}x"
    return f"{speed} / {s.acceptance_length:.2f}"


def category_table(stats: Sequence[MethodStats], label: str = "category") -> str:
    """A markdown table: one row per category (``"all"`` last), one column per method other than ``ar``,
    each cell ``speedup / mean accepted tokens per step``; empty for no statistics."""
    if not stats:
        return ""
    methods = [m for m in dict.fromkeys(s.method for s in stats) if m != AR]
    groups = list(dict.fromkeys(s.dataset for s in stats))
    groups = [g for g in groups if g != ALL_DATASETS] + [g for g in groups if g == ALL_DATASETS]
    by = {(s.dataset, s.method): s for s in stats}
    lines = [
        "| " + " | ".join([label, "prompts", *methods]) + " |",
        "|" + "|".join("---" for _ in range(len(methods) + 2)) + "|",
    ]
    for g in groups:
        ref = by.get((g, AR))
        prompts = ref.prompts if ref is not None else max(s.prompts for s in stats if s.dataset == g)
        lines.append("| " + " | ".join([g, str(prompts), *(_cell(by.get((g, m))) for m in methods)]) + " |")
    return "\n".join(lines)
