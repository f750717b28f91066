"""Seeded sampling: a counter-based uniform per absolute position makes the emitted tokens independent
of trees, budgets and timings, equal to plain autoregressive sampling with the same seed, and lossless."""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import bastion
from bastion.contract.errors import InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.interfaces import LatencyModel
from bastion.contract.sampling import PositionalStream, at_position, inverse_cdf_sample, position_uniform, position_uniforms
from bastion.contract.types import SamplingConfig
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import sampling_reference
from bastion.testing.tiny import tiny_model

MASK = (1 << 64) - 1


def _splitmix64(seed: int, position: int) -> float:
    """Pure-Python reference of the stream: splitmix64 of (mixed seed + position * golden)."""

    def mix(z: int) -> int:
        z &= MASK
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    return (mix(mix(seed) + position * 0x9E3779B97F4A7C15) >> 11) * 2.0**-53


@given(st.integers(0, 2**64 - 1), st.lists(st.integers(0, 2**40), min_size=1, max_size=8))
def test_position_uniforms_equal_the_pure_python_splitmix64_stream(seed, positions):
    got = position_uniforms(seed, torch.tensor(positions)).tolist()
    assert got == [_splitmix64(seed, p) for p in positions]
    assert all(0.0 <= u < 1.0 for u in got)


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40))
def test_host_uniform_of_one_position_equals_the_tensor_stream_bit_for_bit(seed, position):
    assert position_uniform(seed, position) == float(position_uniforms(seed, torch.tensor(position)))


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**30), st.sampled_from([None, 1, 3]))
def test_at_position_carries_the_positions_uniform_for_every_row(seed, position, rows):
    got = at_position(SamplingConfig(temperature=0.7), PositionalStream(seed), position, rows=rows).uniforms
    assert got.dtype == torch.float64 and tuple(got.shape) == (() if rows is None else (rows,))
    want = position_uniforms(seed, torch.tensor(position))
    assert torch.equal(got, want.expand(got.shape))


def test_position_uniforms_are_uniform_and_differ_between_seeds():
    u = position_uniforms(3, torch.arange(20000))
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0)
    assert float((hist - 2000).abs().max()) < 200  # ~4.7 sigma of a binomial(20000, 0.1)
    assert not torch.equal(u[:64], position_uniforms(4, torch.arange(64)))


@st.composite
def _probs_and_uniform(draw):
    v = draw(st.integers(1, 12))
    weights = draw(st.lists(st.sampled_from([0.0, 0.0, 1e-9, 0.1, 1.0, 3.0]), min_size=v, max_size=v))
    if not any(weights):
        weights[draw(st.integers(0, v - 1))] = 1.0
    u = draw(st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(1.0 - 2.0**-53), st.just(0.0)))
    return weights, u


@given(_probs_and_uniform())
def test_inverse_cdf_returns_the_first_token_whose_cumulative_mass_exceeds_u(case):
    weights, u = case
    token = int(inverse_cdf_sample(torch.tensor(weights), torch.tensor(u, dtype=torch.float64)))
    assert weights[token] > 0  # never a token of zero probability
    total = sum(weights)
    below = sum(weights[:token])
    if sum(weights[: token + 1]) < total:  # not the rounding fallback at the very end
        assert below <= u * total * (1 + 1e-12) and u * total < below + weights[token]


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3])
    draws = inverse_cdf_sample(probs.expand(20000, -1), position_uniforms(11, torch.arange(20000)))
    freq = torch.bincount(draws, minlength=4).double() / 20000
    assert freq[1] == 0
    torch.testing.assert_close(freq, probs.double(), atol=0.015, rtol=0)


def test_sample_tokens_rejects_uniforms_of_the_wrong_shape():
    from bastion.contract.sampling import sample_tokens

    bad = SamplingConfig(temperature=1.0, uniforms=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(InvalidInputError, match="uniforms"):
        sample_tokens(torch.zeros(2, 5), bad)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "7"])
def test_stream_rejects_seeds_outside_the_64_bit_range_or_not_int(seed):
    with pytest.raises(InvalidInputError, match="seed"):
        PositionalStream(seed)


# ----------------------------------------------------------------------------- pipeline
VOCAB = 16
PROMPT = [3, 5, 4, 7, 1]


@functools.lru_cache(maxsize=None)
def _model():
    model = tiny_model("qwen3", seed=5, vocab_size=VOCAB)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.3)  # several likely tokens per position
    return model


