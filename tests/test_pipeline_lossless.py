"""Greedy decoding through the pipeline is token-for-token the target's own greedy decoding."""

from __future__ import annotations

import functools

import pytest
import torch

import bastion
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.tree import Tree
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


BUDGETS = (1, 5, 24)
ARCHS = ("qwen3", "llama")
NEW_TOKENS = 20


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    return tiny_model(arch, seed={"qwen3": 0, "llama": 1}[arch])


def _prompts(arch: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(len(arch))
    return [torch.randint(3, 256, (int(length),), generator=gen).tolist() for length in (1, 3, 6, 9, 14, 23, 31, 40)]


@functools.lru_cache(maxsize=None)
def _reference(arch: str, prompt: tuple[int, ...], max_new: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = _model(arch).generate(ids, do_sample=False, max_new_tokens=max_new, min_new_tokens=0)
    return out[0, len(prompt) :].tolist()


def _pipeline(arch: str, tree_builder: str, budget: int, noise: float = 0.6, target=None, **drafter_kw) -> bastion.Pipeline:
    model = _model(arch)
    target = target or HFTarget(model)
    drafter = NoisyOracleDrafter(model, block_size=drafter_kw.pop("block_size", 6), noise=noise, **drafter_kw)
    return bastion.Pipeline(
        target,
        drafter,
        tree_builder=tree_builder,
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=budget),
        latency_model="roofline",
        verifier="exact",
        max_nodes=max(budget, 1),
    )


def test_every_core_tree_builder_is_registered():
    assert {"best-first", "chain", "static"} <= set(bastion.registry.names("tree_builder"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree_builder", bastion.registry.names("tree_builder"))
def test_greedy_output_equals_hf_generate_for_every_builder_and_budget(arch, tree_builder):
    prompts = _prompts(arch)
    offset = bastion.registry.names("tree_builder").index(tree_builder)
    accepted = 0
    for i, budget in enumerate(BUDGETS):
        pipe = _pipeline(arch, tree_builder, budget)
        for prompt in (prompts[(offset + 2 * i) % len(prompts)], prompts[(offset + 2 * i + 1) % len(prompts)]):
            res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, temperature=0.0)
            assert res.tokens == _reference(arch, tuple(prompt)), f"{tree_builder} budget {budget} prompt {prompt}"
            assert all(s.budget <= budget for s in res.steps)
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0  # the drafter is good enough that some drafted tokens were accepted


class _CheckedTarget(HFTarget):
    """An HFTarget that, after every commit, compares its cache with a fresh prefill."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.committed: list[int] = []
        self.checks = 0
        self._tree: Tree | None = None

    def prefill(self, input_ids, feature_layers=(), **kwargs):
        self.committed = input_ids[0].tolist()
        return super().prefill(input_ids, feature_layers, **kwargs)

    def forward_tree(self, tree, feature_layers=()):
        self._tree = tree
        return super().forward_tree(tree, feature_layers)

    def commit(self, accepted_nodes):
        super().commit(accepted_nodes)
        self.committed += self._tree.tokens[accepted_nodes].tolist()
        fresh = HFTarget(self.model)
        fresh.prefill(torch.tensor([self.committed]))
        assert self.context_len == len(self.committed)
        for got, want in zip(self.cache.layers, fresh.cache.layers, strict=True):
            torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got.values, want.values, atol=1e-4, rtol=1e-4)
        self.checks += 1


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_equals_fresh_prefill_after_every_commit(arch):
    target = _CheckedTarget(_model(arch))
    pipe = _pipeline(arch, "best-first", 16, target=target)
    prompt = _prompts(arch)[4]
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=16)
    assert target.checks == len(res.steps) > 0
    assert res.tokens == _reference(arch, tuple(prompt), 16)
    # committed = prompt + every emitted token except the last bonus, which is the next (uncommitted) root
    assert target.committed == prompt + res.tokens[:-1]


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 13])
def test_max_new_tokens_is_never_exceeded_and_output_is_a_prefix_of_greedy(max_new):
    pipe = _pipeline("qwen3", "best-first", 24, noise=0.0)  # perfect drafter: deep trees every step
    prompt = _prompts("qwen3")[2]
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=max_new)
    assert len(res.tokens) == max_new
    assert res.tokens == _reference("qwen3", tuple(prompt))[:max_new]
    assert res.stop_reason == "length"
    assert sum(s.emitted for s in res.steps) + 1 == max_new  # the first token comes from the prefill


def test_eos_inside_an_accepted_path_stops_and_discards_later_tokens():
    model = tiny_model("qwen3", seed=0)
    prompt = _prompts("qwen3")[3]
    greedy = _reference("qwen3", tuple(prompt))
    cut = next(j for j in range(4, NEW_TOKENS) if greedy[j] not in greedy[:j])  # first fresh token past 4
    eos = greedy[cut]
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    pipe = _pipeline("qwen3", "chain", 24, noise=0.0, target=HFTarget(model))  # accepts whole chains
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert res.tokens == hf[0, len(prompt) :].tolist() == greedy[: cut + 1]
    assert res.stop_reason == "eos"
    last = res.steps[-1]
    assert last.emitted < last.accepted + 1  # EOS came from inside the accepted path, the rest was dropped


def test_step_records_account_for_every_token_and_stage():
    pipe = _pipeline("llama", "best-first", 12, noise=0.3)
    res = pipe.generate(torch.tensor([_prompts("llama")[5]]), max_new_tokens=NEW_TOKENS)
    assert len(res.tokens) == NEW_TOKENS
    assert sum(s.emitted for s in res.steps) + 1 == len(res.tokens)
    assert res.acceptance_length == pytest.approx(sum(s.accepted + 1 for s in res.steps) / len(res.steps))
    assert res.acceptance_length > 1.5
    ctx = len(_prompts("llama")[5])
    for s in res.steps:
        assert 1 <= s.budget <= 12 and 0 <= s.accepted < s.budget
        assert s.context_len == ctx
        ctx += s.accepted + 1
        assert s.predicted_accept >= 1.0
        assert s.timings.verify > 0 and s.timings.draft > 0
    # the stages partition each step: together with the prefill they account for the wall time (no
    # stage counted twice, none left out; the loop's own bookkeeping is the small remainder)
    staged = res.prefill_s + sum(s.timings.total for s in res.steps)
    assert staged <= res.wall_s
    assert staged >= 0.7 * res.wall_s, (staged, res.wall_s)


def test_target_features_reach_the_drafter_for_every_committed_position():
    model = _model("qwen3")
    drafter = NoisyOracleDrafter(model, block_size=4, noise=0.5, feature_layers=(0, 1))
    pipe = bastion.Pipeline(
        HFTarget(model),
        drafter,
        tree_builder="best-first",
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=8),
        max_nodes=8,
    )
    prompt = _prompts("qwen3")[4]
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=12)
    assert res.tokens == _reference("qwen3", tuple(prompt))[:12]
    assert drafter.features_seen == len(prompt) + sum(s.accepted + 1 for s in res.steps)


def test_default_components_decode_losslessly_with_the_bastion_controller():
    model = _model("llama")
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=6, noise=0.6), max_nodes=32)
    prompt = _prompts("llama")[6]
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
    assert res.tokens == _reference("llama", tuple(prompt))


def test_from_pretrained_loads_a_local_target_and_decodes_losslessly(tiny_llama_dir):
    model = _model("llama")
    pipe = bastion.Pipeline.from_pretrained(
        tiny_llama_dir,
        NoisyOracleDrafter(model, block_size=5, noise=0.5),
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=10),
    )
    assert isinstance(pipe.target, HFTarget) and pipe.target.attn_implementation == "sdpa"
    prompt = _prompts("llama")[1]
    assert pipe.generate(torch.tensor([prompt]), max_new_tokens=10).tokens == _reference("llama", tuple(prompt))[:10]
