"""The DFlash decode pass (one block over the cached context, the drafter's every step) computes the
module path's function, and its gathered weights follow every kind of weight change."""

from __future__ import annotations

import pytest
import torch

from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel
from bastion.drafters.dflash.fused import FusedLinears
from bastion.drafters.dflash.model import ContextKV


def _model(bias: bool = False, kv_heads: int = 2, seed: int = 3) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=kv_heads,
                       head_dim=16, num_hidden_layers=2, vocab_size=128, num_target_layers=2, block_size=5,
                       target_layer_ids=(0, 1), mask_token_id=3, attention_bias=bias)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "norm" in name else 0.0))
    return model


def _cached(model: DFlashDraftModel, feats: torch.Tensor, spare: int) -> ContextKV:
    """The context's keys/values in storage with ``spare`` scratch slots after them, as the drafter keeps it."""
    with torch.no_grad():
        kv = model.context_kv(feats, torch.arange(feats.shape[1]))
    grow = lambda t: torch.cat([t, torch.full((*t.shape[:2], spare, t.shape[3]), float("nan"))], dim=2)  # noqa: E731
    return ContextKV(tuple(grow(k) for k in kv.keys), tuple(grow(v) for v in kv.values), tail=spare)


def _reference(model: DFlashDraftModel, feats: torch.Tensor, block: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The module path over the whole context (autograd recording keeps every layer on its own)."""
    with torch.enable_grad():
        return model(block, positions, feats, torch.arange(feats.shape[1])).detach()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("fresh", [0, 3])
def test_the_decode_pass_gives_the_module_paths_hidden_states(bias: bool, kv_heads: int, fresh: int) -> None:
    model = _model(bias, kv_heads)
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 9, model.config.feature_size, generator=gen)
    block = torch.randn(1, 5, 64, generator=gen)
    c = 9 - fresh
    past = _cached(model, feats[:, :c], spare=fresh + 5)
    with torch.inference_mode():
        got = model(block, 9, past_context=past, fresh_context=feats[:, c:] if fresh else None)
    assert model._plan is not None  # the decode pass ran
    torch.testing.assert_close(got, _reference(model, feats, block, torch.arange(9, 14)), atol=1e-5, rtol=1e-5)
    # the fresh positions' keys now sit in the first scratch slots: the same as caching them first
    whole = _cached(model, feats, spare=0)
    for k_got, k_want in zip(past.keys, whole.keys):
        torch.testing.assert_close(k_got[:, :, :9], k_want, atol=1e-5, rtol=1e-5)


def test_the_decode_pass_follows_block_positions_that_do_not_follow_the_context() -> None:
    model = _model()
    gen = torch.Generator().manual_seed(2)
    feats = torch.randn(1, 7, model.config.feature_size, generator=gen)
    block = torch.randn(1, 5, 64, generator=gen)
    for positions in (20, torch.arange(30, 35)):
        with torch.inference_mode():
            got = model(block, positions, past_context=_cached(model, feats, spare=5))
        want_pos = torch.arange(20, 25) if isinstance(positions, int) else positions
        torch.testing.assert_close(got, _reference(model, feats, block, want_pos), atol=1e-5, rtol=1e-5)


def test_projections_too_large_to_pack_run_layer_by_layer_with_the_same_result() -> None:
    model = _model(bias=True)
    gen = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 6, model.config.feature_size, generator=gen)
    block = torch.randn(1, 5, 64, generator=gen)
    for layer in model.layers:  # no concatenated copy allowed
        a, m = layer.self_attn, layer.mlp
        a._qkv = FusedLinears(a.q_proj, a.k_proj, a.v_proj, max_elements=0)
        m._gate_up = FusedLinears(m.gate_proj, m.up_proj, max_elements=0)
    with torch.inference_mode():
        got = model(block, 6, past_context=_cached(model, feats, spare=5))
    assert all(lay.qkv.weight is None and lay.gate_up.weight is None for lay in model._plan.layers)
    torch.testing.assert_close(got, _reference(model, feats, block, torch.arange(6, 11)), atol=1e-5, rtol=1e-5)


def test_the_gathered_weights_are_reused_until_a_weight_changes_and_follow_every_change() -> None:
    model = _model(bias=True)
    gen = torch.Generator().manual_seed(4)
    feats = torch.randn(1, 6, model.config.feature_size, generator=gen)
    block = torch.randn(1, 5, 64, generator=gen)

    def check() -> None:
        dtype = model.dtype
        with torch.inference_mode():
            got = model(block.to(dtype), 6, past_context=_cached(model, feats.to(dtype), spare=5))
        want = _reference(model, feats.to(dtype), block.to(dtype), torch.arange(6, 11))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    check()
    plan = model._plan
    check()
    assert model._plan is plan  # nothing changed: gathered once
    changes = [
        lambda: model.layers[0].self_attn.k_proj.weight.mul_(1.5),  # in place, as an optimizer step
        lambda: model.layers[1].self_attn.q_norm.weight.add_(0.2),
        lambda: model.load_state_dict({k: v * 0.9 for k, v in model.state_dict().items()}),
        lambda: setattr(model.layers[1].mlp.down_proj, "weight", torch.nn.Parameter(torch.randn(64, 96) * 0.05)),
        lambda: setattr(model.layers[0].self_attn.o_proj, "bias", torch.nn.Parameter(torch.randn(64))),
        lambda: model.to(torch.float64),
    ]
    for change in changes:
        before = model._plan
        with torch.no_grad():
            change()
        check()
        assert model._plan is not before


def test_fresh_context_of_the_wrong_width_is_refused_naming_both_widths() -> None:
    from bastion.contract.errors import InvalidInputError

    model = _model()
    feats = torch.randn(1, 6, model.config.feature_size)
    with torch.inference_mode(), pytest.raises(InvalidInputError, match=f"width 7, expected {model.config.feature_size}"):
        model(torch.randn(1, 5, 64), 8, past_context=_cached(model, feats, spare=7), fresh_context=torch.randn(1, 2, 7))
