"""``bastion train ar-drafter``: distils a target into a small causal LM, resumes, and the result drafts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.testing.tiny import save_tiny_target
from bastion.training.ar_drafter import ARDrafterConfig, _batch, build_ar_drafter, train_ar_drafter
from bastion.training.distill import DistillSequence, load_continuations
from bastion.training.loop import save_checkpoint


def _sequences(n: int = 6) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    return [{"source": "math", "ids": torch.randint(3, 256, (20,), generator=gen).tolist(), "prompt_len": 8} for _ in range(n)]


def test_the_drafter_starts_as_a_truncated_copy_of_the_target():
    from bastion.testing.tiny import tiny_model

    target = tiny_model("qwen3", seed=0)
    drafter = build_ar_drafter(target, ARDrafterConfig(num_layers=1))
    assert drafter.config.num_hidden_layers == 1 and drafter.config.vocab_size == target.config.vocab_size
    t, d = target.state_dict(), drafter.state_dict()
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(t[key], d[key]), key
    narrow = build_ar_drafter(target, ARDrafterConfig(num_layers=1, hidden_size=32))
    assert narrow.config.hidden_size == 32 and narrow.config.vocab_size == 256


def test_the_loss_covers_exactly_the_continuation_tokens():
    seqs = [DistillSequence("x", torch.arange(10), 4), DistillSequence("y", torch.arange(6), 2)]
    ids, attn, mask = _batch(seqs, max_len=8)  # the first sequence keeps its last 8 tokens (prompt: 2 of them)
    assert ids[0].tolist() == list(range(2, 10)) and attn[1].tolist() == [1] * 6 + [0, 0]
    # position t predicts token t + 1: the labels under the mask are the continuation tokens only
    labels = torch.roll(ids, -1, dims=1)
    assert labels[0][mask[0]].tolist() == list(range(4, 10))
    assert labels[1][mask[1]].tolist() == list(range(2, 6))


def test_ar_drafter_stage_trains_resumes_and_the_result_is_a_model_drafter(tmp_path: Path):
    import bastion
    from bastion.cli.main import main
    from bastion.drafters.model import ModelDrafter

    target = save_tiny_target(tmp_path / "target", "qwen3", seed=0)
    data = tmp_path / "distill.pt"
    save_checkpoint(data, done=6, rows=_sequences())
    assert len(load_continuations(data)) == 6
    out, export = tmp_path / "ar", tmp_path / "ar-fp16"
    args = ["train", "ar-drafter", "--target", str(target), "--data", str(data), "--out", str(out), "--smoke", "--export", str(export)]
    assert main(args) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and 0.0 <= summary["heldout"]["top1"] <= 1.0
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 3
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 0  # resumes at the last step: nothing left to train, same result written again
    assert (out / "model.safetensors").stat().st_mtime_ns >= before
    assert ModelDrafter.claims_checkpoint(str(export))
    pipe = bastion.Pipeline.from_pretrained(target, export, max_nodes=6)
    assert isinstance(pipe.drafter, ModelDrafter)
    assert next(pipe.drafter.model.parameters()).dtype == torch.float32
    prompt = torch.tensor([[5, 6, 7, 8]])
    from bastion.testing.reference import greedy_reference

    assert pipe.generate(prompt, max_new_tokens=8).tokens == greedy_reference(pipe.target.model, prompt, 8)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        ARDrafterConfig(steps=0)
