"""Lean DFlash drafting: grouped-query attention without key/value copies, and block keys written into
the context cache's scratch tail instead of concatenating the context every step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.types import DraftContext, DraftStep
from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from bastion.drafters.dflash.ops import grouped_attention as _grouped_attention
from bastion.testing.tiny import tiny_model


def test_grouped_attention_equals_attention_over_repeated_key_heads() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 5, 16, generator=gen)  # [N, h, S, D]
    k = torch.randn(3, 2, 11, 16, generator=gen)  # [N, h_kv, L, D]
    v = torch.randn(3, 2, 11, 16, generator=gen)
    mask = torch.rand(3, 1, 5, 11, generator=gen) > 0.3
    mask[..., -5:] = True  # every query sees the block
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask, scale=0.25)
    torch.testing.assert_close(_grouped_attention(q, k, v, mask, 0.25), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(
        _grouped_attention(q, k, v, None, 0.25),
        F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), scale=0.25),
        atol=1e-6, rtol=1e-5,
    )


def _reference_block_logits(model: DFlashDraftModel, target: HFTarget, feats: torch.Tensor, root: int, block: int):  # type: ignore[no-untyped-def]
    """The draft logits recomputed from all committed features with no cache (the plain path)."""
    ids = torch.full((1, block), model.config.mask_token_id)
    ids[0, 0] = root
    c = feats.shape[0]
    with torch.no_grad():
        return model.block_logits(
            feats[None], ids, embed=target.input_embeddings(), head=target.output_head(),
            block_positions=torch.arange(c, c + block),
        )[0, : block - 1]


def _begun_drafter(seed: int, block_size: int, prompt_len: int):  # type: ignore[no-untyped-def]
    """A float32 DFlash drafter over a tiny target, begun on a random prompt: (target, model, drafter,
    the prompt's features [prompt_len, F])."""
    torch.manual_seed(seed)
    target = HFTarget(tiny_model("qwen3", seed=1))
    cfg = DFlashConfig.for_target(target.config, num_layers=2, block_size=block_size, target_layer_ids=(0, 1), mask_token_id=255)
    model = DFlashDraftModel(cfg).eval()
    drafter = DFlashDrafter(model, device="cpu", dtype=torch.float32)
    drafter.bind(target)
    prompt = torch.randint(0, 200, (1, prompt_len))
    feats = target.prefill(prompt, (0, 1)).features  # [prompt_len, F]
    drafter.begin(DraftContext(tokens=prompt[0], features=feats))
    return target, model, drafter, feats


def test_cached_drafting_with_a_scratch_tail_equals_recomputation_step_after_step() -> None:
    target, model, drafter, feats = _begun_drafter(seed=4, block_size=6, prompt_len=7)
    storage = None
    for step in range(6):
        root = 10 + step
        got = drafter.propose(DraftStep(root_token=root, context_len=feats.shape[0]))
        want = torch.log_softmax(_reference_block_logits(model, target, feats, root, 6).float(), -1)
        torch.testing.assert_close(got.log_probs, want, atol=1e-5, rtol=1e-5)
        ptr = drafter._cache._keys[0].data_ptr()
        if step >= 2:  # capacity covers context + block: the storage is reused, not reallocated per step
            assert ptr == storage
        storage = ptr
        new = torch.randn(1 + step % 3, feats.shape[1])  # the step's root and accepted nodes
        drafter.commit(torch.arange(new.shape[0]), new)
        feats = torch.cat([feats, new])


def test_a_draft_capped_at_max_depth_runs_the_head_on_those_depths_only_with_unchanged_marginals() -> None:
    torch.manual_seed(5)
    target = HFTarget(tiny_model("qwen3", seed=1))
    cfg = DFlashConfig.for_target(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 1), mask_token_id=255)
    drafter = DFlashDrafter(DFlashDraftModel(cfg).eval(), device="cpu", dtype=torch.float32)
    drafter.bind(target)
    prompt = torch.randint(0, 200, (1, 9))
    feats = target.prefill(prompt, (0, 1)).features
    drafter.begin(DraftContext(tokens=prompt[0], features=feats))
    full = drafter.propose(DraftStep(root_token=12, context_len=9)).log_probs  # [7, V]
    rows: list[int] = []
    head = target.output_head()
    hook = head.register_forward_hook(lambda _m, args, _out: rows.append(int(args[0].shape[:-1].numel())))  # one block
    try:
        for depth in (1, 3, 7, 20):
            got = drafter.propose(DraftStep(root_token=12, context_len=9, max_depth=depth)).log_probs
            assert got.shape[0] == min(depth, 7)
            torch.testing.assert_close(got, full[: min(depth, 7)], atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()
    assert rows == [1, 3, 7, 7]  # the lm head ran on the returned depths only


def _fused_model() -> DFlashDraftModel:
    torch.manual_seed(7)
    cfg = DFlashConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_hidden_layers=2, vocab_size=128, num_target_layers=2, block_size=5,
                       target_layer_ids=(0, 1), mask_token_id=3)
    return DFlashDraftModel(cfg).eval()


