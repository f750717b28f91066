"""``model.generate(custom_generate=bastion.hf.speculative(...))`` against plain ``model.generate``."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import bastion
from bastion.core import InvalidInputError
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    return tiny_model(arch, seed=0 if arch == "qwen3" else 1)


def _speculative(model, **components):
    return bastion.hf.speculative(NoisyOracleDrafter(model, block_size=4, seed=3), **components)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_custom_generate_equals_plain_model_generate(arch):
    model = _model(arch)
    ids = torch.tensor([[5, 9, 17, 3, 4, 5, 9]])
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, custom_generate=_speculative(model))
    assert torch.equal(out, ref)


def test_max_new_tokens_and_eos_end_the_generation_where_plain_generate_ends_it():
    model = _model("qwen3")
    ids = torch.tensor([[7, 8, 9]])
    fn = _speculative(model)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    eos = int(plain[0, 3 + 4])  # the 5th generated token becomes the end token
    for kwargs in ({"max_new_tokens": 5}, {"max_new_tokens": 12, "eos_token_id": eos}):
        ref = model.generate(ids, do_sample=False, **kwargs)
        out = model.generate(ids, do_sample=False, custom_generate=fn, **kwargs)
        assert torch.equal(out, ref), kwargs
    assert model.generate(ids, do_sample=False, max_new_tokens=12, eos_token_id=eos, custom_generate=fn).shape[1] == 3 + 5


def test_sampling_follows_torch_seed_and_returns_the_dict_output_when_asked():
    model = _model("qwen3")
    ids = torch.tensor([[3, 4, 5, 3, 4]])
    # a fixed tree size: with the adaptive controller the trees (and so the draws) follow measured timings
    fn = _speculative(model, budget_controller="fixed", component_options={"budget_controller": {"budget": 6}})
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(model.generate(ids, max_new_tokens=16, do_sample=True, temperature=0.9, top_k=0, custom_generate=fn))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert runs[0].shape[1] <= 5 + 16 and torch.equal(runs[0][:, :5], ids)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, custom_generate=fn)
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=6, do_sample=False))


def test_sampling_settings_are_read_from_the_processors_generate_built(monkeypatch):
    model = _model("qwen3")
    fn = _speculative(model)
    seen = {}
    pipe = fn.pipeline(model)
    real = pipe.decode_steps

    def spy(prompt, *args, **kw):
        seen["config"] = kw["config"]  # the call's one checked GenerationConfig
        return real(prompt, *args, **kw)

    monkeypatch.setattr(pipe, "decode_steps", spy)
    model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5, top_p=0.9, custom_generate=fn)
    sp = seen["config"].sampling
    assert (sp.temperature, sp.top_k, sp.top_p) == (pytest.approx(0.7), 5, pytest.approx(0.9))
    assert seen["config"].max_new_tokens == 3 and not seen["config"].stop_on_eos


def test_a_left_padded_batch_with_attention_mask_equals_plain_generate():
    model = _model("qwen3")
    ids = torch.tensor([[0, 0, 5, 9, 17], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, custom_generate=_speculative(model))
    assert torch.equal(out, ref)


def test_a_logits_processor_bastion_cannot_apply_is_refused_by_name():
    model = _model("qwen3")
    with pytest.raises(InvalidInputError, match="RepetitionPenaltyLogitsProcessor"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=3, repetition_penalty=1.3, custom_generate=_speculative(model))


def test_text_iterator_streamer_receives_exactly_the_decoded_text():
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

    from bastion.demo import demo_paths

    paths = demo_paths()
    tok = AutoTokenizer.from_pretrained(paths.target)
    model = AutoModelForCausalLM.from_pretrained(paths.target, dtype=torch.float32)
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    box = {}
    fn = bastion.hf.speculative(paths.drafter)
    worker = threading.Thread(target=lambda: box.update(out=model.generate(**inputs, max_new_tokens=24, do_sample=False,
                                                                           streamer=streamer, custom_generate=fn)))
    worker.start()
    text = "".join(streamer)
    worker.join()
    out = box["out"]
    assert torch.equal(out, model.generate(**inputs, max_new_tokens=24, do_sample=False))
    assert text == tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True) and text


def test_a_custom_stopping_criterion_ends_mid_step_exactly_where_plain_generate_ends():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class AtLength(StoppingCriteria):
        def __init__(self, length: int) -> None:
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

    model = _model("qwen3")
    ids = torch.tensor([[5, 9, 17, 3, 4, 5, 9]])
    fn = _speculative(model)
    for length in (9, 10, 11, 12, 13):  # steps commit several tokens: most of these cut a step short
        stop = StoppingCriteriaList([AtLength(length)])
        ref = model.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=stop)
        out = model.generate(ids, max_new_tokens=20, do_sample=False, stopping_criteria=stop, custom_generate=fn)
        assert torch.equal(out, ref) and out.shape[1] == length
