"""``bastion train eagle3``: the training-time test computes the drafter's own inference function, a smoke run
lowers the loss, resumes, and its checkpoint decodes losslessly as an ``eagle3`` drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.core import DraftContext, DraftStep
from bastion.huggingface.causal_lm import HFTarget
from bastion.drafters.eagle3 import Eagle3Drafter, Eagle3KV
from bastion.testing.tiny import save_tiny_target, tiny_model
from bastion.training.distill import DistillSequence
from bastion.training.eagle3 import (
    Eagle3TrainConfig,
    build_eagle3_drafter,
    draft_vocabulary,
    target_pass,
    training_feature_layers,
    unroll,
    unrolled_loss,
)
from bastion.training.loop import save_checkpoint

VOCAB = 256


def _rows(n: int = 6, length: int = 24, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"source": "math", "ids": torch.randint(5, VOCAB, (length,), generator=gen).tolist(), "prompt_len": 6} for _ in range(n)]


def _seqs(n: int = 6) -> list[DistillSequence]:
    return [DistillSequence(r["source"], torch.tensor(r["ids"]), r["prompt_len"]) for r in _rows(n)]


def _perturbed(model):
    """``model`` with every weight nudged by seeded noise, so no branch of the layer is inert."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


def test_feature_layers_are_eagle3s_default_when_distinct_else_first_middle_last():
    assert training_feature_layers(32) == (1, 15, 28)  # hidden states entering layers 2, 16, 29
    assert training_feature_layers(4) == (0, 1, 3)
    assert training_feature_layers(3) == (0, 1, 2)


def test_the_draft_vocabulary_is_the_most_frequent_continuation_tokens():
    seqs = [DistillSequence("x", torch.tensor([9, 9, 7, 7, 7, 3, 5]), 2)]  # continuation 7 7 7 3 5 (9 9 is prompt)
    assert draft_vocabulary(seqs, 10, 2).tolist() == [3, 7]  # 7 (3 times), then 3 and 5 tie: the lower id
    model = build_eagle3_drafter(tiny_model("qwen3", seed=0), Eagle3TrainConfig(draft_vocab=2), seqs)
    assert model.target_ids(torch.arange(2)).tolist() == [3, 7]


def test_unrolled_steps_compute_the_drafters_tree_and_chain_log_q():
    """Step k row j of the training-time test is what the ``eagle3`` drafter computes at inference for the
    node at depth k + 1 on the true path below root ``j + 1`` (context ``0 .. j``)."""
    target = tiny_model("qwen3", seed=0, num_hidden_layers=3)
    seq = _seqs(1)[0]
    model = _perturbed(build_eagle3_drafter(target, Eagle3TrainConfig(ttt_steps=4), [seq]))
    layers = model.config.feature_layer_ids
    feats, _ = target_pass(target, seq.ids, layers)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        outs = unroll(model, embed(seq.ids), feats, 4)
    ids = seq.ids.tolist()
    c = 9  # committed context ids[0 .. c - 1], root ids[c]
    # the drafter's own tree: every root child and every grandchild (top_k = the whole vocabulary)
    drafter = Eagle3Drafter(model, total_token=1 + VOCAB + VOCAB * VOCAB, depth=1, top_k=VOCAB)
    drafter.bind(HFTarget(target))
    drafter.begin(DraftContext(tokens=torch.tensor(ids[:c]), features=feats[:c]))
    cand = drafter.propose(DraftStep(root_token=ids[c], context_len=c))
    tokens, parents, log_q = cand.host_lists()
    child = next(i for i in range(1, len(tokens)) if parents[i] == 0 and tokens[i] == ids[c + 1])
    grand = next(i for i in range(1, len(tokens)) if parents[i] == child and tokens[i] == ids[c + 2])
    with torch.no_grad():
        unrolled = [torch.log_softmax(model.logits(outs[k][c - 1 : c]).double()[0], dim=-1) for k in range(4)]
    assert log_q[child] == pytest.approx(float(unrolled[0][ids[c + 1]]), abs=1e-5)
    assert log_q[grand] == pytest.approx(float(unrolled[1][ids[c + 2]]), abs=1e-5)
    # deeper steps: the same chain fed node by node through the drafter's cache
    cache = Eagle3KV()
    with torch.no_grad():
        out = model.rows(embed(torch.tensor(ids[1 : c + 1])), model.fc(feats[:c]), torch.arange(c), cache, None)[-1:]
        for k in range(1, 4):
            out = model.rows(embed(torch.tensor([ids[c + k]])), out, torch.tensor([c + k - 1]), cache, None)
            assert torch.allclose(out[0], outs[k][c - 1], atol=1e-5), f"step {k}"


