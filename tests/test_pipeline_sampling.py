"""T > 0: the pipeline's output distribution is the target's sampling distribution (exact enumeration
on an 8-token vocabulary, chi-square goodness of fit), and seeded runs are reproducible."""

from __future__ import annotations

import functools
import random

import pytest
import torch

import bastion
from bastion.controllers import BastionController
from bastion.core import SamplingConfig
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.sampling import processed_log_probs
from bastion.testing.stats import assert_fits
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model

VOCAB = 8
PROMPT = [3, 5, 4, 7]


@functools.lru_cache(maxsize=None)
def _model():
    # a smaller head scale than the default tiny model keeps several tokens likely at every position
    model = tiny_model("qwen3", seed=11, vocab_size=VOCAB)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.25)
    return model


def _pipeline(budget: int = 4, controller=None) -> bastion.Pipeline:
    model = _model()
    return bastion.Pipeline(
        HFTarget(model),
        NoisyOracleDrafter(model, block_size=2, noise=0.3),
        tree_builder="best-first",
        budget_controller=controller or bastion.registry.create("budget_controller", "fixed", budget=budget),
        max_nodes=budget,
    )


def _exact_distributions(sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint P(t1, t2) [V, V] and marginal P(t3) [V] of the target's own sampling."""
    model = _model()
    v = torch.arange(VOCAB)
    with torch.no_grad():
        p1 = processed_log_probs(model(torch.tensor([PROMPT])).logits[0, -1], sampling).exp()  # [V]
        ids2 = torch.cat([torch.tensor(PROMPT).expand(VOCAB, -1), v[:, None]], dim=1)  # [V, L + 1]
        p2 = processed_log_probs(model(ids2).logits[:, -1], sampling).exp()  # [V, V]: P(t2 | t1)
        ids3 = torch.cat([ids2.repeat_interleave(VOCAB, 0), v.repeat(VOCAB)[:, None]], dim=1)  # [V*V, L + 2]
        p3 = processed_log_probs(model(ids3).logits[:, -1], sampling).exp().reshape(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2  # [V, V]
    marg3 = (joint12[:, :, None] * p3).sum(dim=(0, 1))  # [V]
    return joint12.double(), marg3.double()


class _CoinFlipController(BastionController):
    """Drafts or decodes plainly by a seeded coin flip each step, whatever it predicts: generations
    switch between the two at every position, in a different pattern each run."""

    def __init__(self) -> None:
        super().__init__(min_budget=2, gate=False)
        self._coin = random.Random(0)
        self.flips = 0

    def speculate(self) -> bool:
        self.flips += 1
        return self._coin.random() < 0.5


def _switching_controller() -> BastionController:
    return _CoinFlipController()


@pytest.mark.parametrize(
    "temperature,top_p,top_k,switching",
    [(1.0, 1.0, 0, False), (0.7, 0.9, 0, False), (1.4, 1.0, 5, False), (1.0, 1.0, 0, True)],
    ids=["t1.0", "t0.7-topp0.9", "t1.4-topk5", "t1.0-switching-to-plain"],
)
def test_first_tokens_follow_the_target_sampling_distribution(temperature, top_p, top_k, switching):
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    joint12, marg3 = _exact_distributions(sampling)
    pipe = _pipeline(controller=_switching_controller() if switching else None)
    runs = 400
    c12 = torch.zeros(VOCAB, VOCAB)
    c3 = torch.zeros(VOCAB)
    accepted = plain = 0
    for seed in range(runs):
        res = pipe.generate(
            torch.tensor([PROMPT]), max_new_tokens=3, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=1000 + seed, stop_on_eos=False,
        )
        t1, t2, t3 = res.tokens
        c12[t1, t2] += 1
        c3[t3] += 1
        accepted += sum(s.accepted for s in res.steps)
        plain += sum(1 for s in res.steps if not s.drafted)
    assert accepted > runs // 10  # drafted tokens really were accepted, so the tree path is exercised
    if switching:  # plain steps chosen by the controller emitted tokens too (not only final one-token steps)
        assert pipe.budget_controller.flips >= runs and plain >= runs // 2
    assert_fits(c12, joint12, what="first two tokens")
    assert_fits(c3, marg3, what="third token")


def test_seeded_sampling_runs_are_reproducible():
    pipe = _pipeline(budget=6)
    ids = torch.tensor([PROMPT])
    a = pipe.generate(ids, max_new_tokens=12, temperature=1.0, seed=7, stop_on_eos=False).tokens
    b = pipe.generate(ids, max_new_tokens=12, temperature=1.0, seed=7, stop_on_eos=False).tokens
    others = {tuple(pipe.generate(ids, max_new_tokens=12, temperature=1.0, seed=s, stop_on_eos=False).tokens) for s in (8, 9, 10)}
    assert a == b
    assert len(others | {tuple(a)}) > 1
