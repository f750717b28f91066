"""Batched ``ar`` baseline and ``bastion bench --batch-sizes`` end to end on a tiny random target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.bench.batch_sizes import run_batch_sweep, write_batch_report
from bastion.bench.methods import ARDecoder
from bastion.bench.runner import BenchConfig
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1)


def test_batched_ar_is_one_forward_per_step_and_equals_greedy_decoding(model):
    target = HFTarget(model)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in (1, 12, 5, 30)]
    calls = []
    handle = model.register_forward_pre_hook(lambda _m, args, kwargs: calls.append(kwargs["input_ids"].shape), with_kwargs=True)
    try:
        results = ARDecoder(target).generate_batch(prompts, max_new_tokens=9)
    finally:
        handle.remove()
    for p, r in zip(prompts, results):
        ref = greedy_reference(model, p[None], 9)
        cut = ref.index(2) + 1 if 2 in ref else len(ref)  # the model's EOS ends a row early
        assert r.tokens == ref[:cut]
    assert calls[0][0] == 4  # one prefill for the whole batch
    assert all(shape[1] == 1 for shape in calls[1:])  # then one single-token forward per step for all active rows
    assert len(calls) == 1 + max(len(r.tokens) for r in results) - 1
    seeded = ARDecoder(target).generate_batch(prompts, max_new_tokens=6, temperature=1.0, seed=3)
    again = ARDecoder(target).generate_batch(prompts, max_new_tokens=6, temperature=1.0, seed=3)
    assert [r.tokens for r in seeded] == [r.tokens for r in again]


def test_batch_size_sweep_runs_every_method_and_writes_the_report(model, tmp_path: Path):
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 0"}) + "\n" for q in ("2+2?", "3*3?", "why?", "7-1?", "hi")),
        encoding="utf-8",
    )
    config = BenchConfig(
        datasets=("gsm8k",), methods=("ar", "chain", "best-first@4", "bastion"), limit=5, max_new_tokens=8,
        warmup_tokens=2, repeats=1, data_dir=str(data),
    )
    target = HFTarget(model)
    sweep = run_batch_sweep(config, (1, 2, 4), target, NoisyOracleDrafter(model, block_size=4, noise=0.5), progress=False)
    assert len(sweep.points) == 3 * 4
    for p in sweep.points:
        assert p.tokens > 0 and p.tokens_per_s > 0
        assert p.equal_to_ar is True  # greedy: every method emits batched ar's tokens
        ar = sweep.point(p.batch_size, "ar")
        assert p.speedup == pytest.approx(p.tokens_per_s / ar.tokens_per_s)
        assert 0 < p.cpu_seconds <= p.seconds * 1.05  # the decoding thread's CPU time within the wall time
        assert p.cpu_speedup == pytest.approx((p.tokens / p.cpu_seconds) / (ar.tokens / ar.cpu_seconds))
    assert sweep.point(4, "ar").mean_width == 1.0
    files = write_batch_report(sweep, tmp_path / "out")
    names = {f.name for f in files}
    assert {"batch_sizes.json", "batch_sizes.md", "throughput_vs_batch.png", "width_vs_batch.png"} <= names
    report = (tmp_path / "out" / "batch_sizes.md").read_text()
    assert "bastion / batched ar" in report and "bastion / best (CPU time)" in report


def test_generate_with_several_prompts_decodes_them_as_one_batch(capsys):
    from bastion.cli.main import main

    args = ["generate", "--prompt", "What is 2+2?", "--prompt", "Name a color.", "--prompt", "Hi", "--max-new-tokens", "8"]
    assert main([*args, "--compare-ar"]) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert all(f"--- prompt {i} ---" in out for i in range(1, 4))  # the texts on stdout
    assert "batch=3" in err and err.count("output=identical to AR") == 3  # the statistics on stderr
    assert "tok/s" not in out