def test_the_loss_counts_only_labels_inside_the_continuation():
    target = tiny_model("qwen3", seed=0)
    seq = DistillSequence("x", torch.arange(5, 17), 7)  # 12 tokens, continuation from index 7
    model = build_eagle3_drafter(target, Eagle3TrainConfig(), [seq])
    feats, logits = target_pass(target, seq.ids, model.config.feature_layer_ids)
    res = unrolled_loss(model, target.get_input_embeddings(), seq.ids, 7, feats, logits, 3, 0.8)
    # row j at step k predicts token j + k + 2 (the target's distribution at j + k + 1, which exists up to the
    # last token): counted when 7 <= j + k + 2 and j + k + 1 <= 11
    for k in range(3):
        assert [j for j in range(11) if res.valid[k, j]] == list(range(max(0, 5 - k), 11 - k))
    res.loss.backward()
    assert model.fc.weight.grad is not None and float(model.fc.weight.grad.abs().sum()) > 0


def _loss(model, target, seqs, steps: int = 3) -> float:
    with torch.no_grad():
        total = 0.0
        for s in seqs:
            feats, logits = target_pass(target, s.ids, model.config.feature_layer_ids)
            total += float(unrolled_loss(model, target.get_input_embeddings(), s.ids, s.prompt_len, feats, logits, steps, 0.8).loss)
    return total / len(seqs)


def test_a_smoke_run_lowers_the_loss_resumes_and_its_checkpoint_decodes_losslessly(tmp_path: Path):
    import bastion
    from bastion.cli.main import main
    from bastion.drafters.eagle3 import Eagle3DraftModel
    from bastion.training.frozen import load_frozen_target

    target_dir = save_tiny_target(tmp_path / "target", "qwen3", seed=0)
    target = load_frozen_target(target_dir)
    data = tmp_path / "distill.pt"
    rows = _rows(6)
    save_checkpoint(data, done=len(rows), rows=rows)
    out, export = tmp_path / "eagle3", tmp_path / "eagle3-fp16"
    args = ["train", "eagle3", "--target", str(target_dir), "--data", str(data), "--out", str(out), "--smoke",
            "--steps", "12", "--lr", "0.01", "--heldout-seqs", "1", "--export", str(export), "--no-progress"]
    assert main(args) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 12 and summary["draft_vocab_size"] == VOCAB and summary["feature_layers"] == [0, 0, 1]
    assert len(summary["heldout"]["top1"]) == 3  # --smoke unrolls 3 steps
    train = [DistillSequence(r["source"], torch.tensor(r["ids"]), r["prompt_len"]) for r in rows]
    train = [s for i, s in enumerate(train) if i != 5]  # the last sequence is held out
    fresh = build_eagle3_drafter(target, Eagle3TrainConfig(seed=0), train)
    trained = Eagle3DraftModel.from_pretrained(out)
    assert _loss(trained, target, train) < _loss(fresh, target, train) - 0.05
    # a second run with the same --out resumes at the end: no step is taken again
    before = (out / "model.safetensors").read_bytes()
    assert main(args) == 0
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 12
    assert (out / "model.safetensors").read_bytes() == before
    # the checkpoint (and its float16 copy) is an eagle3 drafter that decodes the target's own greedy tokens
    assert bastion.registry.drafter_for_checkpoint(str(out)) == "eagle3"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    hf = tiny_model("qwen3", seed=0)
    for folder in (out, export):
        pipe = bastion.Pipeline.from_pretrained(str(target_dir), str(folder), dtype=torch.float32)
        assert isinstance(pipe.drafter, Eagle3Drafter)
        for prompt in ([5, 9, 33], [7, 100, 4, 18, 250, 61]):
            want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[0, len(prompt):].tolist()
            assert pipe.generate(torch.tensor([prompt]), max_new_tokens=12).tokens == want
