"""The serving benchmark's statistics: each server's fastest round, and ratios paired within a round."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "benchmarks" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _point(sb, server: str, c: int, rate: float):
    return sb.Point(server, c, 8, int(rate), 1.0, rate, None, None, None, None)


def test_paired_ratios_cancel_a_drift_between_rounds_that_the_fastest_rounds_do_not():
    """Round 2 ran on a machine 1.5x faster: bastion's fastest round (round 2) over plain's fastest
    (round 2 too) is the within-round ratio, but a ratio across rounds would not be; the paired median
    is what every round said, 1.2, with 0.9 against fixed:8's best round."""
    sb = _bench()
    rounds = [
        [_point(sb, "bastion", 1, 120.0), _point(sb, "plain", 1, 100.0), _point(sb, "fixed:8", 1, 125.0)],
        [_point(sb, "bastion", 1, 180.0), _point(sb, "plain", 1, 150.0), _point(sb, "fixed:8", 1, 200.0)],
        [_point(sb, "bastion", 1, 132.0), _point(sb, "plain", 1, 110.0), _point(sb, "fixed:8", 1, 150.0)],
    ]
    best = {p.server: p.tokens_per_s for p in sb.fastest(rounds)}
    assert best == {"bastion": 180.0, "plain": 150.0, "fixed:8": 200.0}
    ratios = {r.against: r for r in sb.paired_ratios(rounds, "bastion", ["plain", "fixed:8"])}
    assert ratios["plain"].median == pytest.approx(1.2) and ratios["plain"].low == pytest.approx(1.2)
    assert ratios["fixed:8"].median == pytest.approx(0.9)  # 0.96, 0.9, 0.88
    assert (ratios["fixed:8"].low, ratios["fixed:8"].high) == (pytest.approx(0.88), pytest.approx(0.96))
    assert ratios["best"].median == pytest.approx(0.9) and ratios["best"].rounds == 3


def test_the_best_of_the_others_is_taken_within_each_round():
    """Plain is fastest in round 1 and fixed:8 in round 2: 'best' is bastion over whichever was faster
    in the same round, never over a maximum assembled from different rounds."""
    sb = _bench()
    rounds = [
        [_point(sb, "bastion", 4, 100.0), _point(sb, "plain", 4, 125.0), _point(sb, "fixed:8", 4, 80.0)],
        [_point(sb, "bastion", 4, 100.0), _point(sb, "plain", 4, 90.0), _point(sb, "fixed:8", 4, 110.0)],
    ]
    ratios = {r.against: r for r in sb.paired_ratios(rounds, "bastion", ["plain", "fixed:8"])}
    assert (ratios["best"].low, ratios["best"].high) == (pytest.approx(0.8), pytest.approx(100 / 110))
    table = sb.ratio_table(sb.paired_ratios(rounds, "bastion", ["plain", "fixed:8"]), "bastion")
    assert table.splitlines()[0] == "| C | bastion / best of {plain, fixed:8} | bastion / plain | bastion / fixed:8 |"
    assert table.splitlines()[2].startswith("| 4 | 0.85 (0.80-0.91) | 0.96 (0.80-1.11) |")


def test_a_round_without_the_reference_at_a_concurrency_is_skipped_there():
    sb = _bench()
    rounds = [[_point(sb, "plain", 2, 100.0)], [_point(sb, "bastion", 2, 90.0), _point(sb, "plain", 2, 100.0)]]
    (only,) = [r for r in sb.paired_ratios(rounds, "bastion", ["plain"])]
    assert only.rounds == 1 and only.median == pytest.approx(0.9)
