"""Batched decoding is lossless per row: every row's greedy output equals that prompt decoded alone (by
``Pipeline.generate`` and by HF ``generate``), and the padded cache holds each row's exact context."""

from __future__ import annotations

import functools

import pytest
import torch

import bastion
from bastion.controllers.budget import BastionController
from bastion.contract.errors import InvalidInputError
from bastion.huggingface.batched import HFTargetBatch
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.interfaces import Verifier
from bastion.contract.target import Target
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model
from bastion.verifiers.exact import ExactVerifier

ARCHS = ("qwen3", "llama")
LENGTHS = (1, 3, 40, 6, 9, 14, 23, 31)
NEW = 12


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    return tiny_model(arch, seed={"qwen3": 0, "llama": 1}[arch])


def _prompts(arch: str, n: int, shift: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(len(arch) + 7 * shift)
    lengths = [LENGTHS[(k + shift) % len(LENGTHS)] for k in range(n)]
    return [torch.randint(3, 256, (length,), generator=gen).tolist() for length in lengths]


@functools.lru_cache(maxsize=None)
def _hf_reference(arch: str, prompt: tuple[int, ...], new: int, eos: int | None = None) -> list[int]:
    stop = {} if eos is None else {"eos_token_id": eos}  # default: the model's own EOS
    with torch.no_grad():
        out = _model(arch).generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=0, pad_token_id=0, **stop
        )
    return out[0, len(prompt) :].tolist()


def _controller(budget: int | None):
    if budget is None:
        return bastion.registry.create("budget_controller", "bastion")
    return bastion.registry.create("budget_controller", "fixed", budget=budget)


def _pipeline(arch: str, builder: str, budget: int | None, noise: float = 0.6, target: Target | None = None, **kw) -> bastion.Pipeline:
    model = _model(arch)
    kw.setdefault("budget_controller", _controller(budget))
    return bastion.Pipeline(
        target or HFTarget(model),
        NoisyOracleDrafter(model, block_size=6, noise=noise),
        tree_builder=builder,
        max_nodes=budget or 24,
        **kw,
    )


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("builder", bastion.registry.names("tree_builder"))
def test_every_batched_row_equals_its_prompt_decoded_alone_for_every_builder(arch, builder):
    offset = bastion.registry.names("tree_builder").index(builder)
    accepted = 0
    for k, (budget, size) in enumerate(((1, 2), (5, 7), (None, 4))):  # fixed and adaptive budgets
        pipe = _pipeline(arch, builder, budget)
        prompts = _prompts(arch, size, shift=offset + k)
        results = pipe.generate_batch(prompts, max_new_tokens=NEW)
        for prompt, res in zip(prompts, results):
            alone = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW)
            assert res.tokens == alone.tokens == _hf_reference(arch, tuple(prompt), NEW), (builder, budget, prompt)
            assert all(s.batch_size <= size and s.budget <= (budget or 24) for s in res.steps)
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0


@pytest.mark.parametrize("size", range(1, 9))
def test_batch_sizes_one_to_eight_match_hf_generate(size):
    arch = ARCHS[size % 2]
    pipe = _pipeline(arch, "best-first", 8 if size % 3 else None)
    prompts = _prompts(arch, size, shift=size)
    for prompt, res in zip(prompts, pipe.generate_batch(prompts, max_new_tokens=10)):
        assert res.tokens == _hf_reference(arch, tuple(prompt), 10)


