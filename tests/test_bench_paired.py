"""Ratios paired within rounds (bastion.bench.paired) and the serving benchmark's use of them."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.bench.paired import paired_ratios, ratio_table

ROOT = Path(__file__).resolve().parents[1]


def _rates(**by_setting: float) -> dict[tuple[str, int], float]:
    return {(name.replace("_", ":"), 1): rate for name, rate in by_setting.items()}


def test_paired_ratios_take_what_every_round_said_not_a_ratio_of_rounds_minutes_apart():
    """Round 2 ran on a machine 1.5x faster: bastion over plain is 1.2 in every round, and over fixed:8
    0.96, 0.9 and 0.88 -> medians 1.2 and 0.9; a ratio of bastion's fastest round (round 2) over
    fixed:8's would agree here only because both peaked in the same round."""
    rounds = [
        _rates(bastion=120.0, plain=100.0, fixed_8=125.0),
        _rates(bastion=180.0, plain=150.0, fixed_8=200.0),
        _rates(bastion=132.0, plain=110.0, fixed_8=150.0),
    ]
    ratios = {r.against: r for r in paired_ratios(rounds, "bastion", ["plain", "fixed:8"])}
    assert ratios["plain"].median == pytest.approx(1.2) and ratios["plain"].low == pytest.approx(1.2)
    assert ratios["fixed:8"].median == pytest.approx(0.9)
    assert (ratios["fixed:8"].low, ratios["fixed:8"].high) == (pytest.approx(0.88), pytest.approx(0.96))
    assert ratios["best"].median == pytest.approx(0.9) and ratios["best"].rounds == 3


def test_the_best_of_the_others_is_taken_within_each_round():
    """Plain is fastest in round 1 and fixed:8 in round 2: 'best' is bastion over whichever was faster
    in that same round (0.8, then 100/110), never over a maximum assembled from different rounds."""
    rounds = [_rates(bastion=100.0, plain=125.0, fixed_8=80.0), _rates(bastion=100.0, plain=90.0, fixed_8=110.0)]
    ratios = paired_ratios(rounds, "bastion", ["plain", "fixed:8"])
    best = ratios[0]
    assert best.against == "best" and (best.low, best.high) == (pytest.approx(0.8), pytest.approx(100 / 110))
    lines = ratio_table(ratios, "bastion").splitlines()
    assert lines[0] == "| C | bastion / best of {plain, fixed:8} | bastion / plain | bastion / fixed:8 |"
    assert lines[2] == "| 1 | 0.85 (0.80-0.91) | 0.96 (0.80-1.11) | 1.08 (0.91-1.25) |"


def test_a_round_without_the_reference_or_with_a_failed_rate_is_left_out_at_that_level():
    rounds = [{("plain", 2): 100.0}, {("bastion", 2): 90.0, ("plain", 2): 100.0}, {("bastion", 2): 90.0, ("plain", 2): 0.0}]
    (only,) = paired_ratios(rounds, "bastion", ["plain"])
    assert (only.level, only.rounds, only.median) == (2, 1, pytest.approx(0.9))


@settings(max_examples=50, deadline=None)
@given(
    base=st.lists(st.floats(50.0, 500.0), min_size=1, max_size=6),
    drift=st.lists(st.floats(0.5, 2.0), min_size=1, max_size=6),
    gain=st.floats(0.5, 2.0),
)
def test_a_drift_that_scales_every_setting_of_a_round_alike_leaves_the_paired_ratio_exact(base, drift, gain):
    """Each round's machine speed (drift) multiplies every setting's rate alike: the paired ratio is the
    true one, gain, in every round, so median, low and high all equal it."""
    rounds = [{("ref", 4): b * d * gain, ("other", 4): b * d} for b, d in zip(base, drift)]
    (r,) = paired_ratios(rounds, "ref", ["other"])
    assert r.median == pytest.approx(gain) and r.low == pytest.approx(gain) and r.high == pytest.approx(gain)


def _serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "benchmarks" / "serve_bench.py")
    sb = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(sb)
    return sb


def test_the_serving_benchmark_keeps_each_servers_fastest_round_for_its_table():
    sb = _serve_bench()

    def point(server: str, rate: float):
        return sb.Point(server, 1, 8, int(rate), 1.0, rate, None, None, None, None)

    rounds = [[point("bastion", 120.0), point("plain", 100.0)], [point("bastion", 180.0), point("plain", 90.0)]]
    assert {p.server: p.tokens_per_s for p in sb.fastest(rounds)} == {"bastion": 180.0, "plain": 100.0}


