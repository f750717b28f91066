"""Pipelines take loaded models, BatchEncoding / dict prompts and the checkpoint's dtype; they stream
text as steps commit, answer chat messages, stop at stop strings and carry the text in the result."""

from __future__ import annotations

import functools

import pytest
import torch

import bastion
from bastion.core import GenerationResult, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import save_tiny_target, tiny_model

PROMPT = torch.tensor([[5, 9, 17, 3, 4, 5, 9]])


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model("qwen3", seed=0)


@functools.lru_cache(maxsize=None)
def _demo() -> bastion.Pipeline:
    return bastion.Pipeline.demo()


def test_from_pretrained_and_the_constructor_take_a_loaded_model_and_decode_losslessly():
    model = _model()
    ref = greedy_reference(model, PROMPT, 12)
    a = bastion.Pipeline.from_pretrained(model, NoisyOracleDrafter(model, block_size=4))
    b = bastion.Pipeline(target=model, drafter=NoisyOracleDrafter(model, block_size=4))
    assert isinstance(a.target, HFTarget) and a.target.model is model and isinstance(b.target, HFTarget)
    assert a.generate(PROMPT, max_new_tokens=12, stop_on_eos=False).tokens == ref
    assert b.generate(PROMPT, max_new_tokens=12, stop_on_eos=False).tokens == ref


def test_a_target_that_is_neither_target_nor_model_names_hftarget():
    with pytest.raises(InvalidInputError, match="HFTarget"):
        bastion.Pipeline(target="not a model", drafter=NoisyOracleDrafter(_model()))  # type: ignore[arg-type]


def test_batch_encoding_and_dict_prompts_equal_plain_input_ids():
    from transformers import BatchEncoding

    model = _model()
    pipe = bastion.Pipeline(target=model, drafter=NoisyOracleDrafter(model, block_size=4))
    ref = pipe.generate(PROMPT, max_new_tokens=8, stop_on_eos=False).tokens
    enc = BatchEncoding({"input_ids": PROMPT, "attention_mask": torch.ones_like(PROMPT)})
    assert pipe.generate(enc, max_new_tokens=8, stop_on_eos=False).tokens == ref
    assert pipe.generate({"input_ids": PROMPT[0].tolist()}, max_new_tokens=8, stop_on_eos=False).tokens == ref
    padded = {"input_ids": torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], 1),
              "attention_mask": torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(PROMPT)], 1)}
    assert pipe.generate(padded, max_new_tokens=8, stop_on_eos=False).tokens == ref  # left padding is dropped
    rows = pipe.generate_batch(padded, max_new_tokens=8, stop_on_eos=False)
    assert [r.tokens for r in rows] == [ref]
    with pytest.raises(InvalidInputError, match="generate_batch"):
        pipe.generate(torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(InvalidInputError, match="input_ids"):
        pipe.generate({"ids": PROMPT}, max_new_tokens=2)


def test_dtype_auto_keeps_the_checkpoint_dtype_and_the_latency_model_gets_it(tmp_path):
    path = save_tiny_target(tmp_path / "bf16", "qwen3", seed=0)
    model = tiny_model("qwen3", seed=0).to(torch.bfloat16)
    model.save_pretrained(path)
    pipe = bastion.Pipeline.from_pretrained(path, NoisyOracleDrafter(_model(), block_size=4))
    assert pipe.target.dtype == torch.bfloat16
    assert pipe.latency_model.cost.bytes_per_param == 2
    f32 = bastion.Pipeline.from_pretrained(path, NoisyOracleDrafter(_model(), block_size=4), dtype=torch.float32)
    assert f32.target.dtype == torch.float32 and f32.latency_model.cost.bytes_per_param == 4


def test_component_options_for_a_component_given_as_an_instance_is_an_error():
    model = _model()
    fixed = bastion.registry.create("budget_controller", "fixed", budget=4)
    with pytest.raises(InvalidInputError, match=r"component_options\['budget_controller'\].*instance"):
        bastion.Pipeline(target=model, drafter=NoisyOracleDrafter(model), budget_controller=fixed,
                         component_options={"budget_controller": {"budget": 8}})
    with pytest.raises(InvalidInputError, match="drafter options.*instance"):
        bastion.Pipeline.from_pretrained(model, NoisyOracleDrafter(model), component_options={"drafter": {"depth": 3}})


def test_stream_yields_the_result_text_step_by_step_and_calls_on_step_per_step():
    pipe = _demo()
    records = []
    stream = pipe.stream([{"role": "user", "content": "What is 2+3?"}], max_new_tokens=30, on_step=records.append)
    chunks = list(stream)
    result = stream.result
    assert isinstance(result, GenerationResult) and len(chunks) > 1
    assert "".join(chunks) == result.text == pipe.decode(result.tokens)
    assert records == list(result.steps)
    assert result.tokens == pipe.chat("What is 2+3?", max_new_tokens=30).tokens


def test_chat_applies_the_chat_template_and_the_result_carries_text_and_a_short_repr():
    pipe = _demo()
    res = pipe.chat("What is 2+3?", max_new_tokens=20)
    ids = pipe.encode_chat([{"role": "user", "content": "What is 2+3?"}])
    assert res.tokens == pipe.generate(ids, max_new_tokens=20).tokens
    assert res.prompt_len == ids.shape[1] > pipe.encode("What is 2+3?").shape[1]
    assert res.text == pipe.decode(res.tokens)
    shown = repr(res)
    assert shown.startswith("GenerationResult(tokens=20,") and "acceptance_length=" in shown and len(shown) < 200


def test_a_stop_string_ends_the_text_before_it_and_keeps_the_tokens_that_produced_it():
    pipe = _demo()
    full = pipe.chat("What is 2+3?", max_new_tokens=30)
    assert "\n" in full.text
    res = pipe.chat("What is 2+3?", max_new_tokens=30, stop=["\n"])
    assert res.stop_reason == "stop" and res.text == full.text.split("\n")[0]
    assert full.tokens[: len(res.tokens)] == res.tokens and "\n" in pipe.decode(res.tokens)
    assert "\n" not in pipe.decode(res.tokens[:-1])
    assert sum(s.emitted for s in res.steps) + 1 == len(res.tokens)
    streamed = "".join(pipe.stream(pipe.encode_chat("What is 2+3?"), max_new_tokens=30, stop="\n"))
    assert streamed == res.text
    with pytest.raises(InvalidInputError, match="stop strings"):
        pipe.generate(PROMPT, max_new_tokens=4, stop=[""])
