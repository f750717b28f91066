"""A bounded soak of `bastion serve`: 200 short requests of mixed prompt and output lengths at
concurrency 8, a tenth of them cancelled mid-stream. Every completed greedy request equals its offline
output, nothing is left running or waiting at rest, and the server's memory does not grow."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families

from bastion.serve import BastionServer, ServeSettings

MODEL = "bastion-demo"
SEEDS = [
    "Natalia sold clips to 48 of her friends in April.",
    "def quicksort(xs):",
    "The history of the printing press",
    "Q: What is 12 times 7?\nA:",
    "Write a short poem about the sea.",
    "import os\nimport sys\n",
    "A farmer has 17 sheep and buys 5 more.",
    "Once upon a time in a small village",
    "List the planets of the solar system:",
    "class LinkedList:",
]
LENGTHS = (4, 8, 16)
TOTAL, FIRST, CONCURRENCY = 200, 50, 8


def _prompts() -> list[str]:
    """Twenty prompts from a few tokens to a couple of hundred."""
    return SEEDS + [" ".join([s] * (3 + 2 * i)) for i, s in enumerate(SEEDS)]


def _rss_bytes() -> int:
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("RSS is read from /proc (Linux)")
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no VmRSS in /proc/self/status")


def _metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    return 0.0


def test_soak_outputs_stay_exact_and_nothing_leaks() -> None:
    import bastion

    pipe = bastion.Pipeline.demo()
    prompts = _prompts()
    longest = max(LENGTHS)
    offline = {p: pipe.generate(pipe.encode(p), longest).tokens for p in prompts}
    # request k: prompt k % 20, output limit cycling through LENGTHS; every tenth is cancelled mid-stream
    plan = [(prompts[k % len(prompts)], LENGTHS[(k // len(prompts)) % len(LENGTHS)], k % 10 == 9) for k in range(TOTAL)]
    expected = {(p, m): pipe.decode(offline[p][:m]) for p, m, _ in plan}

    with BastionServer(pipe, ServeSettings(port=0, max_running=CONCURRENCY)) as server:
        async def one(c: Any, gate: asyncio.Semaphore, k: int) -> tuple[int, str | None, int]:
            prompt, m, cancel = plan[k]
            async with gate:
                stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=m, temperature=0, stream=True,
                                                    stream_options={"include_usage": True})
                text, used = [], -1
                async for chunk in stream:
                    text.extend(x.text for x in chunk.choices)
                    if chunk.usage is not None:
                        used = chunk.usage.completion_tokens
                    if cancel and any(text):
                        break
                await stream.close()
                return (k, None, -1) if cancel else (k, "".join(text), used)

        async def run(ks: range) -> list[tuple[int, str | None, int]]:
            c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            gate = asyncio.Semaphore(CONCURRENCY)
            try:
                return await asyncio.gather(*(one(c, gate, k) for k in ks))
            finally:
                await c.close()

        def settle() -> None:
            deadline = time.monotonic() + 10
            while server.worker.open_requests and time.monotonic() < deadline:
                time.sleep(0.01)
            gc.collect()

        results = asyncio.run(run(range(FIRST)))
        settle()
        rss_first = _rss_bytes()
        results += asyncio.run(run(range(FIRST, TOTAL)))
        settle()
        rss_end = _rss_bytes()

        completed = [(k, text, used) for k, text, used in results if text is not None]
        assert len(completed) == TOTAL - TOTAL // 10
        for k, text, used in completed:
            prompt, m, _ = plan[k]
            assert text == expected[(prompt, m)], (k, prompt[:40], m)
            assert used == len(offline[prompt][:m])
        assert _metric(server.url, "bastion_requests_running") == 0
        assert _metric(server.url, "bastion_requests_waiting") == 0
        assert server.worker.open_requests == 0 and server.worker._engine.idle
        assert abs(rss_end - rss_first) <= 0.10 * rss_first, (rss_first, rss_end)