class _EosTarget(HFTarget):
    def __init__(self, model, eos: int) -> None:
        super().__init__(model)
        self._eos = frozenset({eos})


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_stop_at_their_own_eos_even_inside_an_accepted_path(arch):
    prompts = _prompts(arch, 6, shift=3)
    free = [_hf_reference(arch, tuple(p), 24) for p in prompts]
    eos = free[0][5]  # a token row 0 emits mid-way; other rows meet it at other steps or never
    target = _EosTarget(_model(arch), eos)
    pipe = _pipeline(arch, "chain", 7, noise=0.0, target=target)  # a perfect drafter: long accepted paths
    results = pipe.generate_batch(prompts, max_new_tokens=24)
    stops = set()
    cut_inside_path = False
    for prompt, res in zip(prompts, results):
        ref = _hf_reference(arch, tuple(prompt), 24, eos=eos)
        assert res.tokens == ref == pipe.generate(torch.tensor([prompt]), max_new_tokens=24).tokens
        assert res.stop_reason == ("eos" if ref[-1] == eos else "length")
        stops.add(len(res.steps))
        cut_inside_path |= any(s.emitted < s.accepted + 1 for s in res.steps)
    assert len(stops) > 1  # rows left the batch at different steps
    assert cut_inside_path  # some EOS arrived inside an accepted path and cut it


def test_finished_rows_leave_the_batch():
    prompts = _prompts("qwen3", 4)
    pipe = _pipeline("qwen3", "best-first", 5)
    lengths = (3, 9, 5, 12)
    # rows with different token limits: run the batch to the longest and cut via stop_on_eos=False + max
    results = pipe.generate_batch(prompts, max_new_tokens=max(lengths))
    sizes = [s.batch_size for s in results[0].steps]
    assert sizes == sorted(sizes, reverse=True)
    eos_target = _EosTarget(_model("qwen3"), _hf_reference("qwen3", tuple(prompts[1]), 4)[2])
    pipe = _pipeline("qwen3", "best-first", 5, target=eos_target)
    results = pipe.generate_batch(prompts, max_new_tokens=12)
    longest = max(results, key=lambda r: len(r.steps))
    shortest = min(results, key=lambda r: len(r.steps))
    assert len(shortest.steps) < len(longest.steps)
    assert longest.steps[-1].batch_size < longest.steps[0].batch_size  # later steps ran without the finished row


