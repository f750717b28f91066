"""`bastion serve` end to end: the official openai client against servers on loopback ports.

One demo pipeline per module. Servers run in background threads on free ports; at most one engine
steps at a time (every test waits for its requests to end), and offline expectations come from
``Pipeline.generate`` while the servers are idle.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families
from serve_client import client, metric, stream_started, wait_idle

from bastion.serve import BastionServer, ServeSettings

MODEL = "bastion-demo"
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April.",
    "What is 2+3?",
    "def fibonacci(n):",
    "Once upon a time",
    "The capital of France is",
    "Write a haiku about rain.",
    "import numpy as np\n",
    "Q: How many legs does a spider have?\nA:",
    "A train leaves at 3pm and travels 60 miles.",
    "List three colors:",
    "class Stack:",
    "Tom has 5 apples and eats 2.",
    "The quick brown fox",
    "Translate 'hello' into French:",
    "for i in range(10):",
    "Sum of 17 and 25 is",
]


class StepHooks:
    """Patches a budget controller instance: ``delay`` seconds of sleep per engine step, and
    ``fail_next`` makes its next drafting question (``speculate`` for a batch of one, else
    ``speculate_batch``) raise once (a component failing mid-step)."""

    def __init__(self, controller: Any) -> None:
        self.delay = 0.0
        self.fail_next = False
        for name in ("speculate", "speculate_batch"):
            setattr(controller, name, self._hooked(getattr(controller, name)))

    def _hooked(self, real: Any) -> Any:
        def hooked(*args: Any, **kwargs: Any) -> bool:
            if self.delay:
                time.sleep(self.delay)
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("injected failure")
            return real(*args, **kwargs)

        return hooked


@pytest.fixture(scope="module")
def pipe() -> Any:
    import bastion

    p = bastion.Pipeline.demo()
    p.hooks = StepHooks(p.budget_controller)
    return p


@contextmanager
def serving(pipe: Any, **settings: Any) -> Iterator[BastionServer]:
    server = BastionServer(pipe, ServeSettings(port=0, **settings)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(pipe: Any) -> Iterator[BastionServer]:
    with serving(pipe, max_running=16, max_queue=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_server(pipe: Any) -> Iterator[BastionServer]:
    """One running row and one queued request at most."""
    with serving(pipe, max_running=1, max_queue=1) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _quiet_engine(pipe: Any) -> Iterator[None]:
    """Each test starts with no delay or armed failure, and leaves its servers with nothing open."""
    pipe.hooks.delay, pipe.hooks.fail_next = 0.0, False
    yield
    pipe.hooks.delay, pipe.hooks.fail_next = 0.0, False


def aclient(server: BastionServer) -> Any:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


_offline: dict[tuple[Any, ...], Any] = {}


def offline(pipe: Any, prompt: str, max_tokens: int, *, chat: bool = False, **kw: Any) -> Any:
    """``Pipeline.generate``'s result for a prompt (raw text or one chat user turn)."""
    key = (prompt, max_tokens, chat, tuple(sorted(kw.items())))
    if key not in _offline:
        ids = pipe.encode_chat([{"role": "user", "content": prompt}]) if chat else pipe.encode(prompt)
        _offline[key] = pipe.generate(ids, max_tokens, **kw)
    return _offline[key]


# ------------------------------------------------------------------------------------------ equality
def test_completions_streamed_and_not_equal_offline_generate(pipe: Any, server: BastionServer) -> None:
    c = client(server)
    for prompt in PROMPTS[:3]:
        want = offline(pipe, prompt, 16)
        got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == ("stop" if want.stop_reason == "eos" else "length")
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_len, len(want.tokens))
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.tokens)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == got.choices[0].finish_reason



