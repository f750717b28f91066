"""The plain batched step (W = 1, nothing drafted) costs what batched ``ar`` costs: one target forward
over every row's root, no trees, no drafter call, one host read; its records, its cache and its tokens
are exactly those of the tree path (greedy and seeded sampling)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bastion
from bastion.controllers.budget import BastionController
from bastion.huggingface.batched import HFTargetBatch
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.interfaces import Verifier
from bastion.contract.sampling import PositionalStream
from bastion.utils.sync import count_syncs
from bastion.contract.tree import Tree
from bastion.contract.types import SamplingConfig
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model
from bastion.verifiers.exact import ExactVerifier

LENGTHS = (1, 12, 5, 30, 3)


@functools.lru_cache(maxsize=None)
def _model(arch: str = "qwen3"):
    return tiny_model(arch, seed={"qwen3": 0, "llama": 1}[arch])


def _prompts(n: int = len(LENGTHS), seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (LENGTHS[k % len(LENGTHS)],), generator=gen).tolist() for k in range(n)]


@functools.lru_cache(maxsize=None)
def _hf_reference(arch: str, prompt: tuple[int, ...], new: int) -> list[int]:
    with torch.no_grad():
        out = _model(arch).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=0, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


class NeverDraft(BastionController):
    """The bastion controller whose batch gate never speculates: every batched step is plain."""

    def speculate_batch(self, context_lens, latency, costs):
        super().speculate_batch(context_lens, latency, costs)
        return False


class _CountingDrafter(NoisyOracleDrafter):
    proposals = 0

    def propose(self, step):
        type(self).proposals += 1
        return super().propose(step)


class _CountingTarget(HFTarget):
    forwards = 0

    def forward_rows(self, *args, **kwargs):
        type(self).forwards += 1
        return super().forward_rows(*args, **kwargs)


def _pipeline(arch: str = "qwen3", controller=None, target=None) -> bastion.Pipeline:
    model = _model(arch)
    return bastion.Pipeline(
        target or HFTarget(model),
        _CountingDrafter(model, block_size=4, noise=0.3),
        tree_builder="best-first",
        budget_controller=controller or NeverDraft(),
        max_nodes=8,
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_plain_batched_step_is_one_target_forward_no_draft_and_one_host_read(arch):
    pipe = _pipeline(arch, target=_CountingTarget(_model(arch)))
    prompts = _prompts()
    _CountingDrafter.proposals = 0
    _CountingTarget.forwards = 0
    with count_syncs() as syncs:
        results = pipe.generate_batch(prompts, max_new_tokens=7)
    steps = max(len(r.steps) for r in results)
    assert _CountingTarget.forwards == 1 + steps  # the prefill, then one forward per batched step
    assert _CountingDrafter.proposals == 0
    assert syncs.sites.count("verify") == steps  # each step reads its tokens once
    assert len(syncs.sites) - steps <= 2  # the prefill's read and the final sync: nothing else per step
    for prompt, res in zip(prompts, results):
        assert res.tokens == _hf_reference(arch, tuple(prompt), 7)
        for k, s in enumerate(res.steps):
            assert (s.drafted, s.budget, s.width, s.accepted, s.emitted) == (False, 1, 1, 0, 1)
            assert s.batch_size == sum(len(r.steps) > k for r in results)  # the rows still decoding
            assert s.context_len == len(prompt) + k  # committed before the step: the prompt and k roots
            assert s.timings.verify > 0


def test_batched_ar_and_the_plain_step_share_one_path_and_agree_with_generate():
    from bastion.bench.methods import ARDecoder

    target = HFTarget(_model())
    prompts = [torch.tensor(p) for p in _prompts()]
    ar = ARDecoder(target).generate_batch(prompts, max_new_tokens=6)
    plain = _pipeline(target=target).generate_batch(prompts, max_new_tokens=6)
    assert [r.tokens for r in ar] == [r.tokens for r in plain]
    assert [[s.context_len for s in r.steps] for r in ar] == [[s.context_len for s in r.steps] for r in plain]


def test_a_batch_of_one_prompt_decodes_as_a_single_sequence():
    pipe = _pipeline(controller=bastion.registry.create("budget_controller", "fixed", budget=4))
    prompt = _prompts(1)[0]
    (res,) = pipe.generate_batch([prompt], max_new_tokens=9)
    alone = pipe.generate(torch.tensor([prompt]), max_new_tokens=9)
    assert res.tokens == alone.tokens == _hf_reference("qwen3", tuple(prompt), 9)
    assert [s.budget for s in res.steps] == [s.budget for s in alone.steps]
    assert all(s.width is None for s in res.steps)  # single-sequence records, not a batch's


@given(steps=st.lists(st.integers(3, 255), min_size=1, max_size=4), drop=st.integers(0, 4))
@settings(max_examples=8, deadline=None)
def test_forward_next_equals_a_one_node_tree_step_and_commit_next_keeps_each_rows_cache(steps, drop):
    target = HFTarget(_model())
    prompts = [torch.tensor(p) for p in _prompts()]
    fast, ref = HFTargetBatch(target), HFTargetBatch(target)
    fast.prefill(prompts)
    ref.prefill(prompts)
    rows = list(range(len(prompts)))
    for k, token in enumerate(steps):
        b = len(rows)
        tokens = torch.tensor([(token + 11 * i) % 256 for i in range(b)])
        mine = fast.forward_next(tokens).logits  # [B, 1, V]
        theirs = ref.forward_trees([Tree.from_parents(tokens[i : i + 1], [-1]) for i in range(b)]).logits
        torch.testing.assert_close(mine, theirs[:, :1], atol=1e-5, rtol=1e-4)
        fast.commit_next()
        ref.commit([torch.zeros(1, dtype=torch.long)] * b)
        assert fast.context_lens == ref.context_lens
        for a, r in zip(fast.cache.layers, ref.cache.layers):
            for i, ctx in enumerate(fast.context_lens):
                torch.testing.assert_close(a.keys[i, :, :ctx], r.keys[i, :, :ctx], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(a.values[i, :, :ctx], r.values[i, :, :ctx], atol=1e-5, rtol=1e-4)
        if k == 0 and b > 1:  # a row leaves the batch after the first step
            keep = [i for i in range(b) if i != drop % b]
            fast.keep(keep)
            ref.keep(keep)
            rows = [rows[i] for i in keep]



@pytest.mark.parametrize("lengths", [(7,), (9, 9, 9)])
def test_an_unpadded_batch_decodes_plain_steps_without_a_mask_and_equals_one_node_tree_steps(lengths):
    target = HFTarget(_model())
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=gen) for n in lengths]
    fast, ref = HFTargetBatch(target), HFTargetBatch(target)
    fast.prefill(prompts)
    ref.prefill(prompts)
    masks = []
    forward_rows = target.forward_rows

    def spy(ids, mask, *args, **kwargs):
        masks.append(mask)
        return forward_rows(ids, mask, *args, **kwargs)

    b = len(prompts)
    for k in range(3):
        tokens = torch.tensor([(40 + 7 * k + 11 * i) % 256 for i in range(b)])
        target.forward_rows = spy
        mine = fast.forward_next(tokens).logits  # [B, 1, V]
        target.forward_rows = forward_rows
        theirs = ref.forward_trees([Tree.from_parents(tokens[i : i + 1], [-1]) for i in range(b)]).logits
        torch.testing.assert_close(mine, theirs[:, :1], atol=1e-5, rtol=1e-4)
        fast.commit_next()
        ref.commit([torch.zeros(1, dtype=torch.long)] * b)
        assert fast.context_lens == ref.context_lens == [n + k + 1 for n in lengths]
        for a, r in zip(fast.cache.layers, ref.cache.layers):
            torch.testing.assert_close(a.keys[:, :, : fast.context_lens[0]], r.keys[:, :, : ref.context_lens[0]], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(a.values[:, :, : fast.context_lens[0]], r.values[:, :, : ref.context_lens[0]], atol=1e-5, rtol=1e-4)
    assert masks == [None] * 3  # every row's context fills the slots: plain causal decoding, no mask built

def test_commit_next_without_a_pending_plain_forward_is_refused():
    from bastion.contract.errors import InvalidInputError

    state = HFTargetBatch(HFTarget(_model()))
    state.prefill([torch.tensor(p) for p in _prompts(2)])
    with pytest.raises(InvalidInputError, match="forward_next"):
        state.commit_next()
    with pytest.raises(InvalidInputError, match="one token per row"):
        state.forward_next(torch.tensor([5, 6, 7]))


class _RowOnlyVerifier(Verifier):
    def verify(self, tree, logits, sampling, generator=None):
        return ExactVerifier().verify(tree, logits, sampling, generator)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_next_tokens_of_the_exact_verifier_equal_the_default_through_one_node_trees(temperature):
    gen = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(6, 40, generator=gen) * 3  # [B, V]
    base = SamplingConfig(temperature=temperature, top_p=0.9 if temperature == 0.6 else 1.0)
    streams = [PositionalStream(100 + i) for i in range(6)]
    sampling = [base if base.greedy else s.for_tokens_at(base, torch.tensor([17 + i])) for i, s in enumerate(streams)]  # uniforms [1]
    roots = list(range(6))
    fast = ExactVerifier().next_tokens(roots, logits, sampling, [None] * 6)
    default = _RowOnlyVerifier().next_tokens(roots, logits, sampling, [None] * 6)
    assert fast == default
    if base.greedy:
        assert fast == logits.argmax(-1).tolist()


@pytest.mark.parametrize("controller", [NeverDraft, BastionController])
def test_seeded_rows_through_plain_steps_equal_each_prompt_sampled_alone(controller):
    pipe = _pipeline(controller=controller())
    prompts = _prompts(3, seed=9)
    kw = dict(max_new_tokens=8, temperature=1.0, seed=21, stop_on_eos=False)
    a = [r.tokens for r in pipe.generate_batch(prompts, **kw)]
    assert a == [r.tokens for r in pipe.generate_batch(prompts, **kw)]
    for i, prompt in enumerate(prompts):
        alone = pipe.generate(torch.tensor([prompt]), max_new_tokens=8, temperature=1.0, seed=21 + i, stop_on_eos=False)
        assert a[i] == alone.tokens
