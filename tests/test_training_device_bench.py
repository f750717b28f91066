"""The device training benchmark runs the recipe's own step on a tiny target on CPU, and the memory plan
it compares against reproduces the documented plan for an 8B target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from bastion.testing.scripts import load_benchmark


def _load():  # type: ignore[no-untyped-def]
    return load_benchmark("train_device")


def test_tiny_device_training_bench_on_cpu_times_the_recipe_steps_and_reports_what_it_promises(tmp_path: Path) -> None:
    bench = _load()
    assert bench.main(["--tiny", "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["tokens"] == r["timed_steps"] * r["seqs_per_step"] * r["seq_len"] == 2 * 2 * 64
    assert r["tokens_per_s"] > 0 and math.isclose(r["tokens_per_s"], r["tokens"] / r["seconds"], rel_tol=0.01)
    assert len(r["losses"]) == r["warmup_steps"] + r["timed_steps"] and all(math.isfinite(x) for x in r["losses"])
    assert r["max_memory_allocated_gb"] is None  # CPU: no CUDA allocator figure
    from bastion.testing.tiny import tiny_config

    cfg = tiny_config("qwen3")
    assert r["target_parameters"] == sum(p.numel() for p in bench.build_target(True, torch.device("cpu"), torch.float32).parameters())
    assert r["drafter"]["target_layers"] == cfg.num_hidden_layers  # the recipe's default: every target layer


def test_random_sequences_never_hold_the_mask_token_and_mark_their_second_half_as_continuation() -> None:
    bench = _load()
    seqs = bench.random_sequences(6, 40, vocab=12, mask_token_id=5)
    assert all(len(s.ids) == 40 and s.prompt_len == 20 and not (s.ids == 5).any() and int(s.ids.max()) < 12 for s in seqs)


def test_memory_plan_reproduces_the_documented_rows_for_an_8b_target() -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel
    from bastion.training.memory import memory_plan, parameter_count

    cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        drafter = DFlashDraftModel(DFlashConfig.for_target(cfg, num_layers=5, block_size=16, mask_token_id=0))
    plan = memory_plan(cfg, parameter_count(target), parameter_count(drafter), seq_len=2048, anchors=32, block_size=16)
    gb = plan.gigabytes()
    # docs/train-your-own.md, "the memory plan": 16.4 GB, 16.8 GB, 0.6 GB; the logits are part of "about 2 GB"
    assert (round(gb["target_weights"], 1), round(gb["drafter_states"], 1), round(gb["target_forward"], 1)) == (16.4, 16.8, 0.6)
    assert 0.5 < gb["logits"] < 2.0
    assert gb["total"] == round(plan.total / 1e9, 2)
    assert memory_plan(cfg, 1, 1, seq_len=2048, anchors=32, block_size=16, online=False).target_forward == 0
