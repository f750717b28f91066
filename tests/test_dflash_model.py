"""The DFlash draft network: checkpoint format, numerics against an independent recomputation, config
parsing and the training-facing helpers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from bastion.training.blocks import make_training_blocks

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 32, 4, 2, 8, 48, 64
N_LAYERS, N_TARGET, LAYER_IDS, BLOCK, MASK_ID = 2, 4, (0, 2, 3), 4, 63
THETA, EPS = 10000.0, 1e-6


def _released_style_config() -> dict:
    """A config.json in the layout of the released z-lab DFlash checkpoints (4.x-style rope keys)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 256,
        "rms_norm_eps": EPS,
        "rope_theta": THETA,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_sliding_window": False,
        "vocab_size": VOCAB,
        "block_size": BLOCK,
        "num_target_layers": N_TARGET,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(LAYER_IDS)},
    }


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    out = {
        "fc.weight": w(HIDDEN, HIDDEN * len(LAYER_IDS)),
        "hidden_norm.weight": norm(HIDDEN),
        "norm.weight": norm(HIDDEN),
    }
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
                p + "self_attn.q_norm.weight": norm(HEAD_DIM),
                p + "self_attn.k_norm.weight": norm(HEAD_DIM),
                p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
                p + "mlp.up_proj.weight": w(INTER, HIDDEN),
                p + "mlp.down_proj.weight": w(HIDDEN, INTER),
                p + "input_layernorm.weight": norm(HIDDEN),
                p + "post_attention_layernorm.weight": norm(HIDDEN),
            }
        )
    return out


def _write_checkpoint(directory: Path, weights: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or _released_style_config()))
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


# ------------------------------------------------------------------ independent recomputation
def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS))


