"""T > 0 with the ``eagle3`` drafter: the pipeline's first tokens follow the target's own sampling
distribution (exact enumeration on an 8-token vocabulary, chi-square goodness of fit)."""

from __future__ import annotations

import pytest
import torch
from test_pipeline_sampling import PROMPT, VOCAB, _exact_distributions, _model

import bastion
from bastion.core import SamplingConfig
from bastion.huggingface.causal_lm import HFTarget
from bastion.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3DraftModel
from bastion.testing.stats import assert_fits

DRAFT_VOCAB = 6


def _draft_model() -> Eagle3DraftModel:
    """A random EAGLE-3 network over 6 of the 8 tokens whose proposals follow the target's last layer
    (its final norm and head rows), with small random attention and MLP branches."""
    target = _model()
    cfg = Eagle3Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64, feature_layer_ids=(0, 1, 1))
    gen = torch.Generator().manual_seed(4)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) if p.dim() > 1 else torch.ones(p.shape))
        chosen = torch.tensor([0, 2, 3, 4, 5, 7])
        model.d2t.copy_(chosen - torch.arange(DRAFT_VOCAB))
        model.fc.weight.zero_()
        model.fc.weight[:, -64:] = torch.eye(64)
        model.norm.weight.copy_(target.model.norm.weight)
        model.lm_head.weight.copy_(target.lm_head.weight[chosen])
        model.midlayer.self_attn.o_proj.weight.mul_(0.1)
        model.midlayer.mlp.down_proj.weight.mul_(0.1)
    return model.eval()


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.8, 0.95, 0)], ids=["t0.8-topp0.95"])
def test_first_tokens_follow_the_target_sampling_distribution_with_the_eagle3_drafter(temperature, top_p, top_k):
    joint12, marg3 = _exact_distributions(SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k))
    pipe = bastion.Pipeline(
        HFTarget(_model()),
        Eagle3Drafter(_draft_model(), total_token=8, depth=2, top_k=3),
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=5),
        max_nodes=5,
    )
    runs = 300
    c12, c3 = torch.zeros(VOCAB, VOCAB), torch.zeros(VOCAB)
    accepted = 0
    for seed in range(runs):
        res = pipe.generate(torch.tensor([PROMPT]), max_new_tokens=3, temperature=temperature, top_p=top_p,
                            top_k=top_k, seed=3000 + seed, stop_on_eos=False)
        t1, t2, t3 = res.tokens
        c12[t1, t2] += 1
        c3[t3] += 1
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > runs // 10  # drafted candidates really were accepted
    assert_fits(c12, joint12, what="first two tokens")
    assert_fits(c3, marg3, what="third token")
