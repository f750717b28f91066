"""Bad input to the pipeline and the target adapter fails early with a clear error."""

from __future__ import annotations

import functools

import pytest
import torch

import bastion
from bastion.core import IncompatibleComponentsError, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model("qwen3", seed=0, max_position_embeddings=64)


def _pipeline() -> bastion.Pipeline:
    model = _model()
    return bastion.Pipeline(
        HFTarget(model),
        NoisyOracleDrafter(model, block_size=4),
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=8),
        max_nodes=8,
    )


def test_empty_prompt_is_rejected():
    with pytest.raises(InvalidInputError, match="empty"):
        _pipeline().generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("length", [64, 100])
def test_prompt_reaching_the_max_positions_is_rejected(length):
    with pytest.raises(InvalidInputError, match="at most 64 positions"):
        _pipeline().generate(torch.ones(1, length, dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_non_positive_or_non_int_max_new_tokens_is_rejected(bad):
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        _pipeline().generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=bad)


def test_out_of_vocabulary_prompt_and_bad_shapes_are_rejected():
    pipe = _pipeline()
    with pytest.raises(InvalidInputError, match=r"\[0, 256\)"):
        pipe.generate(torch.tensor([[1, 256]]), max_new_tokens=2)
    with pytest.raises(InvalidInputError, match=r"\[1, L\]"):
        pipe.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)


def test_negative_temperature_and_bad_top_p_are_rejected():
    pipe = _pipeline()
    with pytest.raises(InvalidInputError, match="temperature"):
        pipe.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, temperature=-1.0)
    with pytest.raises(InvalidInputError, match="top_p"):
        pipe.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=2, temperature=1.0, top_p=0.0)


def test_drafter_vocabulary_different_from_the_target_is_rejected():
    other = tiny_model("qwen3", seed=0, vocab_size=300)
    with pytest.raises(IncompatibleComponentsError, match=r"drafter vocabulary \(300\) differs from the target's \(256\)"):
        bastion.Pipeline(HFTarget(_model()), NoisyOracleDrafter(other), budget_controller="fixed")


def test_attention_implementation_that_ignores_masks_is_rejected(tiny_qwen3_dir):
    with pytest.raises(IncompatibleComponentsError, match="flash_attention_2"):
        bastion.Pipeline.from_pretrained(
            tiny_qwen3_dir, NoisyOracleDrafter(_model()), attn_implementation="flash_attention_2"
        )


def test_generation_near_the_position_limit_stops_without_overflowing():
    model = _model()
    pipe = _pipeline()
    prompt = torch.randint(3, 256, (1, 60), generator=torch.Generator().manual_seed(0))
    res = pipe.generate(prompt, max_new_tokens=20, stop_on_eos=False)
    # positions 60..63 remain: the prefill token plus 3 more fill them, one more comes from position 63
    assert len(res.tokens) <= 64 - 60 + 1
    assert pipe.target.context_len <= 64
    with torch.no_grad():
        ref = model.generate(prompt, do_sample=False, max_new_tokens=len(res.tokens))[0, 60:].tolist()
    assert res.tokens[: len(ref)] == ref