def test_a_request_answered_whole_gets_no_per_step_events_and_a_stream_gets_them(pipe: Any, server: BastionServer,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from bastion.serve import worker as worker_mod

    seen: list[tuple[bool, str]] = []
    real = worker_mod.Ticket.receive

    def spy(self: Any, event: Any) -> None:
        seen.append((self.deltas, type(event).__name__))
        real(self, event)

    monkeypatch.setattr(worker_mod.Ticket, "receive", spy)
    c = client(server)
    want = offline(pipe, PROMPTS[0], 16)
    assert c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0).choices[0].text == want.text
    whole = [kind for deltas, kind in seen if not deltas]
    assert whole == ["Accepted", "Finished"]  # the engine's steps never woke the event loop for it
    seen.clear()
    chunks = list(c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    kinds = [kind for deltas, kind in seen if deltas]
    assert kinds[0] == "Accepted" and kinds[-1] == "Finished" and kinds.count("Delta") >= 1

def test_completion_from_token_ids_equals_offline_generate(pipe: Any, server: BastionServer) -> None:
    ids = pipe.encode(PROMPTS[4])[0].tolist()
    want = offline(pipe, PROMPTS[4], 12)
    got = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == len(ids)


def test_chat_streamed_and_not_equals_offline_generate(pipe: Any, server: BastionServer) -> None:
    c = client(server)
    for prompt in PROMPTS[1:3]:
        want = offline(pipe, prompt, 24, chat=True)
        messages = [{"role": "user", "content": prompt}]
        got = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
        assert got.usage.completion_tokens == len(want.tokens) and got.usage.prompt_tokens == want.prompt_len
        chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_chat_without_max_tokens_runs_to_its_end(pipe: Any, server: BastionServer) -> None:
    want = offline(pipe, PROMPTS[1], 256, chat=True)
    got = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0)
    assert got.choices[0].message.content == want.text


def test_seeded_sampling_equals_offline_seeded_output(pipe: Any, server: BastionServer) -> None:
    want = offline(pipe, PROMPTS[3], 16, temperature=0.8, seed=1234)
    got = client(server).completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0.8, seed=1234)
    assert got.choices[0].text == want.text


def test_stop_strings_end_the_text_as_offline(pipe: Any, server: BastionServer) -> None:
    full = offline(pipe, PROMPTS[0], 16).text
    stop = full.split()[2]  # a word in the middle of the greedy output
    want = offline(pipe, PROMPTS[0], 16, stop=(stop,))
    assert want.stop_reason == "stop" and want.text == full[: full.index(stop)]
    got = client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop, "@@"])
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_each_equal_their_solo_output(pipe: Any, server: BastionServer) -> None:
    wants = [offline(pipe, p, 8 + (i % 3) * 4) for i, p in enumerate(PROMPTS)]
    before = metric(server, "bastion_step_batch_size_sum")

    async def one(c: Any, i: int) -> str:
        stream = await c.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=8 + (i % 3) * 4, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def all_at_once() -> list[str]:
        c = aclient(server)
        try:
            return await asyncio.gather(*(one(c, i) for i in range(len(PROMPTS))))
        finally:
            await c.close()

    got = asyncio.run(all_at_once())
    assert got == [w.text for w in wants]
    rows = metric(server, "bastion_step_batch_size_sum") - before
    assert rows > sum(len(w.tokens) for w in wants) / 4  # the steps decoded many rows at once


def test_a_request_joining_a_running_batch_equals_its_solo_output(pipe: Any, server: BastionServer) -> None:
    long_want = offline(pipe, PROMPTS[5], 96, stop_on_eos=False)
    join_want = offline(pipe, PROMPTS[6], 12)

    def shared_steps() -> float:  # steps that decoded two rows or more
        return metric(server, "bastion_step_batch_size_count") - metric(server, "bastion_step_batch_size_bucket", le="1.0")

    before = shared_steps()
    pipe.hooks.delay = 0.05  # 96 tokens, at most 16 per step: the first request decodes for >= 0.3 s
    c = client(server)
    stream = c.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=96, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    texts, joined = [], None
    for ch in stream:
        texts.extend(x.text for x in ch.choices)
        if joined is None and len(texts) >= 2:
            assert server.worker.open_requests == 1  # the first request is still decoding
            joined = c.completions.create(model=MODEL, prompt=PROMPTS[6], max_tokens=12, temperature=0)
            pipe.hooks.delay = 0.0
    assert joined is not None and joined.choices[0].text == join_want.text
    assert "".join(texts) == long_want.text
    assert shared_steps() > before  # the newcomer decoded in the same batch as the running request


