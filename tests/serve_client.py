"""What the serving tests share: an official ``openai`` client on a test server, one metric read from its
``/metrics``, and a wait until the server has nothing open."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families


def client(server: Any, timeout: float = 30) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def metric(server: Any, name: str, **labels: str) -> float:
    """The value of the sample ``name`` with ``labels`` (0.0 when the server has none yet)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def wait_idle(server: Any, timeout: float = 10.0) -> None:
    """Wait until the server's engine has no request open (and say so if it still has)."""
    deadline = time.monotonic() + timeout
    while server.worker.open_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.worker.open_requests == 0


def stream_started(server: Any, model: str, prompt: str, max_tokens: int, chunks: int = 2) -> Any:
    """A streamed greedy completion (end of sequence ignored) read until ``chunks`` text chunks came: the
    open stream, for a test to leave mid-way."""
    stream = client(server).completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
    seen = 0
    for ch in stream:
        seen += bool(ch.choices and ch.choices[0].text)
        if seen >= chunks:
            break
    return stream
