"""The bench's conditions-change harness: competing loads it starts and stops itself (``--contention``)
and phased scenarios whose prompt domain changes mid-run (``--scenario``), with each phase's oracle."""

from __future__ import annotations

import os
import time

import pytest

from bastion.bench.contention import Contention, ContentionSpec, parse_contention
from bastion.bench.metrics import MethodStats
from bastion.bench.scenario import parse_scenario, phase_table, scenario_prompts, scenario_rows
from bastion.contract.errors import InvalidInputError


def test_contention_specs_parse_and_bad_ones_are_refused_naming_the_format():
    assert parse_contention("none") is None and parse_contention("") is None
    assert parse_contention("busy:1") == ContentionSpec("busy", 1)
    assert parse_contention("torch:2@1.5/1") == ContentionSpec("torch", 2, 1.5, 1.0)
    assert str(parse_contention("torch:2@1.5/1")) == "torch:2@1.5/1"
    for bad in ("gpu:1", "busy", "busy:0", "busy:1@0/1", "torch:2@x/1"):
        with pytest.raises(InvalidInputError, match="KIND:WORKERS|WORKERS|ON"):
            parse_contention(bad)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from /proc")
def test_a_contention_load_runs_while_on_rests_while_off_and_stops_with_the_harness():
    load = Contention(parse_contention("busy:1@0.6/0.6"))
    with load:
        pid = load._procs[0].pid
        time.sleep(2.4)  # two periods: about half of it busy
        used = _cpu_seconds(pid)
        assert load.running
    assert not load.running
    assert 0.05 < used < 1.8  # it ran (on) and rested (off), not all the time (1.2 s on in 2.4 s)


def _stats(method: str, dataset: str, tps: float, tokens: int = 100) -> MethodStats:
    return MethodStats(
        method=method, dataset=dataset, prompts=1, new_tokens=tokens, steps=10, wall_s=tokens / tps, acceptance_length=2.0,
        tokens_per_s=tps, speedup=tps / 10.0, mean_budget=4.0, budget_hist={}, stage_s={}, equal_to_ref=None,
        predicted_accept=None, accept_corr=None,
    )


def test_each_phase_has_the_best_fixed_method_as_oracle_and_the_whole_run_ratio_weighs_the_phases_by_time():
    stats = [
        _stats("ar", "1:coding", 10), _stats("chain", "1:coding", 30), _stats("best-first@16", "1:coding", 20), _stats("bastion", "1:coding", 27),
        _stats("ar", "2:translation", 10), _stats("chain", "2:translation", 12), _stats("best-first@16", "2:translation", 18),
        _stats("bastion", "2:translation", 18), _stats("bastion", "all", 22),
    ]
    rows, whole = scenario_rows(stats)
    assert [(r.phase, r.oracle) for r in rows] == [("1:coding", "chain"), ("2:translation", "best-first@16")]
    assert rows[0].adaptive_share == pytest.approx(0.9) and rows[1].adaptive_share == pytest.approx(1.0)
    # oracle seconds for bastion's tokens (100/30 + 100/18) over bastion's seconds (100/27 + 100/18)
    assert whole == pytest.approx((100 / 30 + 100 / 18) / (100 / 27 + 100 / 18))
    table = phase_table(stats)
    assert "| 1:coding |" in table and "Whole run: bastion / per-phase oracle" in table


def test_scenario_prompts_come_phase_by_phase_from_spec_bench_categories():
    assert parse_scenario("code, chat ,math,translation") == ("coding", "writing", "math_reasoning", "translation")
    prompts = scenario_prompts(parse_scenario("code,translation"), limit=2)
    assert [p.dataset for p in prompts] == ["1:coding", "1:coding", "2:translation", "2:translation"]
    assert all(p.category == p.dataset.split(":", 1)[1] for p in prompts)
    with pytest.raises(InvalidInputError, match="not a Spec-Bench category"):
        scenario_prompts(("poetry",), limit=1)
