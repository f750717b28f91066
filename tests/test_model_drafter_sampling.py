"""T > 0 with the autoregressive ``model`` drafter: the pipeline's first tokens follow the target's own
sampling distribution (exact enumeration on an 8-token vocabulary, chi-square goodness of fit)."""

from __future__ import annotations

import pytest
import torch
from test_pipeline_sampling import PROMPT, VOCAB, _exact_distributions, _model

import bastion
from bastion.core import SamplingConfig
from bastion.huggingface.causal_lm import HFTarget
from bastion.drafters.model import ModelDrafter
from bastion.testing.stats import assert_fits
from bastion.testing.tiny import tiny_model


def _draft_model():
    """A one-layer model whose distributions are close to the target's (its weights, perturbed)."""
    target = _model()
    draft = tiny_model("qwen3", seed=12, vocab_size=VOCAB, num_hidden_layers=1)
    own = draft.state_dict()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for k, v in target.state_dict().items():
            if k in own and own[k].shape == v.shape:
                own[k].copy_(v + 0.1 * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=gen))
    return draft.eval()


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.8, 0.95, 0)], ids=["t0.8-topp0.95"])
def test_first_tokens_follow_the_target_sampling_distribution_with_the_model_drafter(temperature, top_p, top_k):
    joint12, marg3 = _exact_distributions(SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k))
    pipe = bastion.Pipeline(
        HFTarget(_model()),
        ModelDrafter(_draft_model(), depth=2, width=2, top_k=3),
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=5),
        max_nodes=5,
    )
    runs = 300
    c12, c3 = torch.zeros(VOCAB, VOCAB), torch.zeros(VOCAB)
    accepted = 0
    for seed in range(runs):
        res = pipe.generate(torch.tensor([PROMPT]), max_new_tokens=3, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=2000 + seed, stop_on_eos=False)
        t1, t2, t3 = res.tokens
        c12[t1, t2] += 1
        c3[t3] += 1
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > runs // 10  # drafted candidates really were accepted
    assert_fits(c12, joint12, what="first two tokens")
    assert_fits(c3, marg3, what="third token")
