"""Every model call that carries a KV cache passes it under the name the installed transformers release
takes: ``cache`` in recent 5.x releases, ``past_key_values`` before the rename (5.17 and earlier 5.x
releases), where an unknown ``cache`` keyword is swallowed silently and the model runs with no cache.

The models below mimic such a release on the installed one: their ``forward`` takes ``past_key_values``
and drops ``cache`` without a word, exactly as the older releases' ``**kwargs`` did."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3ForCausalLM

import bastion
from bastion.huggingface.compat import cache_kwarg
from bastion.huggingface.causal_lm import HFTarget
from bastion.drafters.model import ModelDrafter
from bastion.testing.tiny import tiny_model

NEW_TOKENS = 16
#: the installed release already names the keyword ``cache``: the mimic below stands for the older ones
RENAMED = "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters
older_release = pytest.mark.skipif(not RENAMED, reason="the installed transformers takes past_key_values itself")


def _old_release(cls: type) -> type:
    class OldCacheKwarg(cls):  # type: ignore[misc, valid-type]
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
            kwargs.pop("cache", None)  # the older releases ignored keywords they did not know
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                                   use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)

    OldCacheKwarg.__name__ = f"Old{cls.__name__}"
    return OldCacheKwarg


def _as_old_release(model):
    old = _old_release(type(model))(model.config)
    old.load_state_dict(model.state_dict())
    return old.eval()


@pytest.mark.parametrize("arch, cls", [("qwen3", Qwen3ForCausalLM), ("llama", LlamaForCausalLM)])
def test_cache_kwarg_names_the_keyword_the_models_forward_takes(arch, cls):
    model = tiny_model(arch, seed=0)
    assert isinstance(model, cls)
    assert cache_kwarg(model) == ("cache" if RENAMED else "past_key_values")
    if RENAMED:
        assert cache_kwarg(_as_old_release(model)) == "past_key_values"


def _reference(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


@older_release
def test_greedy_decoding_is_lossless_on_a_target_whose_forward_takes_past_key_values():
    model = tiny_model("qwen3", seed=0)
    old = _as_old_release(model)
    draft = _as_old_release(tiny_model("qwen3", seed=7, num_hidden_layers=1))
    pipe = bastion.Pipeline(HFTarget(old), ModelDrafter(draft, depth=3, width=2, top_k=2),
                            budget_controller=bastion.registry.create("budget_controller", "fixed", budget=6), max_nodes=6)
    gen = torch.Generator().manual_seed(0)
    for length in (3, 11):
        prompt = torch.randint(3, 256, (length,), generator=gen).tolist()
        assert pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS).tokens == _reference(model, prompt)


@older_release
def test_batched_and_plain_decoding_are_lossless_on_a_target_whose_forward_takes_past_key_values():
    from bastion.bench.methods import ARDecoder

    model = tiny_model("llama", seed=1)
    target = HFTarget(_as_old_release(model))
    draft = _as_old_release(tiny_model("llama", seed=7, num_hidden_layers=1))
    pipe = bastion.Pipeline(target, ModelDrafter(draft, depth=3, width=2, top_k=2),
                            budget_controller=bastion.registry.create("budget_controller", "fixed", budget=4), max_nodes=4)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (4, 9, 2)]
    want = [_reference(model, p) for p in prompts]
    assert [r.tokens for r in pipe.generate_batch(prompts, max_new_tokens=NEW_TOKENS)] == want
    assert [ARDecoder(target).generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS).tokens for p in prompts] == want