# ------------------------------------------------------------------------------------------ endpoints
def test_models_health_and_metrics_endpoints(server: BastionServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics", timeout=10).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {
        "bastion_requests_running", "bastion_requests_waiting", "bastion_prompt_tokens", "bastion_completion_tokens",
        "bastion_step_tokens", "bastion_step_width", "bastion_drafted_step_share", "bastion_queue_seconds",
        "bastion_time_to_first_token_seconds", "bastion_requests_finished",
    } <= names
    assert httpx.get(server.url + "/nowhere", timeout=10).json()["error"]["message"]


def test_metrics_count_tokens_and_finished_requests(pipe: Any, server: BastionServer) -> None:
    want = offline(pipe, PROMPTS[7], 8)
    before = (metric(server, "bastion_completion_tokens_total"), metric(server, "bastion_prompt_tokens_total"),
              metric(server, "bastion_time_to_first_token_seconds_count"))
    client(server).completions.create(model=MODEL, prompt=PROMPTS[7], max_tokens=8, temperature=0)
    wait_idle(server)
    after = (metric(server, "bastion_completion_tokens_total"), metric(server, "bastion_prompt_tokens_total"),
             metric(server, "bastion_time_to_first_token_seconds_count"))
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (len(want.tokens), want.prompt_len, 1)
    assert metric(server, "bastion_requests_running") == 0 and metric(server, "bastion_requests_waiting") == 0


# ------------------------------------------------------------------------------------------ errors
def _completion_400s(pipe: Any) -> list[tuple[dict[str, Any], str | None]]:
    limit = pipe.target.max_positions
    return [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": limit}, "max_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [5] * limit}, "prompt"),
        ({"prompt": [pipe.target.vocab_size + 7]}, "prompt"),
        ({"model": "gpt-4o"}, "model"),
        ({"n": 2}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"logit_bias": {"17": 3}}, "logit_bias"),
        ({"made_up_field": 1}, "made_up_field"),
    ]