def _block_hidden(model: DFlashDraftModel, feats: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    c = feats.shape[1]
    return model(blocks, torch.arange(c, c + blocks.shape[1]), feats, torch.arange(c))


def test_fused_inference_projections_give_the_layer_by_layer_outputs_and_follow_weight_updates() -> None:
    from bastion.drafters.dflash.fused import FusedLinears

    model = _fused_model()
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 9, model.config.feature_size, generator=gen)
    blocks = torch.randn(2, 5, 64, generator=gen)
    with torch.enable_grad():  # autograd recording: every layer runs on its own
        layer_by_layer = _block_hidden(model, feats, blocks).detach()
    with torch.inference_mode():  # one product per fused group
        fused = _block_hidden(model, feats, blocks)
    torch.testing.assert_close(fused, layer_by_layer, atol=1e-6, rtol=1e-6)
    assert isinstance(model.layers[0].self_attn._qkv, FusedLinears) and model.layers[0].self_attn._qkv._weight is not None
    # an in-place update (an optimizer step, load_state_dict) is seen at the next inference call
    with torch.no_grad():
        model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        model.layers[1].mlp.up_proj.weight.add_(0.01)
    with torch.enable_grad():
        updated = _block_hidden(model, feats, blocks).detach()
    with torch.inference_mode():
        torch.testing.assert_close(_block_hidden(model, feats, blocks), updated, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(updated, layer_by_layer)


def test_fused_linears_keep_no_copy_for_large_layers_and_let_gradients_reach_each_layer() -> None:
    from bastion.drafters.dflash.fused import FusedLinears

    a, b = torch.nn.Linear(8, 6), torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    small, large = FusedLinears(a, b), FusedLinears(a, b, max_elements=79)  # 10 x 8 = 80 elements
    with torch.no_grad():
        for fused in (small, large):
            ya, yb = fused(x)
            torch.testing.assert_close(ya, a(x), atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(yb, b(x), atol=1e-6, rtol=1e-6)
    assert small._weight is not None and small._weight.shape == (10, 8)
    assert large._weight is None  # over the size limit: no concatenated copy
    ya, yb = small(x)  # with autograd recording, the layers' own parameters get the gradients
    (ya.sum() + yb.sum()).backward()
    assert a.weight.grad is not None and b.weight.grad is not None


def test_a_few_new_positions_are_projected_in_the_drafts_own_pass_and_many_are_cached_first() -> None:
    from bastion.drafters.dflash import drafter as dflash_drafter

    target, model, drafter, feats = _begun_drafter(seed=6, block_size=4, prompt_len=5)
    flushed: list[int] = []
    real_flush = drafter._flush

    def counting_flush(device):  # type: ignore[no-untyped-def]
        flushed.append(drafter._pending_len)
        real_flush(device)

    drafter._flush = counting_flush  # type: ignore[method-assign]
    for step, new_rows in enumerate([0, 2, 1, dflash_drafter._FRESH_MAX + 1, 3]):
        if new_rows:
            new = torch.randn(new_rows, feats.shape[1])
            drafter.commit(torch.arange(new_rows), new)
            feats = torch.cat([feats, new])
        got = drafter.propose(DraftStep(root_token=20 + step, context_len=feats.shape[0]))
        want = torch.log_softmax(_reference_block_logits(model, target, feats, 20 + step, 4).float(), -1)
        torch.testing.assert_close(got.log_probs, want, atol=1e-5, rtol=1e-5)
        assert drafter.cached_positions == feats.shape[0]  # every committed position is cached after a draft
    # the prompt (nothing cached yet) and the long run are cached on their own; 2, 1 and 3 rows in-pass
    assert flushed == [5, dflash_drafter._FRESH_MAX + 1]


def test_rotary_spans_from_the_cached_table_equal_direct_computation_bit_for_bit() -> None:
    cfg = DFlashConfig.for_target(tiny_model("qwen3", seed=1).config, num_layers=1, block_size=4, target_layer_ids=(0,), mask_token_id=255)
    rotary = DFlashDraftModel(cfg).rotary
    for dtype in (torch.float32, torch.bfloat16):
        for start, length in ((0, 4), (250, 16), (300, 40), (1500, 9)):  # the table grows past 256 and 512
            cos, sin = rotary.span(start, length, dtype, torch.device("cpu"))
            ref_cos, ref_sin = rotary(torch.arange(start, start + length)[None], dtype)
            assert cos.shape == ref_cos.shape == (1, length, cfg.head_dim)
            assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_a_block_start_position_gives_the_same_logits_as_its_position_tensor() -> None:
    target, model, drafter, feats = _begun_drafter(seed=6, block_size=5, prompt_len=9)
    ids = torch.full((1, 5), model.config.mask_token_id)
    ids[0, 0] = 17
    kw = dict(embed=target.input_embeddings(), head=target.output_head())
    with torch.no_grad():
        by_tensor = model.block_logits(feats[None], ids, block_positions=torch.arange(9, 14), **kw)
        by_start = model.block_logits(feats[None], ids, block_positions=9, **kw)
    assert torch.equal(by_tensor, by_start)
