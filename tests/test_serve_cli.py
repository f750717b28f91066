"""`bastion serve` as a command: startup lines, and SIGTERM draining the open requests and exiting 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from bastion.cli.main import build_parser
from bastion.cli.serve_cmd import served_model_name


def test_served_model_name_defaults_to_the_targets_name(tmp_path: Any) -> None:
    parse = build_parser().parse_args
    assert served_model_name(parse(["serve"])) == "bastion-demo"
    assert served_model_name(parse(["serve", "--target", "Qwen/Qwen3-8B", "--drafter", "d"])) == "Qwen/Qwen3-8B"
    assert served_model_name(parse(["serve", "--target", str(tmp_path), "--drafter", "d"])) == tmp_path.name
    assert served_model_name(parse(["serve", "--served-model-name", "prod"])) == "prod"


def test_bad_server_settings_fail_before_any_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    from bastion.cli.main import main

    assert main(["serve", "--max-running", "0"]) == 2
    assert "max_running" in capsys.readouterr().err


def _stream(url: str, body: dict[str, Any], out: list[Any]) -> None:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        out.append(r.status_code)
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    out.append(events)


def test_sigterm_drains_open_requests_and_exits_zero() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "bastion", "serve", "--port", "0", "--drain-timeout", "30"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    try:
        lines = []
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            url = found.group(1) if found else None
        assert url is not None, "".join(lines)
        lines.append(proc.stderr.readline())
        assert "bastion-demo" in lines[-2] and "budget_controller=BastionController" in lines[-1]
        results: list[list[Any]] = [[], []]
        bodies = [{"model": "bastion-demo", "prompt": p, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
                  for p in ("Once upon a time", "What is 2+3?")]
        threads = [threading.Thread(target=_stream, args=(url, b, r)) for b, r in zip(bodies, results)]
        for t in threads:
            t.start()
        while not all(results):  # both streams answered (accepted) before the signal
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        refused = None
        while refused is None and time.monotonic() < deadline:
            try:
                refused = httpx.post(url + "/v1/completions", json={"model": "bastion-demo", "prompt": "x"}, timeout=10)
            except httpx.TransportError:  # the drain is over already: the assertion below fails
                break
            if refused.status_code != 503:
                refused = None
                time.sleep(0.01)
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        for status, events in results:
            assert status == 200 and events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert last["choices"][0]["finish_reason"] == "length"  # ran to its end, not cut by the shutdown
            assert len([e for e in events if '"text":"' in e]) >= 2
        assert refused is not None and refused.headers.get("Retry-After")  # refused while the streams drained
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
