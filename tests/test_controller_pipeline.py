"""End to end on a tiny target: the adaptive (``bastion``) controller keeps decoding lossless and
changes the verified tree size with the drafter's confidence."""

from __future__ import annotations

import pytest
import torch

from bastion import Pipeline
from bastion.controllers import BastionController, RooflineLatency, RooflineParams
from bastion.core import DraftContext, Drafter, DraftStep, Marginals
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model

K = 5  # drafted depths
NEW = 24


def confident(context_len: int) -> bool:
    """Phases of eight positions: the drafter is sure in even phases and unsure in odd ones."""
    return (context_len // 8) % 2 == 0


class ScriptedDrafter(Drafter):
    """Marginals peaked on a known continuation (sometimes on a wrong token), sharp or flat by phase."""

    def __init__(self, sequence: list[int], vocab_size: int) -> None:
        self.sequence = sequence  # prompt + the target's greedy continuation
        self._vocab = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def begin(self, context: DraftContext) -> None:
        pass

    def propose(self, step: DraftStep) -> Marginals:
        gen = torch.Generator().manual_seed(step.context_len)
        logits = torch.randn(K, self._vocab, generator=gen)  # [K, V]
        boost = 9.0 if confident(step.context_len) else 0.5
        for k in range(1, K + 1):
            pos = step.context_len + k
            token = self.sequence[pos] if pos < len(self.sequence) else 0
            if step.context_len % 5 == 0 and k == 3:
                token = (token + 1) % self._vocab  # a confident mistake: the verifier must reject it
            logits[k - 1, token] += boost
        return Marginals.from_logits(logits, temperature=step.temperature)

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        pass


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3", seed=0)
    prompt = torch.tensor([[1, 17, 42, 99, 7, 3]])
    reference = greedy_reference(model, prompt, NEW)
    target = HFTarget(model)
    drafter = ScriptedDrafter(prompt[0].tolist() + reference, target.vocab_size)
    return target, drafter, prompt, reference


PLANTED = RooflineParams(1.0, 5.0, 1.0, 5.0)


def planted_latency(target: HFTarget, online: bool, min_observations: int = 6) -> RooflineLatency:
    # about 5 s fixed plus 1 s per verified token (a slow imaginary device): larger trees must earn their
    # cost, and the pipeline's real per-step overhead (milliseconds) cannot sway the choice
    return RooflineLatency(
        model_config=target.config,
        device="cpu",
        peak_flops=1.8e5,
        bandwidth=1e15,
        params=PLANTED,
        profile=None,
        online=online,
        min_observations=min_observations,
    )


@pytest.mark.parametrize("rule", ["scan", "first-decrease"])
def test_adaptive_pipeline_is_lossless_and_budgets_follow_draft_confidence(setup, rule):
    target, drafter, prompt, reference = setup
    pipe = Pipeline(
        target=target,
        drafter=drafter,
        tree_builder="best-first",
        budget_controller=BastionController(rule=rule, gate=False),  # every step drafts: budgets are compared
        latency_model=planted_latency(target, online=False),
        verifier="exact",
        max_nodes=32,
    )
    res = pipe.generate(prompt, max_new_tokens=NEW, temperature=0.0, stop_on_eos=False)
    assert res.tokens == reference
    budgets = [s.budget for s in res.steps]
    assert len(set(budgets)) > 1, budgets
    sure = [s.budget for s in res.steps if confident(s.context_len)]
    unsure = [s.budget for s in res.steps if not confident(s.context_len)]
    assert sure and unsure
    assert min(sure) > max(unsure), (sure, unsure)
    # every step that consulted the controller records its prediction (a final one-token step does not)
    predicted = [s.predicted_speedup for s in res.steps if s.predicted_speedup is not None]
    assert len(predicted) >= len(res.steps) - 1 and all(p > 0 for p in predicted)
    assert any(s.accepted > 0 for s in res.steps)


def test_online_roofline_learns_from_every_verify_and_stays_lossless(setup):
    target, drafter, prompt, reference = setup
    latency = planted_latency(target, online=True, min_observations=3)
    pipe = Pipeline(  # every step drafts (plain steps feed the latency model one timing in eight)
        target=target, drafter=drafter, tree_builder="best-first", budget_controller=BastionController(gate=False),
        latency_model=latency, verifier="exact", max_nodes=32,
    )
    res = pipe.generate(prompt, max_new_tokens=NEW, temperature=0.0, stop_on_eos=False)
    assert res.tokens == reference
    assert latency.n_observations == len(res.steps) >= latency.min_observations
    assert latency.last_fit is not None
    # the measured verifies take milliseconds, the planted prior says seconds: the fit must move off it
    assert latency.params != PLANTED
    assert latency.predict(4, 10) < 0.5 * planted_latency(target, online=False).predict(4, 10)


def test_fixed_controller_verifies_its_budget_every_step(setup):
    target, drafter, prompt, reference = setup
    pipe = Pipeline(
        target=target, drafter=drafter, tree_builder="best-first", budget_controller="fixed",
        latency_model=planted_latency(target, online=False), verifier="exact", max_nodes=32,
        component_options={"budget_controller": {"budget": 4}},
    )
    res = pipe.generate(prompt, max_new_tokens=NEW, temperature=0.0, stop_on_eos=False)
    assert res.tokens == reference
    assert {s.budget for s in res.steps[:-1]} == {4}  # the last step may be a plain one-token target step
    assert res.steps[-1].budget in (1, 4)