def _pipeline(controller) -> bastion.Pipeline:
    model = _model()
    return bastion.Pipeline(
        HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=0.5), budget_controller=controller, max_nodes=12
    )


class _JitteryClock:
    """``time`` stand-in whose perf_counter jumps by random amounts (a busy machine, exaggerated)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._t = 0.0

    def perf_counter(self) -> float:
        self._t += self._rng.expovariate(1.0) * 1e-3
        return self._t


class _JitteryLatency(LatencyModel):
    """Verify-time predictions whose per-token slope changes at random with every observation, as an
    online fit chasing noisy timings does: the adaptive controller's budgets vary from run to run."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._slope = 1e-4

    def predict(self, n_tokens: int, context_len: int) -> float:
        return 1e-3 + self._slope * n_tokens

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        self._slope = 10 ** self._rng.uniform(-5, -2)


def test_adaptive_controller_with_timing_jitter_gives_the_same_seeded_tokens(monkeypatch):
    import bastion.engine.engine as engine_mod
    import bastion.engine.observer as observer_mod

    ids = torch.tensor([PROMPT])
    outputs, budgets = set(), set()
    model = _model()
    for run in range(4):
        rng = random.Random(run)
        clock = _JitteryClock(rng)
        monkeypatch.setattr(engine_mod, "time", clock)
        monkeypatch.setattr(observer_mod, "time", clock)
        pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=0.5),
                                budget_controller="bastion", latency_model=_JitteryLatency(rng), max_nodes=12)
        res = pipe.generate(ids, max_new_tokens=24, temperature=1.0, seed=7, stop_on_eos=False)
        outputs.add(tuple(res.tokens))
        budgets.add(tuple(s.budget for s in res.steps))
    assert len(budgets) > 1  # the jitter really changed the trees
    assert len(outputs) == 1
    assert list(outputs.pop()) == sampling_reference(model, ids, 24, 7)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 5, 0.9)])
def test_seeded_tokens_equal_plain_autoregressive_sampling_whatever_the_budget(temperature, top_k, top_p):
    ids = torch.tensor([PROMPT])
    expected = sampling_reference(_model(), ids, 16, 123, temperature=temperature, top_k=top_k, top_p=top_p)
    accepted = 0
    for budget in (1, 3, 12):
        pipe = _pipeline(bastion.registry.create("budget_controller", "fixed", budget=budget))
        res = pipe.generate(ids, max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p, seed=123,
                            stop_on_eos=False)
        assert res.tokens == expected, budget
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0  # drafted tokens were accepted: the tree path decided some tokens


def test_different_seeds_give_different_tokens():
    ids = torch.tensor([PROMPT])
    pipe = _pipeline(bastion.registry.create("budget_controller", "fixed", budget=4))
    outs = {tuple(pipe.generate(ids, max_new_tokens=12, temperature=1.0, seed=s, stop_on_eos=False).tokens) for s in range(4)}
    assert len(outs) > 1


def test_unseeded_runs_follow_torch_manual_seed():
    ids = torch.tensor([PROMPT])
    pipe = _pipeline(bastion.registry.create("budget_controller", "fixed", budget=4))
    runs = []
    for _ in range(2):
        torch.manual_seed(99)
        runs.append(pipe.generate(ids, max_new_tokens=10, temperature=1.0, stop_on_eos=False).tokens)
    assert runs[0] == runs[1]


def test_nodes_of_one_depth_share_the_uniform_of_their_position():
    stream = PositionalStream(5)
    depths = torch.tensor([0, 1, 1, 2, 1, 2])
    u = stream.for_tree(SamplingConfig(temperature=1.0), 10, depths).uniforms
    for i, j in itertools.combinations(range(len(depths)), 2):
        assert (u[i] == u[j]) == (depths[i] == depths[j])
    assert float(u[0]) == float(position_uniforms(5, torch.tensor(11)))


def test_ar_baseline_samples_the_same_tokens_as_the_pipeline_for_a_seed():
    from bastion.bench.methods import ARDecoder

    ids = torch.tensor([PROMPT])
    ar = ARDecoder(HFTarget(_model())).generate(ids, max_new_tokens=12, temperature=1.0, seed=31)
    assert ar.tokens == sampling_reference(_model(), ids, 12, 31)[: len(ar.tokens)]
