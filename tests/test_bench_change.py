"""The bench's conditions-change harness: competing loads it starts and stops itself (``--contention``)
and phased scenarios whose prompt domain changes mid-run (``--scenario``), with each phase's oracle."""

from __future__ import annotations

import os
import time

import pytest

from bastion.bench.contention import Contention, ContentionSpec, parse_contention, round_phase
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


def test_round_phases_spread_over_the_period_and_a_bad_index_is_refused():
    phases = [round_phase(k, 2.5) for k in range(8)]
    assert phases[0] == 0.0 and all(0.0 <= p < 2.5 for p in phases)
    gaps = sorted(phases) + [2.5]
    assert max(b - a for a, b in zip(gaps, gaps[1:])) < 2.5 / 8 * 2.2  # no part of the period left unsampled
    assert round_phase(3, 2.5) == round_phase(3, 2.5)  # every method of a round gets the same phase
    with pytest.raises(InvalidInputError, match="round index"):
        round_phase(-1, 2.5)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads CPU time from /proc")
def test_aligning_a_load_puts_every_run_of_a_round_at_the_same_phase_of_its_bursts():
    # a load 0.8 s on, 0.8 s off; round 0 starts at phase 0 (a burst begins), round 1 at 0.618 * 1.6 s
    # ~ 0.99 s (in the pause): the same round aligned twice burns the same CPU over the next 0.5 s
    load = Contention(parse_contention("busy:1@0.8/0.8"))
    assert load.sync
    with load:
        pid = load._procs[0].pid
        deadline = time.monotonic() + 10.0
        while _cpu_seconds(pid) < 0.05 and time.monotonic() < deadline:  # the worker is up and working
            time.sleep(0.05)

        def burned(round_index: int) -> float:
            load.align(round_index)
            before = _cpu_seconds(pid)
            time.sleep(0.5)
            return _cpu_seconds(pid) - before

        on_a, off_a, on_b, off_b = burned(0), burned(1), burned(0), burned(1)
    # inside a burst for the whole half second (a share of a core on a busy machine), then in the pause
    assert min(on_a, on_b) > max(0.1, 3 * max(off_a, off_b))
    assert not load.running  # closing its input ended it


def test_a_load_that_runs_free_ignores_alignment():
    load = Contention(parse_contention("busy:1@0.4/0.4"), sync=False)
    with load:
        load.align(1)  # nothing is written: no error, the load keeps its own clock
        assert load.running


def test_greedy_output_equals_the_models_own_greedy_decoding_beside_the_contention_harness():
    import torch

    import bastion
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.reference import greedy_reference
    from bastion.testing.tiny import tiny_model

    model = tiny_model("qwen3", seed=0)
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=1.0, seed=0))
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 256, (1, n), generator=gen) for n in (5, 17, 9)]
    with Contention(parse_contention("torch:1@0.2/0.1")) as load:  # bursts while the timings decide trees
        for k, prompt in enumerate(prompts):
            load.align(k)
            res = pipe.generate(prompt, max_new_tokens=24, temperature=0.0, stop_on_eos=False)
            assert res.tokens == greedy_reference(model, prompt, 24)
        assert load.running