def _rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of one head vector by angle position * theta^(-2i/D)."""
    half = HEAD_DIM // 2
    out = x.clone()
    for i in range(half):
        angle = position * THETA ** (-2.0 * i / HEAD_DIM)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def _reference_logits(
    w: dict[str, torch.Tensor],
    features: torch.Tensor,  # [C, F] at positions 0..C-1
    block: list[int],  # [B] token ids at positions C..C+B-1
    embed: torch.Tensor,  # [V, H]
    head: torch.Tensor,  # [V, H]
) -> torch.Tensor:
    """Straightforward loops: every block slot attends to all context positions and all block slots."""
    c = features.shape[0]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])  # [C, H]
    x = embed[block]  # [B, H]
    positions = list(range(c)) + [c + j for j in range(len(block))]
    group = HEADS // KV_HEADS
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        sources = torch.cat([ctx, h])  # keys/values come from context vectors then block slots
        attn_out = torch.zeros(len(block), HEADS * HEAD_DIM)
        for head_idx in range(HEADS):
            kv_idx = head_idx // group
            sl = slice(head_idx * HEAD_DIM, (head_idx + 1) * HEAD_DIM)
            kv_sl = slice(kv_idx * HEAD_DIM, (kv_idx + 1) * HEAD_DIM)
            keys, values = [], []
            for t in range(sources.shape[0]):
                k = _rms(sources[t] @ w[p + "self_attn.k_proj.weight"][kv_sl].T, w[p + "self_attn.k_norm.weight"])
                keys.append(_rope(k, positions[t]))
                values.append(sources[t] @ w[p + "self_attn.v_proj.weight"][kv_sl].T)
            for j in range(len(block)):
                q = _rms(h[j] @ w[p + "self_attn.q_proj.weight"][sl].T, w[p + "self_attn.q_norm.weight"])
                q = _rope(q, c + j)
                scores = torch.stack([q.dot(k) / math.sqrt(HEAD_DIM) for k in keys])
                probs = torch.exp(scores - scores.max())
                probs = probs / probs.sum()
                attn_out[j, sl] = sum(pr * v for pr, v in zip(probs, values))
        x = x + attn_out @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["norm.weight"])
    return x[1:] @ head.T  # [B - 1, V]


# ------------------------------------------------------------------ tests
def test_checkpoint_in_dflash_format_loads_and_matches_independent_recomputation(tmp_path: Path) -> None:
    weights = _random_weights(seed=1)
    ckpt = _write_checkpoint(tmp_path / "draft", weights)
    model = DFlashDraftModel.from_pretrained(ckpt)
    g = torch.Generator().manual_seed(2)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
        head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=g))
    features = torch.randn(7, HIDDEN * len(LAYER_IDS), generator=g)  # [C, F]
    block = [17] + [MASK_ID] * (BLOCK - 1)
    with torch.no_grad():
        got = model.block_logits(
            features[None],
            torch.tensor([block]),
            embed=embed,
            head=head,
            block_positions=torch.arange(7, 7 + BLOCK),
        )[0]
    want = _reference_logits(weights, features, block, embed.weight.detach(), head.weight.detach())
    assert got.shape == (BLOCK - 1, VOCAB)
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_save_pretrained_writes_the_dflash_layout_and_round_trips(tmp_path: Path) -> None:
    cfg = DFlashConfig.from_dict(_released_style_config())
    model = DFlashDraftModel(cfg)
    out = model.save_pretrained(tmp_path / "saved")
    data = json.loads((out / "config.json").read_text())
    assert data["block_size"] == BLOCK and data["num_target_layers"] == N_TARGET
    assert data["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": list(LAYER_IDS)}
    assert data["architectures"] == ["DFlashDraftModel"] and data["rope_theta"] == THETA
    assert data["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}  # unknown keys survive
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(_random_weights(0))  # exactly the DFlash keys: no embedding, no lm head
    again = DFlashDraftModel.from_pretrained(out)
    assert again.config == cfg
    for k, v in model.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_missing_and_unexpected_weight_keys_are_listed(tmp_path: Path) -> None:
    weights = _random_weights(0)
    del weights["layers.1.mlp.up_proj.weight"]
    weights["lm_head.weight"] = torch.zeros(VOCAB, HIDDEN)
    ckpt = _write_checkpoint(tmp_path / "bad", weights)
    with pytest.raises(IncompatibleComponentsError) as err:
        DFlashDraftModel.from_pretrained(ckpt)
    assert "layers.1.mlp.up_proj.weight" in str(err.value) and "lm_head.weight" in str(err.value)


def test_weight_of_the_wrong_shape_is_reported(tmp_path: Path) -> None:
    weights = _random_weights(0)
    weights["fc.weight"] = torch.zeros(HIDDEN, HIDDEN)  # config says 3 feature layers
    with pytest.raises(IncompatibleComponentsError, match="fc.weight"):
        DFlashDraftModel.from_pretrained(_write_checkpoint(tmp_path / "shape", weights))


def test_legacy_and_new_rope_keys_parse_to_the_same_config() -> None:
    legacy = _released_style_config()
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": THETA}
    assert DFlashConfig.from_dict(legacy) == DFlashConfig.from_dict(new)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dflash_config": {"mask_token_id": VOCAB, "target_layer_ids": [0]}}, "mask_token_id"),
        ({"dflash_config": {"mask_token_id": 1, "target_layer_ids": [N_TARGET]}}, "target_layer_ids"),
        ({"dflash_config": {"target_layer_ids": [0]}}, "mask_token_id"),
        ({"block_size": None}, "block_size"),
        ({"use_sliding_window": True}, "sliding"),
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"rope_theta": -5.0}, "rope_theta"),
    ],
)
def test_invalid_configs_are_rejected_with_the_offending_field(change: dict, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        DFlashConfig.from_dict({**_released_style_config(), **change})


def test_default_target_layer_ids_reproduce_the_released_qwen3_8b_choice() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(4, 1) == (2,)


def test_for_target_copies_the_target_geometry() -> None:
    from bastion.testing.tiny import tiny_config

    target = tiny_config("qwen3")
    cfg = DFlashConfig.for_target(target, num_layers=1, block_size=8, target_layer_ids=(0, 1), mask_token_id=5)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers) == (64, 256, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.feature_size == 128 and cfg.num_draft_tokens == 7
    assert cfg.rope_parameters["rope_theta"] == float(target.rope_parameters["rope_theta"])


def test_training_blocks_hold_anchor_masks_next_token_labels_and_causal_context() -> None:
    ids = torch.tensor([5, 6, 7, 8, 9])
    blocks = make_training_blocks(ids, torch.tensor([0, 3]), block_size=3, mask_token_id=MASK_ID)
    assert blocks.block_ids.tolist() == [[5, MASK_ID, MASK_ID], [8, MASK_ID, MASK_ID]]
    assert blocks.block_positions.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert blocks.labels.tolist() == [[6, 7], [9, -100]]
    assert blocks.context_mask.tolist() == [[False] * 5, [True, True, True, False, False]]


def test_context_mask_is_equivalent_to_truncating_the_context_per_block() -> None:
    torch.manual_seed(0)
    model = DFlashDraftModel(DFlashConfig.from_dict(_released_style_config())).eval()
    embed, head = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    ids = torch.randint(0, MASK_ID, (10,))
    feats = torch.randn(1, 10, HIDDEN * len(LAYER_IDS))  # [1, C, F] shared by all blocks
    anchors = torch.tensor([1, 4, 9])
    blocks = make_training_blocks(ids, anchors, BLOCK, MASK_ID)
    with torch.no_grad():
        batched = model.block_logits(
            feats, blocks.block_ids, embed=embed, head=head,
            block_positions=blocks.block_positions, context_mask=blocks.context_mask,
        )  # [N, B - 1, V]
        for row, a in enumerate(anchors.tolist()):
            alone = model.block_logits(
                feats[:, :a], blocks.block_ids[row : row + 1], embed=embed, head=head,
                block_positions=blocks.block_positions[row],
            )[0]
            assert torch.allclose(batched[row], alone, atol=1e-5), a


def test_block_loss_backpropagates_into_every_draft_weight() -> None:
    torch.manual_seed(0)
    model = DFlashDraftModel(DFlashConfig.from_dict(_released_style_config())).train()
    embed, head = torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    ids = torch.randint(0, MASK_ID, (12,))
    blocks = make_training_blocks(ids, torch.tensor([2, 6]), BLOCK, MASK_ID)
    logits = model.block_logits(
        torch.randn(1, 12, HIDDEN * len(LAYER_IDS)), blocks.block_ids, embed=embed, head=head,
        block_positions=blocks.block_positions, context_mask=blocks.context_mask,
    )
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), ignore_index=-100)
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not no_grad
