"""`bastion serve` with its engine in a process of its own (`BastionServer.spawn`, the command's default):
the same answers as offline decoding, metrics made in the engine process and shown by the server's,
cancellation across the pipe, a build that fails, and an engine process that dies.

Each spawned engine is a fresh interpreter that loads the demo pair (a few seconds): one server for the
module, one more for the test that kills its engine.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_client import client, metric, stream_started, wait_idle

import bastion
from bastion.contract.errors import InvalidInputError
from bastion.engine import StepSummary
from bastion.serve import BastionServer, ServeSettings
from bastion.serve.metrics import MetricsRecorder, ServeMetrics, replay
from bastion.serve.process import EngineProcess, EngineStartError

MODEL = "bastion-demo"
PROMPTS = ["Natalia sold clips to 48 of her friends in April.", "def fibonacci(n):", "Once upon a time"]


def _refuse_to_build(message: str) -> Any:
    raise InvalidInputError(message)


def _break_while_building() -> Any:
    raise RuntimeError("the checkpoint is corrupt")


@pytest.fixture(scope="module")
def pipe() -> bastion.Pipeline:
    """The offline oracle: the demo pair in this process."""
    return bastion.Pipeline.demo()


@pytest.fixture(scope="module")
def server() -> Iterator[BastionServer]:
    server = BastionServer.spawn(functools.partial(bastion.Pipeline.demo), ServeSettings(port=0, max_running=8)).start()
    try:
        yield server
    finally:
        server.stop()


def test_a_spawned_engine_answers_as_offline_generate_streamed_or_not(pipe: bastion.Pipeline, server: BastionServer) -> None:
    assert server.pipe is None and isinstance(server.worker, EngineProcess)
    assert server.worker.info["components"]["budget_controller"] == type(pipe.budget_controller).__name__
    c = client(server)
    for prompt in PROMPTS:
        want = pipe.generate(pipe.encode(prompt), 16)
        got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want.text
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_len, len(want.tokens))
        chunks = list(c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    want = pipe.generate(pipe.encode_chat([{"role": "user", "content": "What is 2+3?"}]), 12)
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+3?"}], max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want.text
    wait_idle(server, 20)


def test_the_engine_process_metrics_reach_the_servers_metrics_endpoint(server: BastionServer) -> None:
    before = {name: metric(server, name) for name in ("bastion_completion_tokens_total", "bastion_steps_total", "bastion_prompt_tokens_total")}
    got = client(server).completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=10, temperature=0)
    wait_idle(server, 20)
    deadline = time.monotonic() + 5  # the step's metrics may trail its events by one message
    while metric(server, "bastion_completion_tokens_total") < before["bastion_completion_tokens_total"] + 10 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(server, "bastion_completion_tokens_total") - before["bastion_completion_tokens_total"] == got.usage.completion_tokens
    assert metric(server, "bastion_prompt_tokens_total") - before["bastion_prompt_tokens_total"] == got.usage.prompt_tokens
    assert metric(server, "bastion_steps_total") > before["bastion_steps_total"]
    assert metric(server, "bastion_requests_running") == 0 and metric(server, "bastion_requests_waiting") == 0


def test_a_client_disconnect_cancels_its_row_across_the_pipe(server: BastionServer) -> None:
    cancelled = metric(server, "bastion_requests_finished_total", reason="cancelled")
    tokens = metric(server, "bastion_completion_tokens_total")
    stream = stream_started(server, MODEL, PROMPTS[1], 900)
    stream.close()
    deadline = time.monotonic() + 10
    while metric(server, "bastion_requests_finished_total", reason="cancelled") < cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(server, "bastion_requests_finished_total", reason="cancelled") == cancelled + 1
    assert metric(server, "bastion_requests_running") == 0
    assert metric(server, "bastion_completion_tokens_total") - tokens < 600  # it left long before its 900 tokens
    wait_idle(server, 20)


def test_a_build_that_refuses_its_input_says_why_and_one_that_breaks_names_the_error() -> None:
    with pytest.raises(EngineStartError) as refused:
        BastionServer.spawn(functools.partial(_refuse_to_build, "--target needs a --drafter"), ServeSettings(port=0))
    assert refused.value.bad_input and str(refused.value) == "--target needs a --drafter"
    with pytest.raises(EngineStartError) as broken:
        EngineProcess(_break_while_building)
    assert not broken.value.bad_input and "RuntimeError: the checkpoint is corrupt" in str(broken.value)


def test_an_engine_process_that_dies_fails_its_open_requests_and_the_server_says_503() -> None:
    server = BastionServer.spawn(functools.partial(bastion.Pipeline.demo), ServeSettings(port=0)).start()
    try:
        c = client(server)
        stream = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=900, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        server.worker._process.kill()
        with pytest.raises(openai.APIError) as ended:
            for _ in stream:
                pass
        assert "engine process exited" in str(ended.value)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=10).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        with pytest.raises(openai.APIStatusError) as refused:
            c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.response.json()["error"]["code"] == "engine_down"
        assert server.worker.open_requests == 0
    finally:
        server.stop()


def test_recorded_metrics_calls_replayed_give_the_metrics_the_direct_calls_give() -> None:
    direct, replayed, recorder = ServeMetrics(), ServeMetrics(), MetricsRecorder()
    step = StepSummary(batch_size=3, width=8, drafted=True, emitted=7, seconds=0.02, admitted=1)

    class Request:  # what observe_first_token reads of an engine request
        t_queued, t_admitted, t_first_token = 10.0, 10.5, 10.75

    for sink in (direct, recorder):
        sink.count_prompt_tokens(12)
        sink.count_completion_tokens(7)
        sink.count_finished("eos")
        sink.count_rejected("queue_full")
        sink.observe_step(step)
        sink.observe_queue(3, 2)
        sink.observe_queue(3, 2)  # unchanged: recorded once
        sink.observe_first_token(Request())
    calls = recorder.take()
    assert [name for name, _ in calls].count("observe_queue") == 1 and recorder.take() == []
    replay(replayed, calls)

    def samples(m: ServeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in m.registry.collect() for s in f.samples
                if not s.name.endswith("_created")}

    assert samples(replayed) == samples(direct)
    assert samples(direct)[("bastion_time_to_first_token_seconds_sum", ())] == 0.75
    with pytest.raises(ValueError):
        replay(replayed, [("render", ())])


def test_a_request_whose_preparation_does_not_pickle_fails_alone_and_the_engine_serves_the_next(server: BastionServer) -> None:
    """What the app submits is plain data and a module-level function; anything else cannot reach the engine
    process: that request is refused with a 500 and leaves nothing open, and the next request is served."""
    import asyncio

    from bastion.serve.worker import Rejected

    async def submit() -> Any:
        ticket = server.worker.submit(lambda pipe: None)  # a lambda does not pickle
        return await asyncio.wait_for(ticket.next_event(), 10)

    event = asyncio.run(submit())
    assert isinstance(event, Rejected) and event.error.status == 500
    assert server.worker.open_requests == 0
    got = client(server).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert got.usage.completion_tokens == 4
