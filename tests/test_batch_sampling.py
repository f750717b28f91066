"""T > 0 in a batch: each row's first tokens follow the target's sampling distribution (rows of
different lengths side by side), and a seed fixes every row's output whatever the batch."""

from __future__ import annotations

import pytest
import torch
from test_pipeline_sampling import PROMPT, VOCAB, _exact_distributions, _model

import bastion
from bastion.core import SamplingConfig
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.sampling import processed_log_probs
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.stats import assert_fits

SHORT, LONG = [6], [2, 7, 1, 1, 4, 3, 5]


def _pipeline(controller: str = "fixed") -> bastion.Pipeline:
    model = _model()
    opts = {"budget": 4} if controller == "fixed" else {}
    return bastion.Pipeline(
        HFTarget(model),
        NoisyOracleDrafter(model, block_size=2, noise=0.3),
        tree_builder="best-first",
        budget_controller=bastion.registry.create("budget_controller", controller, **opts),
        max_nodes=4,
    )


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.7, 0.9, 0)], ids=["t1.0", "t0.7-topp0.9"])
def test_each_rows_first_tokens_follow_the_target_distribution(temperature, top_p, top_k):
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
    joint12, marg3 = _exact_distributions(sampling)  # for PROMPT
    with torch.no_grad():
        short1 = processed_log_probs(_model()(torch.tensor([SHORT])).logits[0, -1], sampling).exp().double()
    pipe = _pipeline()
    runs = 300
    c12, c3, c_short = torch.zeros(VOCAB, VOCAB), torch.zeros(VOCAB), torch.zeros(VOCAB)
    accepted = 0
    for seed in range(runs):
        short, mid, _long = pipe.generate_batch(
            [SHORT, PROMPT, LONG], max_new_tokens=3, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=10_000 + 3 * seed, stop_on_eos=False,
        )
        t1, t2, t3 = mid.tokens
        c12[t1, t2] += 1
        c3[t3] += 1
        c_short[short.tokens[0]] += 1
        accepted += sum(s.accepted for s in mid.steps)
    assert accepted > runs // 10  # drafted tokens were accepted: tree paths are exercised
    assert_fits(c12, joint12, what="row 1: first two tokens")
    assert_fits(c3, marg3, what="row 1: third token")
    assert_fits(c_short, short1, what="row 0: first token")


@pytest.mark.parametrize("controller", ["fixed", "bastion"])
def test_same_seed_same_outputs_and_each_row_equals_its_prompt_sampled_alone(controller):
    pipe = _pipeline(controller)
    prompts = [SHORT, PROMPT, LONG]
    a = [r.tokens for r in pipe.generate_batch(prompts, max_new_tokens=10, temperature=1.0, seed=7, stop_on_eos=False)]
    b = [r.tokens for r in pipe.generate_batch(prompts, max_new_tokens=10, temperature=1.0, seed=7, stop_on_eos=False)]
    assert a == b
    for i, prompt in enumerate(prompts):  # row i is seeded with seed + i
        alone = pipe.generate(torch.tensor([prompt]), max_new_tokens=10, temperature=1.0, seed=7 + i, stop_on_eos=False)
        assert a[i] == alone.tokens
    c = [r.tokens for r in pipe.generate_batch(prompts, max_new_tokens=10, temperature=1.0, seed=8, stop_on_eos=False)]
    assert c != a