def test_each_bad_request_gets_a_400_and_the_next_good_one_succeeds(pipe: Any, server: BastionServer) -> None:
    c = client(server)
    good = offline(pipe, PROMPTS[2], 4)
    for fields, param in _completion_400s(pipe):
        body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, **fields}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 400, fields
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (fields, error)
        assert error["message"] and error["type"] == "invalid_request_error"
        assert c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0).choices[0].text == good.text
    malformed = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "bastion-demo", "messages": [',
                           headers={"content-type": "application/json"}, timeout=10)
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"
    for fields, param in [({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
                          ({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"messages": []}, "messages"),
                          ({"max_completion_tokens": 10_000}, "max_completion_tokens")]:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(**{"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})
        assert info.value.status_code == 400 and info.value.response.json()["error"]["param"] == param
    assert c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0).choices[0].text == good.text
    wait_idle(server)


def test_client_disconnect_mid_stream_frees_its_row(server: BastionServer) -> None:
    pipe_delay = server.pipe.hooks
    pipe_delay.delay = 0.02
    cancelled = metric(server, "bastion_requests_finished_total", reason="cancelled")
    tokens = metric(server, "bastion_completion_tokens_total")
    stream = stream_started(server, MODEL, PROMPTS[3], 600)
    assert metric(server, "bastion_requests_running") == 1
    stream.close()
    deadline = time.monotonic() + 5
    while metric(server, "bastion_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(server, "bastion_requests_running") == 0
    assert metric(server, "bastion_requests_finished_total", reason="cancelled") == cancelled + 1
    assert metric(server, "bastion_completion_tokens_total") - tokens < 300  # it left long before its 600 tokens
    wait_idle(server)


def test_a_full_queue_gets_503_with_retry_after(pipe: Any, small_server: BastionServer) -> None:
    want = offline(pipe, PROMPTS[8], 8)
    pipe.hooks.delay = 0.05  # the running request needs >= 1.25 s: it outlasts the next two requests' arrival
    c = client(small_server)
    running = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=400, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
    next(iter(running))
    queued = c.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=8, temperature=0, stream=True)
    with pytest.raises(openai.APIStatusError) as info:
        c.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=8, temperature=0)
    assert info.value.status_code == 503 and int(info.value.response.headers["Retry-After"]) >= 1
    assert info.value.response.json()["error"]["code"] == "queue_full"
    running.close()
    assert "".join(ch.choices[0].text for ch in queued if ch.choices) == want.text
    wait_idle(small_server)


def test_a_component_failing_mid_step_fails_only_that_steps_requests(pipe: Any, small_server: BastionServer) -> None:
    want = offline(pipe, PROMPTS[10], 12)
    pipe.hooks.delay = 0.05
    c = client(small_server)
    doomed = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=400, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(doomed))
    waiting = c.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=12, temperature=0, stream=True)
    pipe.hooks.fail_next = True
    with pytest.raises(openai.APIError) as info:
        for _ in doomed:
            pass
    assert "budget_controller" in str(info.value) and "BastionController.speculate" in str(info.value)
    assert "".join(ch.choices[0].text for ch in waiting if ch.choices) == want.text  # not in the failed step
    pipe.hooks.fail_next = True
    with pytest.raises(openai.InternalServerError) as failed:
        c.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=12, temperature=0)
    assert failed.value.status_code == 500 and "BastionController.speculate" in failed.value.response.json()["error"]["message"]
    after = c.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=12, temperature=0)
    assert after.choices[0].text == want.text
    assert metric(small_server, "bastion_requests_finished_total", reason="error") == 2
    wait_idle(small_server)


def test_a_drain_refuses_new_work_and_cancels_what_outlives_its_timeout(pipe: Any) -> None:
    pipe.hooks.delay = 0.05  # >= 2.8 s for 900 tokens (at most 16 per step): longer than the drain timeout
    server = BastionServer(pipe, ServeSettings(port=0, drain_timeout=1.5)).start()
    try:
        c = client(server)
        long = c.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=900, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
        next(iter(long))
        server.request_drain()
        deadline = time.monotonic() + 5
        while not server.state.draining and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and refused.headers["Retry-After"] and refused.json()["error"]["code"] == "draining"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        with pytest.raises(openai.APIError) as info:
            for _ in long:
                pass
        assert "cancelled" in str(info.value)
        assert server.wait(10)
        assert server.drained_in is not None and server.drained_in < 5
    finally:
        server.stop()


def test_steps_that_arrive_while_a_stream_waits_go_out_as_one_chunk_with_the_same_text() -> None:
    import json as _json
    from types import SimpleNamespace

    from bastion.serve.app import _stream
    from bastion.serve.worker import Delta, Finished, Ticket

    async def run() -> list[str]:
        ticket = Ticket(lambda: None, asyncio.get_running_loop())
        for text in ("Once", " upon", " a time"):  # three steps delivered before the stream reads any
            ticket.receive(Delta(text, 1))
        ticket.receive(Finished("length", 4, 3, "Once upon a time", None))
        state = SimpleNamespace(model_name=MODEL, worker=SimpleNamespace(cancel=lambda t: None))
        return [piece async for piece in _stream(state, ticket, "cmpl-1", chat=False, include_usage=False)]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n"
    bodies = [_json.loads(e[len("data: "):]) for e in events[:-1]]
    texts = [b["choices"][0]["text"] for b in bodies]
    assert texts == ["Once upon a time", ""]  # one text chunk, then the finish chunk
    assert bodies[-1]["choices"][0]["finish_reason"] == "length"
