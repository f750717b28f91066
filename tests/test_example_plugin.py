"""The example plugin (plugins/bastion-example-drafter) is found through its real entry point and
decodes losslessly inside a Pipeline."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import bastion
from bastion.contract.registry import ENTRY_POINT_GROUP, Registry
from bastion.testing import check_component
from bastion.testing.reference import greedy_reference

DIST = "bastion-example-drafter"
INSTALL_HINT = "install it first: pip install -e plugins/bastion-example-drafter"


@pytest.fixture(scope="module")
def dist() -> importlib.metadata.Distribution:
    try:
        return importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"the example plugin distribution {DIST!r} is not installed; {INSTALL_HINT}")


def _greedy_reference(target_dir, prompt: torch.Tensor, n: int) -> list[int]:
    """The target's own greedy continuation, one full forward per token (no cache, no bastion code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    return greedy_reference(model, prompt, n)


def test_example_plugin_declares_an_entry_point_in_the_bastion_group(dist):
    eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
    assert [(ep.name, ep.value) for ep in eps] == [("example_drafter", "bastion_example_drafter.hooks")]


def test_example_drafter_is_discovered_through_entry_points_with_its_distribution_as_source(dist):
    info = Registry().info("drafter", "example-ngram")
    assert info.source == DIST
    assert info.plugin == "example_drafter"
    assert bastion.registry.info("drafter", "example-ngram").source == DIST


def test_example_drafter_created_by_name_passes_the_drafter_contract(dist):
    check_component("drafter", "example-ngram", options={"vocab_size": 97, "depth": 5}, vocab_size=97)


def test_example_drafter_in_a_pipeline_matches_the_targets_greedy_decoding(dist, tiny_qwen3_dir):
    pipe = bastion.Pipeline.from_pretrained(tiny_qwen3_dir, "example-ngram", max_nodes=16)
    assert type(pipe.drafter).__module__ == "bastion_example_drafter.drafter"
    prompt = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9, 17, 5, 9]])
    res = pipe.generate(prompt, max_new_tokens=16, stop_on_eos=False)
    assert res.tokens == _greedy_reference(tiny_qwen3_dir, prompt, 16)
    assert sum(s.emitted for s in res.steps) + 1 == len(res.tokens)
    assert all(1 <= s.budget <= 16 for s in res.steps)


def test_example_drafter_in_a_pipeline_samples_valid_tokens_reproducibly(dist, tiny_qwen3_dir):
    """Valid: with top_k=3 every emitted token is among the target's own 3 most likely next tokens
    (checked with the plain HF model); reproducible: the same seed gives the same tokens."""
    from transformers import AutoModelForCausalLM

    fixed = bastion.registry.create("budget_controller", "fixed", budget=8)
    pipe = bastion.Pipeline.from_pretrained(tiny_qwen3_dir, "example-ngram", budget_controller=fixed)
    prompt = torch.tensor([[3, 4, 5, 3, 4]])
    a = pipe.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=3, seed=7, stop_on_eos=False)
    b = pipe.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=3, seed=7, stop_on_eos=False)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor([a.tokens])], dim=1)).logits[0]  # [L + 12, V]
    top3 = logits[prompt.shape[1] - 1 : -1].topk(3, dim=-1).indices  # [12, 3] allowed token at each position
    outside = [(i, t) for i, t in enumerate(a.tokens) if t not in top3[i].tolist()]
    assert not outside, f"tokens outside the target's top-3: {outside}"
    assert all(s.budget <= 8 for s in a.steps)