def _fake_servers(sb, monkeypatch) -> dict[str, object]:
    """``bastion serve`` processes that only print their startup line: what each was started with
    (its command and ``Popen``'s options) lands in the returned dict."""
    seen: dict[str, object] = {}

    class FakeServer:
        def __init__(self, cmd, **kwargs):
            seen.update(kwargs, cmd=cmd)
            self.stderr = iter(["bastion serve: bastion-demo (the demo pair) on http://127.0.0.1:9/v1  [max-running 64]\n"])

    monkeypatch.setattr(sb.subprocess, "Popen", FakeServer)
    monkeypatch.setattr(sb, "_wait_health", lambda url, proc, timeout: None)
    return seen


def test_a_server_named_with_a_checkout_runs_from_that_checkout_first_on_its_path(tmp_path, monkeypatch):
    """``python -m`` puts the working directory ahead of ``PYTHONPATH``: a server started from one
    checkout with ``PYTHONPATH`` naming another serves the first one's code. ``NAME@DIR`` starts it with
    DIR as its working directory and first on its path."""
    sb = _serve_bench()
    checkout = tmp_path / "prev"
    (checkout / "bastion").mkdir(parents=True)
    (checkout / "bastion" / "__init__.py").write_text("")
    seen = _fake_servers(sb, monkeypatch)
    server = sb.start_server(f"prev@{checkout}", [], {"PYTHONPATH": "/elsewhere"})
    assert server.label == "prev" and server.url == "http://127.0.0.1:9"
    assert seen["cwd"] == str(checkout)
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == [str(checkout), "/elsewhere"]
    with pytest.raises(SystemExit, match="no bastion/__init__.py"):
        sb.start_server(f"prev@{tmp_path / 'nothing'}", [], {})


def test_a_server_named_with_options_is_bastion_serve_with_those_options_after_the_shared_ones(monkeypatch):
    """``NAME~OPTIONS`` serves the same code with more options (e.g. the engine on a thread beside the
    default engine process): they follow ``--server-args``, so they win where both set one."""
    sb = _serve_bench()
    seen = _fake_servers(sb, monkeypatch)
    server = sb.start_server("thread~--engine thread --budget 8", ["--engine", "process"], {})
    assert server.label == "thread" and seen["cwd"] is None
    cmd = seen["cmd"]
    assert cmd[-6:] == ["--engine", "process", "--engine", "thread", "--budget", "8"]
    with pytest.raises(SystemExit, match="needs a name"):
        sb.start_server("~--engine thread", [], {})


def test_offline_decoding_takes_its_turn_in_every_round_so_the_server_overhead_is_paired(monkeypatch):
    """The offline decode ran once after every round, minutes from the servers' fastest rounds, on a
    machine whose speed drifts by tens of percent: its ratio to a server was unpaired. It now takes its
    turn among the servers at every concurrency of every round, the order rotating."""
    sb = _serve_bench()
    calls: list[tuple[str, int, int]] = []

    class Offline(sb.OfflineDecoder):
        def __init__(self) -> None:  # no pipeline: the turn order is what is checked
            pass

        def point(self, concurrency: int, max_tokens: int):
            calls.append(("offline", concurrency, max_tokens))
            return sb.Point("offline", concurrency, 1, 10, 1.0, 10.0, None, None, None, None)

    async def drive(server, requests, concurrency, max_tokens):
        calls.append((server.label, concurrency, max_tokens))
        return sb.Point(server.label, concurrency, 1, 20, 1.0, 20.0, None, None, None, None)

    monkeypatch.setattr(sb, "start_server", lambda spec, args, env: sb.Server(spec, "http://127.0.0.1:9", "m"))
    monkeypatch.setattr(sb, "drive", drive)
    rounds = sb.serve_points(["bastion", "plain"], [], {}, [], [1, 4], 64, 2, Offline())
    assert len(rounds) == 2
    for points in rounds:
        assert sorted((p.server, p.concurrency) for p in points) == sorted(
            (s, c) for s in ("bastion", "plain", "offline") for c in (1, 4)
        )
    measured = [c for c in calls if c[2] == 64]  # warm-ups drive 8 tokens
    firsts = [measured[k][0] for k in range(0, len(measured), 3)]
    assert len(set(firsts)) == 3  # who goes first rotates (offline included)
    rates = [{(p.server, p.concurrency): p.tokens_per_s for p in r} for r in rounds]
    at1, at4 = paired_ratios(rates, "bastion", ["offline"])
    assert (at1.level, at1.against, at1.rounds) == (1, "offline", 2) and at1.median == pytest.approx(2.0)
    assert (at4.level, at4.median) == (4, pytest.approx(2.0))