class _CheckedBatch(HFTargetBatch):
    """After every commit, compares each row's cache entries with a fresh prefill of its tokens."""

    checks = 0

    def prefill(self, prompts, feature_layers=()):
        self.tokens = [p.reshape(-1).tolist() for p in prompts]
        return super().prefill(prompts, feature_layers)

    def forward_trees(self, trees, feature_layers=()):
        self.trees = list(trees)
        return super().forward_trees(trees, feature_layers)

    def commit(self, accepted_nodes):
        super().commit(accepted_nodes)
        for i, (tree, nodes) in enumerate(zip(self.trees, accepted_nodes)):
            self.tokens[i].extend(tree.tokens[nodes].tolist())
        self._check()

    def forward_next(self, tokens, feature_layers=()):
        self.next = tokens.tolist()
        return super().forward_next(tokens, feature_layers)

    def commit_next(self):  # a plain step
        super().commit_next()
        for i, tok in enumerate(self.next):
            self.tokens[i].append(tok)
        self._check()

    def _check(self):
        for i, toks in enumerate(self.tokens):
            fresh = HFTarget(self.target.model)
            fresh.prefill(torch.tensor([toks]))
            assert self._ctx[i] == len(toks)
            for mine, ref in zip(self.cache.layers, fresh.cache.layers):
                torch.testing.assert_close(mine.keys[i, :, : len(toks)], ref.keys[0], atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(mine.values[i, :, : len(toks)], ref.values[0], atol=1e-5, rtol=1e-4)
            type(self).checks += 1

    def keep(self, rows):
        super().keep(rows)
        self.tokens = [self.tokens[r] for r in rows]


class _CheckedTarget(HFTarget):
    def open_batch(self, prompts, feature_layers=()):
        state = _CheckedBatch(self)
        return state, state.prefill(prompts, feature_layers)


class _SwitchingController(BastionController):
    """Plain and speculative batched steps in turn (the bastion controller's decisions otherwise)."""

    steps = 0

    def speculate_batch(self, context_lens, latency, costs):
        type(self).steps += 1
        return type(self).steps % 2 == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rows_cache_equals_a_fresh_prefill_after_every_commit(arch):
    _CheckedBatch.checks = 0
    pipe = _pipeline(arch, "best-first", 6, target=_CheckedTarget(_model(arch)), budget_controller=_SwitchingController())
    prompts = _prompts(arch, 4, shift=2)
    results = pipe.generate_batch(prompts, max_new_tokens=8)
    assert _CheckedBatch.checks >= 4 * 3
    kinds = {s.drafted for r in results for s in r.steps}
    assert kinds == {True, False}  # both the tree commit and the plain step's commit were checked
    for prompt, res in zip(prompts, results):
        assert res.tokens == _hf_reference(arch, tuple(prompt), 8)


class _SingleTarget(Target):
    """A Target with no batched state: delegates everything to an HFTarget except ``open_batch``."""

    def __init__(self, inner: HFTarget) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    vocab_size = property(lambda self: self.inner.vocab_size)
    config = property(lambda self: self.inner.config)
    device = property(lambda self: self.inner.device)
    dtype = property(lambda self: self.inner.dtype)
    max_positions = property(lambda self: self.inner.max_positions)
    eos_token_ids = property(lambda self: self.inner.eos_token_ids)
    context_len = property(lambda self: self.inner.context_len)

    def reset(self):
        self.inner.reset()

    def prefill(self, input_ids, feature_layers=()):
        return self.inner.prefill(input_ids, feature_layers)

    def forward_tree(self, tree, feature_layers=()):
        return self.inner.forward_tree(tree, feature_layers)

    def commit(self, accepted_nodes):
        self.inner.commit(accepted_nodes)

    def input_embeddings(self):
        return self.inner.input_embeddings()

    def output_head(self):
        return self.inner.output_head()


class _RowOnlyVerifier(Verifier):
    """A third-party verifier with only the single-sequence method."""

    calls = 0

    def verify(self, tree, logits, sampling, generator=None):
        type(self).calls += 1
        return ExactVerifier().verify(tree, logits, sampling, generator)


def test_single_sequence_components_still_decode_a_batch():
    prompts = _prompts("llama", 3, shift=1)
    pipe = _pipeline("llama", "best-first", 5, verifier=_RowOnlyVerifier())
    _RowOnlyVerifier.calls = 0
    for prompt, res in zip(prompts, pipe.generate_batch(prompts, max_new_tokens=8)):
        assert res.tokens == _hf_reference("llama", tuple(prompt), 8)
    assert _RowOnlyVerifier.calls >= 3  # the default verify_batch looped over the rows
    plain = _pipeline("llama", "best-first", 5, target=_SingleTarget(HFTarget(_model("llama"))))
    for prompt, res in zip(prompts, plain.generate_batch(prompts, max_new_tokens=8)):
        assert res.tokens == _hf_reference("llama", tuple(prompt), 8)
        assert all(s.batch_size == 1 for s in res.steps)  # decoded row by row


def test_bad_batch_input_errors_name_the_row():
    pipe = _pipeline("qwen3", "best-first", 4)
    with pytest.raises(InvalidInputError, match="non-empty list"):
        pipe.generate_batch([])
    with pytest.raises(InvalidInputError, match="prompt 1"):
        pipe.generate_batch([[5, 6], [], [7]])
    with pytest.raises(InvalidInputError, match="prompt 2.*positions"):
        pipe.generate_batch([[5], [6], [7] * 600])
    with pytest.raises(InvalidInputError, match="prompt 1.*device"):
        pipe.generate_batch([torch.tensor([5, 6]), torch.tensor([7], device="meta")])
    with pytest.raises(InvalidInputError, match="prompt 0"):
        pipe.generate_batch([[300]])
    with pytest.raises(InvalidInputError, match="max_new_tokens"):
        pipe.generate_batch([[5]], max_new_tokens=0)
