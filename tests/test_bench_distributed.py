"""``bastion bench`` under torchrun: each rank measures a disjoint share of the prompts, rank 0 pools them
into one report that equals a one-process run's (greedy tokens, prompt order) and says it was pooled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.bench import runner as bench_runner
from bastion.bench.reporting import markdown_report
from bastion.bench.runner import BenchConfig, run_bench
from bastion.distributed import DistContext


@pytest.fixture(scope="module")
def pair():
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    model = tiny_model("qwen3", seed=0)
    return HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=1.0, seed=0)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> BenchConfig:
    root = tmp_path_factory.mktemp("data")
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 0"}) + "\n" for q in ("2+2?", "3*3?", "5-1?", "7+7?", "9/3?")),
        encoding="utf-8",
    )
    return BenchConfig(datasets=("gsm8k",), methods=("ar", "bastion"), limit=5, max_new_tokens=6, repeats=1, warmup_tokens=0, data_dir=str(root))


def _view(runs) -> list[tuple]:
    return [(r.method, r.dataset, r.prompt_id, r.tokens) for r in runs]


def test_two_ranks_measure_disjoint_shares_and_rank_zero_pools_them_like_one_process(
    pair, config: BenchConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    target, drafter = pair
    single = run_bench(config, target, drafter, None, progress=False)
    shares: dict[int, tuple] = {}

    def gather(obj, ctx):  # what torch.distributed.gather_object hands rank 0
        shares[ctx.rank] = obj
        return [shares[0], shares[1]] if ctx.is_main else None

    monkeypatch.setattr(bench_runner, "gather_objects", gather)
    assert run_bench(config, target, drafter, None, progress=False, ctx=DistContext(rank=1, world_size=2, backend="gloo")) is None
    pooled = run_bench(config, target, drafter, None, progress=False, ctx=DistContext(rank=0, world_size=2, backend="gloo"))
    ids = [{r.prompt_id for r in shares[k][0]} for k in (0, 1)]
    assert ids[0] and ids[1] and not ids[0] & ids[1]
    assert ids[0] | ids[1] == {p.id for p in single.prompts}
    assert _view(pooled.runs) == _view(single.runs)
    assert [s.method for s in pooled.stats] == [s.method for s in single.stats]
    assert pooled.meta["ranks"] == 2 and "Pooled over 2 ranks" in markdown_report(pooled)
    assert "Pooled over" not in markdown_report(single)
