"""The engine thread's hand-off to the front end (no HTTP): what reaches a request's stream, and when."""

from __future__ import annotations

import asyncio
import functools

import pytest

import bastion
from bastion.engine import GenerationConfig
from bastion.serve import worker as worker_module
from bastion.serve.prepare import Prepared
from bastion.serve.worker import Delta, EngineWorker, Finished, Rejected


@functools.lru_cache(maxsize=None)
def _pipe() -> bastion.Pipeline:
    """The demo pair (a tokenizer: the server's requests ask for text) drafting on every step."""
    return bastion.Pipeline.demo(budget_controller="fixed", component_options={"budget_controller": {"budget": 8}})


def test_a_newcomers_first_token_reaches_its_stream_before_the_step_that_admitted_it_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first token comes from the prefill: a stream gets it as soon as the prompt is in, not one decode
    step later (on a drafting pipeline that step drafts, builds and verifies a tree: most of the time to
    first token a client saw)."""
    log: list[str] = []
    real_push = worker_module.push_all

    def push_all(items):  # the engine thread handing events to the front end's loop
        log.extend(f"push {type(event).__name__}" for _, event in items)
        real_push(items)

    monkeypatch.setattr(worker_module, "push_all", push_all)
    worker = EngineWorker(_pipe(), max_running=4)
    real_decode = worker._engine._decode

    def decode(*args, **kwargs):
        log.append("decode")
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(worker._engine, "_decode", decode)
    config = GenerationConfig(max_new_tokens=8, stop_on_eos=False)

    async def main() -> list[object]:
        worker.start()
        ticket = worker.submit(lambda pipe: Prepared(pipe.encode_chat("What is 2+3?")[0].tolist(), config))
        events = []
        while not events or not isinstance(events[-1], (Finished, Rejected)):
            events.append(await asyncio.wait_for(ticket.next_event(), 60))
        return events

    try:
        events = asyncio.run(main())
    finally:
        worker.stop()
    deltas = [e for e in events if isinstance(e, Delta)]
    assert deltas[0].tokens == 1  # the prefill's token, alone
    assert sum(d.tokens for d in deltas) == 8 and events[-1].completion_tokens == 8
    assert log.index("push Delta") < log.index("decode"), log
