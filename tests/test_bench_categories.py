"""Spec-Bench: prompts keep their category, a limit counts per category, and the report has Spec-Bench's
per-task and per-category speedup and mean accepted tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.bench.categories import category_stats, category_table, spec_bench_task
from bastion.bench.datasets import load_dataset
from bastion.bench.reporting import markdown_report, to_json
from bastion.bench.runner import BenchConfig, run_bench

CATEGORIES = ("writing", "coding", "translation", "rag")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "spec_bench").mkdir()
    rows = [
        {"question_id": 10 * k + i, "category": cat, "turns": [f"{cat} question {i}", "a second turn"]}
        for k, cat in enumerate(CATEGORIES)
        for i in range(3)
    ]
    (root / "spec_bench" / "question.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def run(data_dir: Path):
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("qwen3", seed=0)
    cfg = BenchConfig(datasets=("spec_bench",), methods=("ar", "chain", "bastion"), limit=2, max_new_tokens=8, max_nodes=8,
                      warmup_tokens=0, repeats=1, data_dir=str(data_dir))
    return run_bench(cfg, HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=1.0, seed=0), progress=False)


def test_a_limit_counts_spec_bench_prompts_per_category_in_file_order(data_dir: Path) -> None:
    prompts = load_dataset("spec_bench", limit=2, data_dir=data_dir)
    assert [p.category for p in prompts] == [c for c in CATEGORIES for _ in range(2)]
    assert [p.text for p in prompts[:2]] == ["writing question 0", "writing question 1"]  # first turns
    assert len(load_dataset("spec_bench", data_dir=data_dir)) == 12


def test_spec_bench_pools_the_mt_bench_categories_into_one_task() -> None:
    assert spec_bench_task("translation") == "translation" and spec_bench_task("rag") == "rag"
    assert spec_bench_task("writing") == spec_bench_task("coding") == "multi-turn conversation"


def _tps(runs) -> float:
    return sum(len(r.tokens) for r in runs) / sum(r.result.wall_s for r in runs)


def test_category_figures_are_each_categorys_speedup_over_ar_and_mean_accepted_tokens(run) -> None:
    category = {p.id: p.category for p in run.prompts}
    by = {(s.dataset, s.method): s for s in category_stats(run)}
    assert {d for d, _ in by} == {*CATEGORIES, "all"}
    for cat in CATEGORIES:
        mine = {m: [r for r in run.runs if r.method == m and category[r.prompt_id] == cat] for m in ("ar", "chain", "bastion")}
        for m in ("chain", "bastion"):
            s = by[(cat, m)]
            assert s.prompts == 2
            assert s.speedup == pytest.approx(_tps(mine[m]) / _tps(mine["ar"]))
            steps = [st for r in mine[m] for st in r.result.steps]
            assert s.acceptance_length == pytest.approx(sum(st.accepted + 1 for st in steps) / len(steps))
    tasks = {s.dataset for s in category_stats(run, tasks=True)}
    assert tasks == {"multi-turn conversation", "translation", "rag", "all"}
    assert by[("writing", "bastion")].new_tokens + by[("coding", "bastion")].new_tokens == next(
        s.new_tokens for s in category_stats(run, tasks=True) if s.dataset == "multi-turn conversation" and s.method == "bastion"
    )


def test_report_has_the_per_task_and_per_category_tables(run) -> None:
    text = markdown_report(run)
    table = category_table(category_stats(run))
    assert table in text and category_table(category_stats(run, tasks=True), label="task") in text
    lines = table.splitlines()
    assert lines[0] == "| category | prompts | chain | bastion |"
    assert [line.split("|")[1].strip() for line in lines[2:]] == [*CATEGORIES, "all"]
    writing = {(s.dataset, s.method): s for s in category_stats(run)}[("writing", "chain")]
    assert lines[2].split("|")[3].strip() == f"{writing.speedup:.2f}x / {writing.acceptance_length:.2f}"
    data = to_json(run)["categories"]["spec_bench"]
    assert {row["dataset"] for row in data["categories"]} == {*CATEGORIES, "all"}

