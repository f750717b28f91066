"""The opt-in compiled verify path (static slots, bucket padding, torch.compile) is lossless."""

from __future__ import annotations

import functools
import random

import pytest
import torch

import bastion
from bastion.huggingface.compiled_verify import CompileOptions, SlotLayer, compile_options
from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.tree import Tree
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model

dynamo = pytest.importorskip("torch._dynamo")
if not dynamo.is_dynamo_supported():  # pragma: no cover - platforms without torch.compile
    pytest.skip("torch.compile is not supported on this platform", allow_module_level=True)

#: fast CPU backends: dynamo's tracing (and AOT functionalisation) without a C++ compile
FAST = dict(backend="eager")


@functools.lru_cache(maxsize=None)
def _model(arch: str = "qwen3"):
    return tiny_model(arch, seed={"qwen3": 0, "llama": 1}[arch])


def _random_tree(rng: random.Random, n: int) -> Tree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return Tree.from_parents(torch.tensor([rng.randrange(3, 250) for _ in range(n)]), parents)


def _accepted_path(rng: random.Random, tree: Tree) -> torch.Tensor:
    leaf = rng.randrange(len(tree))
    return torch.tensor(tree.path(leaf))


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_compiled_verify_logits_and_features_equal_eager_over_random_trees_commits_and_cache_growth(arch: str) -> None:
    model = _model(arch)
    eager = HFTarget(model)
    # capacity 24 forces the slot cache to grow (twice) during the run; bucket 8 is smaller than some trees,
    # which then run the same static forward unpadded
    compiled = HFTarget(model, compile=dict(buckets=(2, 8), capacity=24, **FAST))
    layers = (0, model.config.num_hidden_layers - 1)  # a middle layer (tap) and the last (final norm)
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(3)
    for request in range(2):  # a second request reuses the slots and rewrites every mask buffer
        prompt = torch.randint(3, 250, (1, 5 + 11 * request), generator=gen)
        a, b = eager.prefill(prompt, layers), compiled.prefill(prompt, layers)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.features, a.features, rtol=1e-5, atol=1e-5)
        for _ in range(12):
            tree = _random_tree(rng, rng.choice([1, 2, 3, 7, 8, 11]))
            a, b = eager.forward_tree(tree, layers), compiled.forward_tree(tree, layers)
            assert b.logits.shape == a.logits.shape == (len(tree), eager.vocab_size)
            torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b.features, a.features, rtol=1e-5, atol=1e-5)
            path = _accepted_path(rng, tree)
            eager.commit(path)
            compiled.commit(path)
            assert compiled.context_len == eager.context_len
    assert isinstance(compiled.cache.layers[0], SlotLayer)
    assert compiled.cache.layers[0].keys.shape[2] > 24  # grew from the requested capacity


def _pipeline(target: HFTarget, budget: int) -> bastion.Pipeline:
    model = target.model
    return bastion.Pipeline(
        target,
        NoisyOracleDrafter(model, block_size=6, noise=0.6),
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=budget),
        max_nodes=budget,
    )


def test_compiled_greedy_decoding_equals_eager_and_hf_generate_and_really_compiles() -> None:
    model = _model("qwen3")
    gen = torch.Generator().manual_seed(11)
    before = _unique_graphs()
    compiled = HFTarget(model, compile=dict(buckets=(1, 4, 8), backend="aot_eager"))
    eager = HFTarget(model)
    for length, budget in ((9, 5), (23, 8), (3, 12)):  # padded to 8; exactly 8; above every bucket (eager)
        prompt = torch.randint(3, 250, (1, length), generator=gen)
        with torch.no_grad():
            ref = model.generate(prompt, do_sample=False, max_new_tokens=24, min_new_tokens=0)[0, length:].tolist()
        assert _pipeline(eager, budget).generate(prompt, max_new_tokens=24).tokens == ref
        assert _pipeline(compiled, budget).generate(prompt, max_new_tokens=24).tokens == ref
    assert _unique_graphs() > before  # the compiled runner ran (not silently the eager forward)


def test_compile_option_is_off_by_default_and_the_pipeline_aligns_controller_and_graph_buckets(tiny_qwen3_dir) -> None:
    model = _model("qwen3")
    assert HFTarget(model).compiled is None
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4), max_nodes=16)
    opts = pipe.compile_verify(dict(buckets=(1, 3, 9), **FAST))
    assert opts is not None and opts.buckets == (1, 3, 9)
    assert pipe.budget_controller.buckets == (1, 3, 9)  # the controller now chooses the compiled sizes
    assert pipe.compile_verify(False) is None and pipe.budget_controller.buckets is None  # given back
    # a controller with its own buckets lends them to the compiled path
    ctrl = bastion.registry.create("budget_controller", "bastion", buckets=[2, 6])
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4), budget_controller=ctrl, max_nodes=16)
    assert pipe.compile_verify(FAST).buckets == (2, 6)
    assert pipe.target.compiled.buckets == (2, 6)
    assert pipe.compile_verify(False) is None and pipe.target.compiled is None
    loaded = bastion.Pipeline.from_pretrained(tiny_qwen3_dir, NoisyOracleDrafter(model, block_size=4), compile=FAST)
    assert loaded.target.compiled is not None


def test_bad_compile_options_raise_the_projects_input_error() -> None:
    with pytest.raises(InvalidInputError):
        CompileOptions(buckets=())
    with pytest.raises(InvalidInputError):
        CompileOptions(buckets=(0, 4))
    with pytest.raises(InvalidInputError):
        CompileOptions(capacity=1)
    with pytest.raises(InvalidInputError):
        compile_options("yes")
    with pytest.raises(InvalidInputError):
        compile_options({"bucket": [1]})
    assert compile_options(False) is None and compile_options(True) == CompileOptions()
    assert CompileOptions(buckets=(8, 2, 2)).buckets == (2, 8)
    assert CompileOptions(buckets=(2, 8)).bucket(3) == 8 and CompileOptions(buckets=(2, 8)).bucket(9) == 9


def test_compiled_path_refuses_a_target_with_sliding_window_layers() -> None:
    from bastion.huggingface.compiled_verify import StaticVerify

    model = _model("qwen3")
    cfg = model.config
    saved = getattr(cfg, "layer_types", None)
    cfg.layer_types = ["sliding_attention"] + ["full_attention"] * (cfg.num_hidden_layers - 1)
    try:
        with pytest.raises(IncompatibleComponentsError):
            StaticVerify(model, CompileOptions(), 256)
    finally:
        cfg.layer_types = saved
