"""Parity of the ``eagle3`` drafter with the reference EAGLE-3 implementation on random weights.

``tests/fixtures/eagle3_parity.json`` was made once, outside this project, by running the reference code
(SafeAILab/EAGLE ``eagle/model/cnets.py``, ``Model.topK_genrate`` at its defaults total_token 60, depth 7,
top_k 10) on the checkpoint that :func:`parity_checkpoint` writes and on the features and tokens of
:func:`parity_inputs`. It stores the config, the reference's first-step draft logits (the root's row) and
its tree: the draft tokens in the reference's node order, each node's parent and its cumulative
log-probability. Weights and inputs come from a small integer hash, so the fixture holds no tensors."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from bastion.core import DraftContext, DraftStep
from bastion.drafters.eagle3 import Eagle3Drafter

FIXTURE = Path(__file__).parent / "fixtures" / "eagle3_parity.json"


def hashed_uniform(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic values in [-0.5, 0.5) of ``shape`` for tensor ``name`` (a 32-bit integer hash of the
    element index, seeded by the name: the same on every platform and torch version)."""
    mask = 0xFFFFFFFF
    n = 1
    for s in shape:
        n *= s
    x = (torch.arange(n, dtype=torch.int64) + zlib.crc32(name.encode())) & mask
    x = (x * 0x9E3779B1) & mask
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & mask
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & mask
    x ^= x >> 16
    return (x.double() / 2**32 - 0.5).float().reshape(shape)


def parity_state(config: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the parity checkpoint (SafeAILab names), from :func:`hashed_uniform`."""
    h, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    d = h // heads
    kv = config["num_key_value_heads"] * d
    vocab, draft_vocab, th = config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]
    shapes = {
        "fc.weight": (h, 3 * th),
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (draft_vocab, h),
        "embed_tokens.weight": (vocab, h),
    }
    scale = {"embed_tokens.weight": 2.0, "lm_head.weight": 14.0 / h**0.5}  # a peaked head: deep, narrow trees
    state = {k: hashed_uniform(k, s) * scale.get(k, 4.0 / s[1] ** 0.5) for k, s in shapes.items()}
    for k in ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight"):
        state[k] = 1.0 + 0.4 * hashed_uniform(k, (h,))
    chosen = hashed_uniform("d2t", (vocab,)).argsort()[:draft_vocab].sort().values  # target ids of the draft vocabulary
    state["d2t"] = chosen - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    state["t2d"] = t2d
    return state


def parity_checkpoint(folder: Path, config: dict) -> Path:
    """Write the parity checkpoint (``config.json`` + ``model.safetensors``, SafeAILab layout) to ``folder``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(parity_state(config), str(folder / "model.safetensors"))
    return folder


def parity_inputs(config: dict, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed features [C, 3 T] (three target hidden states per position) and the tokens [C + 1]
    (the committed ones, then the root) the reference drafted from."""
    feats = 3.0 * hashed_uniform("features", (context_len, 3 * config["target_hidden_size"]))
    tokens = (hashed_uniform("tokens", (context_len + 1,)) + 0.5).mul(config["vocab_size"]).long().clamp(max=config["vocab_size"] - 1)
    return feats, tokens


@pytest.fixture(scope="module")
def fixture() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def drafted(fixture, tmp_path_factory):
    folder = parity_checkpoint(tmp_path_factory.mktemp("eagle3-parity"), fixture["config"])
    drafter = Eagle3Drafter(str(folder))  # the checkpoint stores embed_tokens: no target needed
    assert (drafter.total_token, drafter.depth, drafter.top_k) == (60, 7, 10)  # the reference's defaults
    drafter._layers = (0, 1, 2)  # no target to bind to; the features are given directly
    feats, tokens = parity_inputs(fixture["config"], fixture["context_len"])
    drafter.begin(DraftContext(tokens=tokens[:-1], features=feats))
    tree = drafter.propose(DraftStep(root_token=int(tokens[-1]), context_len=fixture["context_len"]))
    with torch.no_grad():
        first = drafter.model.logits(drafter._root_row.output)[0]  # [draft_vocab]
    return tree, first


def test_first_step_draft_logits_equal_the_reference_to_1e4_in_float32(fixture, drafted):
    _, first = drafted
    want = torch.tensor(fixture["first_logits"])
    assert first.dtype == torch.float32
    torch.testing.assert_close(first, want, atol=1e-4, rtol=0)


def test_the_tree_at_eagle3_defaults_equals_the_reference_tokens_parents_and_scores(fixture, drafted):
    tree, _ = drafted
    assert len(tree) == 60
    assert tree.tokens.tolist() == fixture["tokens"]
    assert tree.parents.tolist() == fixture["parents"]
    torch.testing.assert_close(torch.tensor(tree.log_scores(), dtype=torch.float64), torch.tensor(fixture["scores"], dtype=torch.float64), atol=1e-4, rtol=0)


def test_the_parity_weights_are_reproducible_from_the_hash():
    # spot values pinned when the fixture was made: the weights the reference saw are the ones rebuilt here
    values = hashed_uniform("fc.weight", (4,)).tolist()
    assert values == pytest.approx([-0.1490222, -0.4110044, 0.3102454, 0.1956698], abs=1e-6)
