"""The Hugging Face drop-in as a newcomer calls it: stop strings with ``tokenizer=``, the position limit,
and a ``bastion.GenerationConfig``."""

from __future__ import annotations

import functools

import pytest
import torch

import bastion
from bastion.core import InvalidInputError
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


@functools.lru_cache(maxsize=None)
def _demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bastion.demo import demo_paths

    paths = demo_paths()
    tok = AutoTokenizer.from_pretrained(paths.target)
    model = AutoModelForCausalLM.from_pretrained(paths.target, dtype=torch.float32)
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    return paths, tok, model, inputs


def _stop_string(tok, model, inputs) -> str:
    """A piece of the plain greedy answer that ends it early."""
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    text = tok.decode(plain[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert len(text) > 12, text
    return text[8:11]


def test_stop_strings_with_tokenizer_end_where_plain_generate_ends():
    paths, tok, model, inputs = _demo()
    stop = _stop_string(tok, model, inputs)
    ref = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=[stop], tokenizer=tok)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=[stop], tokenizer=tok,
                         custom_generate=bastion.hf.speculative(paths.drafter))
    assert torch.equal(out, ref)
    assert ref.shape[1] < inputs["input_ids"].shape[1] + 24  # the stop string did end it early


def test_stop_strings_take_the_tokenizer_given_to_speculative():
    paths, tok, model, inputs = _demo()
    stop = _stop_string(tok, model, inputs)
    ref = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=stop, tokenizer=tok)
    fn = bastion.hf.speculative(paths.drafter, tokenizer=tok)
    out = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=stop, custom_generate=fn)
    assert torch.equal(out, ref)


def test_stop_strings_without_any_tokenizer_say_how_to_give_one():
    model = tiny_model("qwen3")  # built from a config: no tokenizer beside it
    fn = bastion.hf.speculative(NoisyOracleDrafter(model, block_size=4, seed=3))
    with pytest.raises(InvalidInputError, match=r"speculative\(.*tokenizer="):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, do_sample=False, stop_strings=["x"], custom_generate=fn)


def test_near_the_position_limit_the_drop_in_returns_what_plain_generate_returns():
    model = tiny_model("qwen3", max_position_embeddings=32)
    fn = bastion.hf.speculative(NoisyOracleDrafter(model, block_size=4, seed=3))
    ids = torch.tensor([[5, 9, 17, 3, 4, 5, 9, 11] * 3])  # 24 tokens: 8 positions left before the limit
    ref = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert ref.shape[1] == 24 + 16  # plain generate runs past max_position_embeddings
    out = model.generate(ids, max_new_tokens=16, do_sample=False, custom_generate=fn)
    assert torch.equal(out, ref)


def test_a_prompt_at_the_position_limit_is_decoded_as_plain_generate_decodes_it():
    model = tiny_model("qwen3", max_position_embeddings=16)
    fn = bastion.hf.speculative(NoisyOracleDrafter(model, block_size=4, seed=3))
    ids = torch.tensor([[5, 9, 17, 3, 4, 5, 9, 11] * 2])  # 16 tokens: no position left at all
    ref = model.generate(ids, max_new_tokens=5, do_sample=False)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, custom_generate=fn)
    assert torch.equal(out, ref)


def test_a_batch_past_the_position_limit_warns_that_rows_were_cut():
    model = tiny_model("qwen3", max_position_embeddings=32)
    fn = bastion.hf.speculative(NoisyOracleDrafter(model, block_size=4, seed=3))
    ids = torch.tensor([[5, 9, 17, 3, 4, 5, 9, 11] * 3, [3, 4, 5, 6, 7, 8, 9, 10] * 3])
    with pytest.warns(UserWarning, match="position limit"):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, custom_generate=fn)
    assert out.shape[0] == 2


def test_a_bastion_generation_config_sets_sampling_seed_and_stop_strings():
    paths, tok, model, inputs = _demo()
    cfg = bastion.GenerationConfig(max_new_tokens=24, sampling={"temperature": 0.8, "seed": 7})
    fn = bastion.hf.speculative(paths.drafter, config=cfg, budget_controller="fixed",
                                component_options={"budget_controller": {"budget": 4}})
    a = model.generate(**inputs, max_new_tokens=24, custom_generate=fn)
    torch.manual_seed(123)  # the config's seed decides, not torch's global generator
    b = model.generate(**inputs, max_new_tokens=24, custom_generate=fn)
    assert torch.equal(a, b)
    greedy = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    short = bastion.hf.speculative(paths.drafter, config=bastion.GenerationConfig(max_new_tokens=8))
    assert torch.equal(model.generate(**inputs, max_new_tokens=24, custom_generate=short), greedy)  # the shorter length
    stop = _stop_string(tok, model, inputs)
    with_stop = bastion.hf.speculative(paths.drafter, config=bastion.GenerationConfig(max_new_tokens=24, stop=[stop]))
    ref = model.generate(**inputs, max_new_tokens=24, do_sample=False, stop_strings=[stop], tokenizer=tok)
    assert torch.equal(model.generate(**inputs, max_new_tokens=24, do_sample=False, custom_generate=with_stop), ref)


def test_speculative_refuses_a_config_of_the_wrong_type():
    with pytest.raises(InvalidInputError, match="bastion.GenerationConfig"):
        bastion.hf.speculative("dflash", config={"max_new_tokens": 3})


def test_sampling_near_the_position_limit_returns_every_token_asked_for():
    model = tiny_model("qwen3", max_position_embeddings=32)
    fn = bastion.hf.speculative(NoisyOracleDrafter(model, block_size=4, seed=3))
    ids = torch.tensor([[5, 9, 17, 3, 4, 5, 9, 11] * 3])
    torch.manual_seed(0)
    for seed in range(4):
        torch.manual_seed(seed)
        out = model.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, custom_generate=fn)
        assert torch.equal(out[:, :24], ids)
        # every token asked for, unless the end token (2) was drawn: then it is the last one, as in plain generate
        assert out.shape[1] == 24 + 16 or (int(out[0, -1]) == 2 and 2 not in out[0, 24:-1].tolist()), out
        assert out.shape[1] > 32 or int(out[0, -1]) == 2  # past the position limit
