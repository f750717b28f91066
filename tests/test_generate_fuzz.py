"""Fuzzing generate's arguments: every input either decodes losslessly (greedy: the target's own greedy
tokens; seeded sampling: plain autoregressive sampling with the same seed) or raises one of bastion's
errors, never another exception type."""

from __future__ import annotations

import functools
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bastion
from bastion.contract.errors import BastionError
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import greedy_reference, sampling_reference
from bastion.testing.tiny import tiny_model

VOCAB, MAX_POS, EOS = 32, 20, 2


@functools.lru_cache(maxsize=None)
def _model():
    model = tiny_model("qwen3", seed=4, vocab_size=VOCAB, max_position_embeddings=MAX_POS)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.4)
    return model


@functools.lru_cache(maxsize=None)
def _pipeline() -> bastion.Pipeline:
    model = _model()
    return bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=3, noise=0.5), max_nodes=6)


def mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` four times out of five, else ``invalid``: most examples decode, the rest probe errors."""
    return st.sampled_from([valid, valid, valid, valid, invalid]).flatmap(lambda strategy: strategy)


ints = st.integers(-3, VOCAB + 3)
prompts = mostly(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10).map(lambda xs: torch.tensor([xs])),
    st.one_of(
        st.lists(ints, min_size=0, max_size=8).map(lambda xs: torch.tensor([xs], dtype=torch.long).view(1, -1)),
        st.lists(st.integers(0, VOCAB - 1), min_size=MAX_POS - 1, max_size=MAX_POS + 2).map(lambda xs: torch.tensor([xs])),
        st.lists(st.one_of(ints, st.floats(-2, 40), st.booleans()), min_size=0, max_size=6),
        st.lists(ints, min_size=1, max_size=6).map(lambda xs: torch.tensor(xs)),  # 1-D
        st.lists(ints, min_size=1, max_size=6).map(lambda xs: torch.tensor([xs, xs])),  # batch of 2
        st.lists(ints, min_size=1, max_size=6).map(lambda xs: torch.tensor([xs], dtype=torch.float32)),
        st.sampled_from([None, "a prompt", 7, 3.5]),
    ),
)
max_new = mostly(st.integers(1, 14), st.sampled_from([0, -2, 0.5, 3.0, True, None, "4"]))
temperatures = mostly(
    st.one_of(st.just(0.0), st.floats(0.05, 3.0), st.just(1e-4)),
    st.sampled_from([1e-45, -1.0, math.nan, math.inf, "1.0", None, True]),
)
seeds = mostly(st.sampled_from([0, 7, 123456789, 2**64 - 1, None]), st.sampled_from([2**64, -1, 1.5, "7", True]))
top_ps = mostly(st.sampled_from([1.0, 0.9, 0.5]), st.sampled_from([0.0, 1.5, math.nan, "0.9"]))
top_ks = mostly(st.sampled_from([0, 1, 4, VOCAB + 10]), st.sampled_from([-1, 2.5, True, None]))


def _truncate_at_eos(tokens: list[int], stop_on_eos: bool) -> list[int]:
    if stop_on_eos and EOS in tokens:
        return tokens[: tokens.index(EOS) + 1]
    return tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts, max_new, temperatures, seeds, top_ps, top_ks, st.booleans())
def test_generate_decodes_losslessly_or_raises_a_bastion_error(prompt, max_new_tokens, temperature, seed, top_p, top_k, stop_on_eos):
    pipe = _pipeline()
    try:
        res = pipe.generate(prompt, max_new_tokens, temperature, seed, top_p=top_p, top_k=top_k, stop_on_eos=stop_on_eos)
    except BastionError:
        return  # documented failure: the only kind allowed
    ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1)  # 1-D prompts are accepted too
    assert 0 < len(res.tokens) <= max_new_tokens
    assert all(0 <= t < VOCAB for t in res.tokens)
    if temperature == 0:
        expected = greedy_reference(_model(), ids, len(res.tokens))
    elif seed is not None:
        expected = sampling_reference(_model(), ids, len(res.tokens), seed, temperature=temperature, top_k=top_k, top_p=top_p)
    else:
        expected = res.tokens  # unseeded sampling: only the invariants below
    assert res.tokens == _truncate_at_eos(expected, stop_on_eos)
    if res.stop_reason == "eos":
        assert stop_on_eos and res.tokens[-1] == EOS
    elif res.stop_reason == "length":
        assert len(res.tokens) == max_new_tokens
    else:
        assert res.stop_reason == "position-limit" and ids.shape[1] + len(res.tokens) >= MAX_POS - 1
