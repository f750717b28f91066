"""Bad generate arguments fail with InvalidInputError instead of being truncated or crashing in torch."""

from __future__ import annotations

import functools

import pytest
import torch

import bastion
from bastion.core import InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


@functools.lru_cache(maxsize=None)
def _pipeline() -> bastion.Pipeline:
    model = tiny_model("qwen3", seed=0, max_position_embeddings=64)
    return bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=3), budget_controller="bastion", max_nodes=6)


IDS = torch.tensor([[4, 5, 6]])


@pytest.mark.parametrize("prompt", [[4, 5.0, 6], [4, 5.7], [True, 3]])
def test_float_or_bool_token_ids_in_a_list_are_rejected_not_truncated(prompt):
    with pytest.raises(InvalidInputError, match="token ids must be ints"):
        _pipeline().generate(prompt, max_new_tokens=2)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
        ({"temperature": 1.0, "top_k": True}, "top_k"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "seed": 1.5}, "seed"),
        ({"temperature": 1.0, "seed": 2**64}, "seed"),
        ({"temperature": 1.0, "seed": -1}, "seed"),
        ({"temperature": 0.0, "seed": 3.0}, "seed"),
        ({"temperature": 1e-45}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": float("nan")}, "top_p"),
    ],
)
def test_bad_sampling_arguments_raise_invalid_input_naming_the_argument(kwargs, field):
    with pytest.raises(InvalidInputError, match=field):
        _pipeline().generate(IDS, max_new_tokens=3, **kwargs)


def test_largest_seed_and_smallest_temperature_are_accepted():
    res = _pipeline().generate(IDS, max_new_tokens=3, temperature=1e-4, seed=2**64 - 1)
    greedy = _pipeline().generate(IDS, max_new_tokens=3)
    assert res.tokens == greedy.tokens  # at the smallest temperature sampling is the argmax here


def test_a_request_cut_short_by_the_position_limit_says_so():
    from bastion.testing.reference import greedy_reference

    pipe = _pipeline()  # max_position_embeddings=64
    prompt = torch.arange(3, 63).view(1, 60) % 256
    res = pipe.generate(prompt, max_new_tokens=20, stop_on_eos=False)
    assert res.stop_reason == "position-limit" and 0 < len(res.tokens) < 20
    assert res.tokens == greedy_reference(pipe.target.model, prompt, len(res.tokens))
    full = pipe.generate(IDS, max_new_tokens=5, stop_on_eos=False)
    assert full.stop_reason == "length"


def test_the_ar_baseline_reports_the_position_limit_too():
    from bastion.bench.methods import ARDecoder

    prompt = torch.arange(3, 63).view(1, 60) % 256
    res = ARDecoder(_pipeline().target).generate(prompt, max_new_tokens=20)
    assert res.stop_reason == "position-limit" and len(res.tokens) < 20
