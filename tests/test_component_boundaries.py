"""Plugin components are checked at their boundary by default: trees against the root and ``max_nodes``
whatever the builder declares, greedy verdicts of a verifier that is not bastion's own against the
target's argmax, prompts handed to a plugin drafter as copies, exceptions re-raised naming the component
and its plugin, and a plugin whose hook fails registers nothing. Each case decoded wrong output, or raised
an error naming nothing, before these checks."""

from __future__ import annotations

import functools
import types

import pytest
import torch

import bastion
from bastion.core import BastionError, ComponentError, TreeValidationError, Tree, Verdict
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.registry import Registry
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import greedy_reference
from bastion.trees.best_first import BestFirstBuilder
from bastion.verifiers.exact import ExactVerifier

PROMPT = torch.tensor([[5, 6, 7, 8]])


@functools.lru_cache(maxsize=None)
def _model():
    from bastion.testing.tiny import tiny_model

    return tiny_model("qwen3", seed=2)


def _pipe(**kw) -> bastion.Pipeline:
    model = _model()
    kw.setdefault("drafter", NoisyOracleDrafter(model, block_size=4, noise=0.5))
    kw.setdefault("budget_controller", bastion.registry.create("budget_controller", "fixed", budget=8))
    return bastion.Pipeline(HFTarget(model), max_nodes=8, **kw)


class WrongRootBuilder(BestFirstBuilder):
    """Declares valid trees but roots them at another token."""

    builds_valid_trees = True

    def build(self, marginals, root_token, max_nodes):
        return super().build(marginals, (root_token + 1) % 256, max_nodes)


class OversizedBuilder(BestFirstBuilder):
    """Returns 20 nodes more than allowed (a chain below the best-first tree)."""

    def build(self, marginals, root_token, max_nodes):
        tree = super().build(marginals, root_token, max_nodes)
        n = len(tree)
        parents = [int(p) for p in tree.parents] + [n - 1 + k for k in range(20)]
        tokens = torch.cat([tree.tokens, torch.full((20,), 3, dtype=torch.long)])
        return Tree.from_parents(tokens, parents)


class FirstChildVerifier(ExactVerifier):
    """Accepts the root's first child whatever the target says (lossy)."""

    def verify(self, tree, logits, sampling, generator=None):
        if len(tree) < 2:
            return super().verify(tree, logits, sampling, generator)
        return Verdict(torch.tensor([0, 1]), (int(tree.tokens[1]),), int(logits[1].argmax()))

    def verify_batch(self, trees, logits, sampling, generators):
        return [self.verify(t, logits[i, : len(t)], sampling[i], generators[i]) for i, t in enumerate(trees)]


class WrongBonusVerifier(ExactVerifier):
    """Right path, wrong but in-vocabulary bonus token."""

    def verify(self, tree, logits, sampling, generator=None):
        v = super().verify(tree, logits, sampling, generator)
        return Verdict(v.accepted_nodes, v.accepted_tokens, (v.bonus_token + 1) % logits.shape[-1])

    def verify_batch(self, trees, logits, sampling, generators):
        return [self.verify(t, logits[i, : len(t)], sampling[i], generators[i]) for i, t in enumerate(trees)]


class ScribblingDrafter(NoisyOracleDrafter):
    """Writes into the prompt tokens it is handed."""

    def begin(self, context):
        context.tokens[0] = 1
        super().begin(context)


class BrokenBuilder(BestFirstBuilder):
    def build(self, marginals, root_token, max_nodes):
        raise IndexError("list index out of range")


def test_a_builder_declaring_valid_trees_with_a_wrong_root_is_refused_not_decoded():
    with pytest.raises(TreeValidationError, match="root"):
        _pipe(tree_builder=WrongRootBuilder()).generate(PROMPT, max_new_tokens=8)


@pytest.mark.parametrize("batched", [False, True])
def test_a_builder_returning_more_than_max_nodes_is_refused(batched):
    pipe = _pipe(tree_builder=OversizedBuilder())
    with pytest.raises(TreeValidationError, match="max_nodes"):
        if batched:
            pipe.generate_batch([PROMPT[0], PROMPT[0, :3]], max_new_tokens=8)
        else:
            pipe.generate(PROMPT, max_new_tokens=8)


@pytest.mark.parametrize("verifier", [FirstChildVerifier, WrongBonusVerifier])
@pytest.mark.parametrize("batched", [False, True])
def test_a_lossy_plugin_verifier_is_caught_at_t0_by_default(verifier, batched):
    pipe = _pipe(verifier=verifier())
    assert pipe.strict_verdicts  # not bastion's own: checked without opting in
    with pytest.raises(ComponentError, match="argmax"):
        if batched:
            pipe.generate_batch([PROMPT[0], PROMPT[0, :3]], max_new_tokens=12, stop_on_eos=False)
        else:
            pipe.generate(PROMPT, max_new_tokens=12, stop_on_eos=False)


def test_a_plugin_drafter_cannot_write_into_the_callers_prompt():
    model = _model()
    pipe = _pipe(drafter=ScribblingDrafter(model, block_size=4, noise=0.5))
    prompt = PROMPT.clone()
    out = pipe.generate(prompt, max_new_tokens=8, stop_on_eos=False)
    assert torch.equal(prompt, PROMPT)
    assert out.tokens == greedy_reference(model, PROMPT, 8)


@pytest.mark.parametrize("batched", [False, True])
def test_an_exception_inside_a_plugin_component_is_a_bastion_error_naming_it(batched):
    pipe = _pipe(tree_builder=BrokenBuilder())
    with pytest.raises(BastionError, match=r"tree_builder BrokenBuilder\.build .*IndexError") as info:
        if batched:
            pipe.generate_batch([PROMPT[0], PROMPT[0, :3]], max_new_tokens=8)
        else:
            pipe.generate(PROMPT, max_new_tokens=8)
    assert isinstance(info.value, ComponentError) and "plugin" in str(info.value)


def test_a_plugin_whose_hook_raises_after_one_register_keeps_nothing_registered():
    from bastion.contract.hookspecs import hookimpl

    plugin = types.ModuleType("half_plugin")

    @hookimpl
    def bastion_register_components(register):
        register("tree_builder", "half-registered", BestFirstBuilder, description="registered before the failure")
        raise RuntimeError("the plugin broke half-way")

    plugin.bastion_register_components = bastion_register_components
    reg = Registry(load_entry_points=False)
    with pytest.raises(RuntimeError, match="half-way"):
        reg.register_plugin(plugin)
    assert "half-registered" not in reg.names("tree_builder")
    again = types.ModuleType("half_plugin")  # the same plugin name registers cleanly once fixed
    again.bastion_register_components = hookimpl(lambda register: register("tree_builder", "half-registered", BestFirstBuilder))
    reg.register_plugin(again)
    assert "half-registered" in reg.names("tree_builder")
