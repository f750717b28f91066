"""The engine: per-request state, requests joining and leaving a running batch, one set of settings.

Every property is checked against a request decoded alone (``Pipeline.generate``, itself checked against
HF ``generate`` elsewhere): joining, leaving, sharing a pipeline between live streams or threads, and the
batched path's stop strings and stop reasons never change a request's tokens.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

import bastion
from bastion.contract.errors import BastionError, ComponentError, InvalidInputError
from bastion.controllers.budget import PLAIN_STEPS_MIN
from bastion.huggingface.causal_lm import HFTarget
from bastion.engine import Engine, GenerationConfig, SamplingParams
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model

NEW = 14


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model("qwen3", seed=0)


def _pipe(**kw) -> bastion.Pipeline:
    model = _model()
    kw.setdefault("budget_controller", bastion.registry.create("budget_controller", "fixed", budget=6))
    return bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=6, noise=0.6), max_nodes=12, **kw)


@functools.lru_cache(maxsize=None)
def _demo() -> bastion.Pipeline:
    return bastion.Pipeline.demo()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (int(length),), generator=gen).tolist() for length in torch.randint(2, 30, (n,), generator=gen)]


def _solo(pipe: bastion.Pipeline, prompt, **kw) -> list[int]:
    return pipe.generate(torch.tensor([prompt]) if isinstance(prompt, list) else prompt, **kw).tokens


def _cfg(new: int = NEW, **sampling) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new, sampling=SamplingParams(**sampling), stop_on_eos=False)


@pytest.mark.parametrize("pair", ["noisy-oracle", "demo-dflash"])
def test_a_request_added_mid_way_gives_its_solo_greedy_output_and_so_do_the_rows_it_joined(pair):
    pipe = _pipe() if pair == "noisy-oracle" else _demo()
    prompts = _prompts(5, seed=3) if pair == "noisy-oracle" else [pipe.encode_chat(q)[0].tolist() for q in ("What is 2+3?", "Name a prime.", "Count to five.", "Say hi.", "What is 7*6?")]
    engine = Engine(pipe)
    first = [engine.add(p, _cfg()) for p in prompts[:2]]
    for _ in range(3):
        engine.step()
    assert all(len(r.tokens) > 1 for r in first)  # they are mid-way when the others join
    joined = [engine.add(p, _cfg()) for p in prompts[2:4]]
    engine.step()
    assert len(engine.running) == 4
    engine.step()
    late = engine.add(prompts[4], _cfg())
    engine.run()
    for prompt, request in zip(prompts, [*first, *joined, late]):
        assert request.stop_reason == "length"
        assert request.tokens == _solo(pipe, prompt, max_new_tokens=NEW, stop_on_eos=False), prompt


def test_a_seeded_sampled_request_joining_mid_way_reproduces_its_solo_seeded_output():
    pipe = _pipe()
    prompts = _prompts(3, seed=5)
    engine = Engine(pipe)
    running = [engine.add(prompts[0], _cfg(temperature=0.8, seed=11)), engine.add(prompts[1], _cfg())]
    engine.step()
    engine.step()
    late = engine.add(prompts[2], _cfg(temperature=1.0, top_k=50, seed=4))
    engine.run()
    assert running[0].tokens == _solo(pipe, prompts[0], max_new_tokens=NEW, temperature=0.8, seed=11, stop_on_eos=False)
    assert running[1].tokens == _solo(pipe, prompts[1], max_new_tokens=NEW, stop_on_eos=False)
    assert late.tokens == _solo(pipe, prompts[2], max_new_tokens=NEW, temperature=1.0, top_k=50, seed=4, stop_on_eos=False)


def test_a_cancelled_row_leaves_the_batch_at_the_next_step_and_frees_its_cache_rows():
    pipe = _pipe()
    prompts = _prompts(3, seed=7)
    engine = Engine(pipe)
    requests = [engine.add(p, _cfg(new=40)) for p in prompts]
    engine.step()
    engine.step()
    assert engine._tb.batch_size == 3
    engine.cancel(requests[1])
    updates = engine.step()
    assert requests[1].stop_reason == "cancelled" and requests[1].result is not None
    assert any(u.request is requests[1] and u.finished for u in updates)
    assert engine._tb.batch_size == 2 and all(layer.keys.shape[0] == 2 for layer in engine._tb.cache.layers)
    waiting = engine.add(prompts[1], _cfg())
    engine.cancel(waiting)  # a waiting request is dropped at once
    assert waiting.stop_reason == "cancelled" and waiting not in engine.waiting
    engine.run()
    assert engine.idle and engine._tb is None  # every row left: the caches are gone
    for k in (0, 2):
        assert requests[k].tokens == _solo(pipe, prompts[k], max_new_tokens=40, stop_on_eos=False)


def test_max_running_bounds_the_batch_and_prefill_tokens_bounds_the_prompt_tokens_admitted_per_step():
    pipe = _pipe()
    prompts = [[5] * 20, [6] * 20, [7] * 20, [8] * 3]
    engine = Engine(pipe, max_running=2, prefill_tokens=30)
    requests = [engine.add(p, _cfg(new=12)) for p in prompts]
    engine.step()
    assert len(engine.running) == 1 and engine.last_step.admitted == 1  # 20 + 20 > 30 prompt tokens
    engine.step()
    assert len(engine.running) == 2  # then bounded by max_running
    sizes = []
    while not engine.idle:
        engine.step()
        sizes.append(len(engine.running))
    assert max(sizes) <= 2
    for prompt, request in zip(prompts, requests):
        assert request.tokens == _solo(pipe, prompt, max_new_tokens=12, stop_on_eos=False)


def test_a_component_that_raises_fails_only_its_steps_requests_and_the_engine_serves_the_next():
    class Flaky(bastion.core.BudgetController):
        calls = 0

        def choose(self, log_scores, context_len, latency, overhead_s):
            return 1

        def decide_width(self, *args, **kwargs):
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise RuntimeError("boom")
            return bastion.core.BudgetDecision(2)

    pipe = _pipe(budget_controller=Flaky())
    prompts = _prompts(3, seed=9)
    engine = Engine(pipe)
    hit = [engine.add(p, _cfg()) for p in prompts[:2]]
    engine.step()
    updates = engine.step()
    assert {u.request.id for u in updates if u.error is not None} == {r.id for r in hit}
    for request in hit:
        assert request.stop_reason == "error"
        assert isinstance(request.error, ComponentError) and "budget_controller Flaky.decide_width" in str(request.error)
    after = engine.add(prompts[2], _cfg())
    engine.run()
    assert after.stop_reason == "length" and len(after.tokens) == NEW


def test_two_live_streams_on_one_pipeline_advanced_alternately_each_give_their_solo_output():
    pipe = _demo()
    a, b = pipe.encode_chat("What is 2+3?"), pipe.encode_chat("Name a prime number and say why.")
    s1, s2 = pipe.stream(a, max_new_tokens=30), pipe.stream(b, max_new_tokens=30)
    chunks1, chunks2 = [], []
    live = {id(s1): (s1, chunks1), id(s2): (s2, chunks2)}
    while live:  # advance them in turn, one chunk each
        for key, (stream, chunks) in list(live.items()):
            chunk = next(stream, None)
            if chunk is None:
                del live[key]
            else:
                chunks.append(chunk)
    alone1, alone2 = pipe.generate(a, max_new_tokens=30), pipe.generate(b, max_new_tokens=30)
    assert s1.result.tokens == alone1.tokens and "".join(chunks1) == alone1.text
    assert s2.result.tokens == alone2.tokens and "".join(chunks2) == alone2.text
    assert list(s1) == [] and s1.result.tokens == alone1.tokens  # an exhausted stream keeps its result


def test_one_pipeline_called_from_four_threads_gives_every_call_its_solo_output():
    pipe = _pipe()
    prompts = _prompts(8, seed=13)
    expected = [_solo(pipe, p, max_new_tokens=NEW) for p in prompts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(k, len(prompts), 4):
                got[i] = _solo(pipe, prompts[i], max_new_tokens=NEW)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert [got[i] for i in range(len(prompts))] == expected


def test_generate_batch_reports_position_limit_as_generate_does():
    pipe = _pipe()
    limit = pipe.target.max_positions
    long = [5] * (limit - 3)
    batch = pipe.generate_batch([[7, 8, 9], long], 16, stop_on_eos=False)
    alone = pipe.generate(torch.tensor([long]), 16, stop_on_eos=False)
    assert batch[0].stop_reason == "length"
    assert batch[1].stop_reason == alone.stop_reason == "position-limit"
    assert batch[1].tokens == alone.tokens


def test_generate_batch_stops_each_row_at_its_stop_string_calls_on_step_per_row_and_streams_per_row():
    pipe = _demo()
    questions = ["What is 2+3?", "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"]
    texts = [pipe.generate(pipe.encode_chat(q), max_new_tokens=40).text for q in questions]
    tail = texts[1][len(texts[1]) // 2 :]
    stop = tail[tail.index(" ") + 1 :][:3]  # text from the second half of row 1's answer
    rows = [pipe.encode_chat(q)[0] for q in questions]
    seen: dict[int, int] = {}
    results = pipe.generate_batch(rows, max_new_tokens=40, stop=stop, on_step=lambda i, rec: seen.__setitem__(i, seen.get(i, 0) + 1))
    for q, res in zip(questions, results):
        alone = pipe.generate(pipe.encode_chat(q), max_new_tokens=40, stop=stop)
        assert res.tokens == alone.tokens and res.text == alone.text and res.stop_reason == alone.stop_reason
    assert results[1].stop_reason == "stop" and stop not in results[1].text
    assert results[1].steps and seen[1] == len(results[1].steps) and seen.get(0, 0) == len(results[0].steps)
    stream = pipe.stream_batch(rows, max_new_tokens=40)
    parts = ["", ""]
    for i, chunk in stream:
        parts[i] += chunk
    assert parts == texts and [r.text for r in stream.results] == texts


def test_generation_config_is_validated_once_and_keyword_arguments_keep_working():
    pipe = _pipe()
    prompt = torch.tensor([_prompts(1, seed=2)[0]])
    cfg = GenerationConfig(max_new_tokens=9, sampling=SamplingParams(temperature=0.7, seed=3), stop_on_eos=False)
    by_config = pipe.generate(prompt, config=cfg).tokens
    by_keywords = pipe.generate(prompt, 9, 0.7, 3, stop_on_eos=False).tokens
    assert by_config == by_keywords and len(by_config) == 9
    assert pipe.generate(prompt, config=cfg, max_new_tokens=4).tokens == by_config[:4]  # a keyword overrides
    assert pipe.generate_batch([prompt[0]] * 2, config=cfg)[0].tokens == by_config
    for bad in ({"stop_on_eos": "no"}, {"max_new_tokens": 0}, {"stop": [""]}):
        with pytest.raises(InvalidInputError):
            GenerationConfig(**bad)
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"seed": -1}):
        with pytest.raises(InvalidInputError):
            SamplingParams(**bad)
    with pytest.raises(InvalidInputError):
        pipe.generate(prompt, stop_on_eos="no")
    assert issubclass(InvalidInputError, BastionError)


def test_the_plain_controller_never_drafts_and_decodes_exactly_what_speculation_decodes():
    pipe = _pipe(budget_controller="plain")
    prompts = _prompts(3, seed=17)
    results = pipe.generate_batch(prompts, max_new_tokens=NEW, stop_on_eos=False)
    reference = _pipe()
    for prompt, res in zip(prompts, results):
        assert not any(s.drafted for s in res.steps) and all(s.budget == 1 for s in res.steps)
        assert res.tokens == _solo(reference, prompt, max_new_tokens=NEW, stop_on_eos=False)
    single = pipe.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW, stop_on_eos=False)
    assert not any(s.drafted for s in single.steps) and single.tokens == results[0].tokens


@pytest.mark.parametrize("pair", ["noisy-oracle", "demo-dflash"])
def test_a_long_prompt_prefilled_in_chunks_beside_running_rows_gives_its_solo_output_and_theirs(pair):
    pipe = _pipe() if pair == "noisy-oracle" else _demo()
    short = _prompts(2, seed=21) if pair == "noisy-oracle" else [pipe.encode_chat(q)[0].tolist() for q in ("What is 2+3?", "Say hi.")]
    gen = torch.Generator().manual_seed(5)
    long = torch.randint(3, 200, (70,), generator=gen).tolist()
    engine = Engine(pipe, prefill_chunk=16)
    running = [engine.add(p, _cfg(new=24)) for p in short]
    engine.step()
    late = engine.add(long, _cfg(new=12))
    steps_while_prefilling = 0
    while late.t_admitted is None:
        engine.step()
        steps_while_prefilling += 1
        assert all(len(r.tokens) > 0 for r in running)
    assert steps_while_prefilling == 5  # 70 tokens in chunks of 16: the others decoded at every one of them
    engine.run()
    assert late.tokens == _solo(pipe, long, max_new_tokens=12, stop_on_eos=False)
    for prompt, request in zip(short, running):
        assert request.tokens == _solo(pipe, prompt, max_new_tokens=24, stop_on_eos=False)


def test_a_prompt_one_position_short_of_the_limit_decodes_as_generate_does():
    pipe = _pipe()
    prompt = [5] * (pipe.target.max_positions - 1)
    batch = pipe.generate_batch([[7, 8, 9], prompt], 8, stop_on_eos=False)
    alone = pipe.generate(torch.tensor([prompt]), 8, stop_on_eos=False)
    assert batch[1].tokens == alone.tokens and batch[1].stop_reason == alone.stop_reason == "position-limit"


def test_on_admitted_gets_the_newcomers_first_tokens_before_the_step_decodes_and_the_step_returns_the_rest():
    pipe = _pipe()
    prompts = _prompts(3, seed=5)
    plain_engine, early_engine = Engine(pipe), Engine(pipe)
    plain_reqs = [plain_engine.add(p, _cfg()) for p in prompts]
    early_reqs = [early_engine.add(p, _cfg()) for p in prompts]
    plain_updates = plain_engine.step()
    handed: list = []
    steps_when_handed: list[int] = []

    def on_admitted(updates):
        handed.extend(updates)
        steps_when_handed.append(sum(len(r.steps) for r in early_reqs))  # no decode step recorded yet

    returned = early_engine.step(on_admitted=on_admitted)
    assert steps_when_handed == [0] and sum(len(r.steps) for r in early_reqs) == 3
    assert [len(u.tokens) for u in handed] == [1, 1, 1]  # each newcomer's prefill token, alone
    key = lambda u: (prompts.index(u.request.prompt.tolist()), u.tokens, u.finished)  # noqa: E731
    assert sorted(map(key, handed + returned)) == sorted(map(key, plain_updates))
    assert not set(map(id, handed)) & set(map(id, returned))
    plain_engine.run(), early_engine.run()
    assert [r.tokens for r in early_reqs] == [r.tokens for r in plain_reqs] == [_solo(pipe, p, max_new_tokens=NEW, stop_on_eos=False) for p in prompts]


def test_a_batch_drafts_only_once_a_plain_step_at_its_size_was_measured_there():
    """The gate judges a batch's drafting against a plain step at its size, so that price is measured
    (:data:`PLAIN_STEPS_MIN` plain steps at the size) before the batch drafts, not extrapolated from other
    sizes. Extrapolated from a cold first plain step at 2 rows (17.9 ms outside its forward), a server's
    batch of 16 once priced a plain step's seconds outside its forward at 83 ms, so every drafted step
    'realized' 2-4x that price: it drafted on 89% of its steps and served 0.64x a server that did not."""
    pipe = bastion.Pipeline.demo()
    questions = ("What is 2+3?", "Name a prime.", "Count to five.", "What is 7*6?")
    engine = Engine(pipe)
    for q in questions:
        engine.add(pipe.encode_chat(q)[0].tolist(), _cfg(24))
    steps = []
    while not engine.idle:
        engine.step()
        if engine.last_step is not None:
            steps.append((engine.last_step.batch_size, engine.last_step.drafted))
    at_four = [drafted for rows, drafted in steps if rows == 4]
    assert at_four[:PLAIN_STEPS_MIN] == [False] * PLAIN_STEPS_MIN, steps
    assert pipe._batch_costs.plain.count(4) >= PLAIN_STEPS_MIN
