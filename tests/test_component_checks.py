"""Components that break their contract at run time are caught by the pipeline with an error naming
them: verdicts that are not a root path of the tree, wrong tokens or bonus, wrong return types, marginals
over another vocabulary, latency predictions that are NaN, negative or zero."""

from __future__ import annotations

import functools

import attrs
import pytest
import torch

import bastion
from bastion.core import ComponentError, IncompatibleComponentsError, LatencyModel, Marginals, Tree, Verdict
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model
from bastion.verifiers.exact import ExactVerifier

PROMPT = torch.tensor([[5, 6, 7, 8]])


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model("qwen3", seed=2)


def _pipe(**kw) -> bastion.Pipeline:
    model = _model()
    kw.setdefault("drafter", NoisyOracleDrafter(model, block_size=4, noise=0.5))
    kw.setdefault("budget_controller", bastion.registry.create("budget_controller", "fixed", budget=8))
    return bastion.Pipeline(HFTarget(model), max_nodes=8, **kw)


class SiblingsVerifier(ExactVerifier):
    """Accepts the root's first two children, which are siblings (corrupts the KV cache)."""

    def verify(self, tree, logits, sampling, generator=None):
        kids = [i for i in range(len(tree)) if int(tree.parents[i]) == 0][:2]
        if len(kids) < 2:
            return super().verify(tree, logits, sampling, generator)
        return Verdict(torch.tensor([0, *kids]), tuple(int(tree.tokens[k]) for k in kids), 1)


class WrongTokensVerifier(ExactVerifier):
    """Right path, but reports other tokens than the nodes hold."""

    def verify(self, tree, logits, sampling, generator=None):
        v = super().verify(tree, logits, sampling, generator)
        if not v.accepted_tokens:
            return Verdict(torch.tensor([0, 1]), (int(tree.tokens[1]) + 1,), v.bonus_token) if len(tree) > 1 else v
        return attrs.evolve(v, accepted_tokens=tuple(t + 1 for t in v.accepted_tokens))


class BadBonusVerifier(ExactVerifier):
    def verify(self, tree, logits, sampling, generator=None):
        return attrs.evolve(super().verify(tree, logits, sampling, generator), bonus_token=logits.shape[-1] + 3)


class NotAVerdictVerifier(ExactVerifier):
    def verify(self, tree, logits, sampling, generator=None):
        return {"accepted_nodes": [0], "bonus_token": 1}


class ArgmaxIgnoringVerifier(ExactVerifier):
    """Always accepts the root's first child and emits the target's argmax after it: a valid root path
    with consistent tokens, but not what greedy decoding emits."""

    def verify(self, tree, logits, sampling, generator=None):
        kids = [i for i in range(len(tree)) if int(tree.parents[i]) == 0]
        if not kids:
            return super().verify(tree, logits, sampling, generator)
        k = kids[-1]
        return Verdict(torch.tensor([0, k]), (int(tree.tokens[k]),), int(logits[k].argmax()))


@pytest.mark.parametrize(
    "verifier,message",
    [
        (SiblingsVerifier(), "is not a child of node"),
        (WrongTokensVerifier(), "differ from the tokens"),
        (BadBonusVerifier(), "bonus token"),
        (NotAVerdictVerifier(), "must return bastion.core.Verdict"),
    ],
)
def test_broken_verdicts_raise_component_error_naming_the_verifier(verifier, message):
    with pytest.raises(ComponentError, match=message) as err:
        _pipe(verifier=verifier).generate(PROMPT, max_new_tokens=12)
    assert type(verifier).__name__ in str(err.value)


def test_strict_mode_catches_a_verifier_that_ignores_the_target_argmax_by_default_for_plugin_verifiers():
    assert _pipe(verifier=ArgmaxIgnoringVerifier(), strict_verdicts=False).generate(PROMPT, max_new_tokens=12).tokens != greedy_reference(
        _model(), PROMPT, 12
    )  # opted out: the cheap check cannot see this one
    for strict in (None, True):  # a verifier that is not bastion's own is checked unless the caller opts out
        with pytest.raises(ComponentError, match="ArgmaxIgnoringVerifier.*argmax"):
            _pipe(verifier=ArgmaxIgnoringVerifier(), strict_verdicts=strict).generate(PROMPT, max_new_tokens=12)


def test_strict_mode_accepts_the_exact_verifier():
    res = _pipe(strict_verdicts=True).generate(PROMPT, max_new_tokens=16)
    assert res.tokens == greedy_reference(_model(), PROMPT, 16)
    assert sum(s.accepted for s in res.steps) > 0


class _Wrap(NoisyOracleDrafter):
    def __init__(self, model, result):
        super().__init__(model, block_size=4)
        self._result = result

    def propose(self, step):
        real = super().propose(step)
        return self._result(real)


def test_drafter_returning_the_wrong_type_raises_component_error_naming_it():
    drafter = _Wrap(_model(), lambda m: m.log_probs)  # a tensor, not Marginals
    with pytest.raises(ComponentError, match="_Wrap.propose returned Tensor"):
        _pipe(drafter=drafter).generate(PROMPT, max_new_tokens=6)


def test_marginals_wider_than_the_target_vocabulary_are_refused_naming_the_drafter():
    def wider(m: Marginals) -> Marginals:
        pad = torch.full((m.depth, 9), -30.0)
        return Marginals(torch.log_softmax(torch.cat([m.log_probs, pad], dim=1), dim=-1))

    with pytest.raises(IncompatibleComponentsError, match=r"_Wrap proposed marginals over 265 tokens.*256"):
        _pipe(drafter=_Wrap(_model(), wider)).generate(PROMPT, max_new_tokens=6)


class ConstLatency(LatencyModel):
    def __init__(self, value: float) -> None:
        self.value = value

    def predict(self, n_tokens: int, context_len: int) -> float:
        return self.value if n_tokens > 1 else 1e-3

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("value", [float("nan"), -1e-3, 0.0, float("inf")])
@pytest.mark.parametrize("controller", ["bastion", "fixed"])
def test_bad_latency_predictions_raise_component_error_naming_the_model(value, controller):
    with pytest.raises(ComponentError, match="latency model ConstLatency predicted"):
        _pipe(latency_model=ConstLatency(value), budget_controller=controller).generate(PROMPT, max_new_tokens=6)


def test_check_verdict_accepts_every_exact_verdict_on_random_trees():
    from bastion.utils.checks import check_verdict
    from bastion.contract.types import SamplingConfig

    g = torch.Generator().manual_seed(0)
    builder = bastion.registry.create("tree_builder", "best-first")
    for _ in range(20):
        tree = builder.build(Marginals.from_logits(torch.randn(4, 6, generator=g)), root_token=1, max_nodes=12)
        logits = torch.randn(len(tree), 6, generator=g)
        for t in (0.0, 1.0):
            verdict = ExactVerifier().verify(tree, logits, SamplingConfig(temperature=t), g)
            assert check_verdict(verdict, tree, 6, ExactVerifier()) == verdict.accepted_nodes.tolist()
    assert isinstance(tree, Tree)
