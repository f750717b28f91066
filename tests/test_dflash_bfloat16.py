"""A DFlash drafter in a narrower dtype than its target (bfloat16 beside a float32 target): the target's
lm head is read through a copy in the drafter's dtype, the draft stays close to the float32 draft, and
decoding stays lossless (the tokens never depend on the drafter's precision)."""

from __future__ import annotations

import pytest
import torch

import bastion
from bastion.utils.dtypes import fast_bfloat16
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.types import DraftContext, DraftStep
from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from bastion.drafters.dflash.drafter import head_in_dtype
from bastion.testing.tiny import tiny_model


def _pair(dtype: torch.dtype) -> tuple[HFTarget, DFlashDrafter]:
    target = HFTarget(tiny_model("qwen3", seed=1))
    cfg = DFlashConfig.for_target(target.config, num_layers=2, block_size=8, target_layer_ids=(0, 1), mask_token_id=255)
    torch.manual_seed(3)
    drafter = DFlashDrafter(DFlashDraftModel(cfg).eval(), device="cpu", dtype=dtype)
    drafter.bind(target)
    return target, drafter


def test_a_narrower_drafter_reads_a_frozen_copy_of_the_head_in_its_own_dtype() -> None:
    head = torch.nn.Linear(16, 40, bias=False)
    copy = head_in_dtype(head, torch.bfloat16)
    assert copy is not head and copy.weight.dtype == torch.bfloat16 and not copy.weight.requires_grad
    torch.testing.assert_close(copy.weight.float(), head.weight.detach(), atol=1e-2, rtol=1e-2)
    assert head_in_dtype(head, torch.float32) is head  # same width: the head itself
    assert head_in_dtype(head.to(torch.bfloat16), torch.float32).weight.dtype == torch.bfloat16  # never widened
    assert head_in_dtype(torch.nn.Identity(), torch.bfloat16).__class__ is torch.nn.Identity  # not a Linear: as it is


def test_a_bfloat16_draft_stays_close_to_the_float32_draft_with_the_same_weights() -> None:
    target, full = _pair(torch.float32)
    _, half = _pair(torch.bfloat16)
    assert half.model.dtype == torch.bfloat16 and half._head.weight.dtype == torch.bfloat16
    prompt = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    feats = target.prefill(prompt, (0, 1)).features
    drafts = []
    for drafter in (full, half):
        drafter.begin(DraftContext(tokens=prompt[0], features=feats))
        drafts.append(drafter.propose(DraftStep(root_token=12, context_len=12)).log_probs.exp())  # [7, V]
    assert drafts[1].dtype == torch.float32  # marginals are float32 whatever the drafter's dtype
    assert (drafts[0] - drafts[1]).abs().max() < 0.05


def test_decoding_with_a_bfloat16_drafter_beside_a_float32_target_is_lossless() -> None:
    model = tiny_model("qwen3", seed=1)
    target, drafter = _pair(torch.bfloat16)
    pipe = bastion.Pipeline(target, drafter, budget_controller=bastion.registry.create("budget_controller", "fixed", budget=8))
    gen = torch.Generator().manual_seed(4)
    for length in (2, 17):
        prompt = torch.randint(3, 256, (1, length), generator=gen)
        with torch.no_grad():
            ref = model.generate(prompt, do_sample=False, max_new_tokens=20, min_new_tokens=20)[0, length:].tolist()
        assert pipe.generate(prompt, max_new_tokens=20, stop_on_eos=False).tokens == ref
    rows = [torch.randint(3, 256, (1, n), generator=gen) for n in (3, 9, 5)]
    batched = pipe.generate_batch(rows, max_new_tokens=12, stop_on_eos=False)
    for prompt, got in zip(rows, batched):
        assert got.tokens == pipe.generate(prompt, max_new_tokens=12, stop_on_eos=False).tokens


@pytest.mark.skipif(not fast_bfloat16("cpu"), reason="this CPU has no native bfloat16 arithmetic")
def test_the_demo_dflash_drafter_runs_in_bfloat16_on_a_cpu_with_native_bfloat16_unless_told_otherwise() -> None:
    pipe = bastion.Pipeline.demo()
    assert pipe.target.dtype == torch.float32 and pipe.drafter.model.dtype == torch.bfloat16
    kept = bastion.Pipeline.demo(component_options={"drafter": {"dtype": "float32"}})
    assert kept.drafter.model.dtype == torch.float32
    assert bastion.Pipeline.demo(dtype=torch.bfloat16).drafter.model.dtype == torch.bfloat16  # the pair's own dtype


def test_fast_bfloat16_answers_for_cpu_and_unknown_device_types() -> None:
    assert isinstance(fast_bfloat16("cpu"), bool)
    assert fast_bfloat16("meta") is False
