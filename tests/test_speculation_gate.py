"""The speculation gate: speculate while it pays, plain decoding with a growing back-off between probes."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.controllers import SpeculationGate
from bastion.contract.errors import InvalidInputError


def run(gate: SpeculationGate, gains, steps: int) -> list[bool]:
    """Drive the gate for ``steps`` steps; each drafted step reports the next gain of ``gains``."""
    it = iter(gains)
    drafted = []
    for _ in range(steps):
        d = gate.should_draft()
        drafted.append(d)
        if d:
            gate.update(next(it))
    return drafted


def test_a_gate_that_always_pays_never_switches_off():
    gate = SpeculationGate()
    assert all(run(gate, iter(lambda: 3.0, None), 500))
    assert gate.plain_steps == 0


def test_a_gate_that_never_pays_drafts_only_on_probes_with_a_doubling_backoff():
    gate = SpeculationGate(min_backoff=4, max_backoff=64, growth=2.0)
    drafted = run(gate, iter(lambda: 0.5, None), 300)
    where = [i for i, d in enumerate(drafted) if d]
    # first step, then 4, 8, 16, 32, 64, 64 plain steps between probes
    assert where == [0, 5, 14, 31, 64, 129, 194, 259]
    assert gate.probes == len(where)
    assert gate.plain_steps == 300 - len(where)


@given(
    min_backoff=st.integers(1, 8),
    extra=st.integers(0, 64),
    growth=st.floats(1.0, 4.0),
    steps=st.integers(1, 2000),
)
def test_drafting_share_without_gain_is_bounded_by_the_backoff_schedule(min_backoff, extra, growth, steps):
    max_backoff = min_backoff + extra
    gate = SpeculationGate(min_backoff=min_backoff, max_backoff=max_backoff, growth=growth)
    drafted = sum(run(gate, iter(lambda: 0.0, None), steps))
    # each probe is followed by at least min_backoff plain steps, and eventually by max_backoff
    assert drafted <= 1 + steps // (min_backoff + 1)
    assert drafted <= math.ceil(steps / (max_backoff + 1)) + (max_backoff - min_backoff + 1)


def test_a_paying_probe_resumes_speculation_and_resets_the_backoff():
    gate = SpeculationGate(min_backoff=2, max_backoff=16, smoothing=1.0)
    drafted = run(gate, iter([0.5, 0.5, 2.0, 2.0, 0.5, 0.5]), 14)
    T, F = True, False
    # fails -> 2 plain; probe fails -> 4 plain; probe pays -> speculate; fails -> 2 plain (back-off reset)
    assert drafted == [T, F, F, T, F, F, F, F, T, T, T, F, F, T]


def test_smoothing_keeps_one_bad_step_from_switching_off():
    gate = SpeculationGate(smoothing=0.5)
    drafted = run(gate, iter([4.0, 4.0, 0.9, 4.0, 4.0]), 5)
    assert drafted == [True] * 5
    sharp = SpeculationGate(smoothing=1.0)
    assert run(sharp, iter([4.0, 4.0, 0.9, 4.0]), 4) == [True, True, True, False]


def test_infinite_margin_forces_plain_decoding_between_probes():
    gate = SpeculationGate(margin=math.inf, min_backoff=1, max_backoff=1)
    assert run(gate, iter(lambda: 1e9, None), 8) == [True, False] * 4


def test_reset_starts_a_sequence_speculating():
    gate = SpeculationGate()
    run(gate, iter(lambda: 0.0, None), 20)
    assert not gate.speculating
    gate.reset()
    assert gate.should_draft() and gate.speculating and gate.plain_steps == 0


def test_a_setting_that_ended_switched_off_starts_its_next_sequence_off_and_continues_its_countdown():
    gate = SpeculationGate(min_backoff=2, max_backoff=16, smoothing=1.0)
    gate.start("T=1")
    run(gate, iter(lambda: 0.5, None), 12)  # never pays: switched off, back-off grown
    backoff, left = gate.backoff, gate.wait
    assert not gate.speculating and backoff > 2 and 0 < left < backoff
    gate.start("T=1")  # the next request under the same setting: the countdown goes on where it stopped
    assert run(gate, iter(lambda: 0.5, None), left + 1) == [False] * left + [True]
    gate.start("T=0")  # another setting starts speculating
    assert gate.should_draft() and gate.speculating


def test_a_stream_of_short_requests_probes_as_one_long_sequence_would_plus_rare_first_step_looks():
    def drafted(lengths, **kw):
        gate = SpeculationGate(min_backoff=2, max_backoff=8, smoothing=1.0, **kw)
        out = []
        for n in lengths:
            gate.start("T=1")
            out += run(gate, iter(lambda: 0.5, None), n)
        return out

    # the countdown alone (no first-step looks): exactly as one long sequence
    assert drafted([5] * 20, start_probe=None) == drafted([100], start_probe=None)
    # with them, where probes never pay: a look on the first step of requests 2, 2 + 4, 2 + 4 + 8 (the
    # gap doubling while looks do not pay), each failed look retried once min_backoff (2) plain steps
    # in: at most 6 more drafted steps in 20 requests (a look also restarts the countdown, so the
    # scheduled probes after it shift)
    stream, long = drafted([5] * 20), drafted([100])
    assert 0 < sum(stream) - sum(long) <= 6
    looks = [k for k in range(20) if stream[5 * k] and not long[5 * k]]
    assert {2, 6, 14} <= set(looks) and len(looks) <= 4
    assert all(stream[5 * k + 1 : 5 * k + 4] == [False, False, True] for k in (2, 6, 14))  # the retry


def test_a_failed_first_step_look_gets_one_more_look_min_backoff_steps_in_and_then_the_countdown():
    gate = SpeculationGate(min_backoff=4, max_backoff=256, smoothing=1.0)
    for _ in range(3):  # probes fail: the back-off grows, the share of paying probes falls
        gate.start("T=0")
        run(gate, iter(lambda: 0.5, None), 80)
    backoff = gate.backoff
    assert not gate.speculating and backoff > 4
    looked = None
    for _ in range(4):  # requests start switched off; within the gap one gets a first-step look
        gate.start("T=0")
        if gate.should_draft():
            looked = gate
            break
        run(gate, iter(lambda: 0.5, None), 39)
    assert looked is not None
    gate.update(0.5)  # the first step's draft did not pay (the drafter had seen the prompt alone)
    assert gate.backoff == backoff and gate.wait == 4  # one more look soon, the back-off unchanged
    assert run(gate, iter([3.0]), 5) == [False] * 4 + [True]  # that look pays: speculation resumes
    assert gate.speculating and gate.backoff == 4
    # a second failure falls back to the carried back-off, grown as after any failed probe
    gate.start("T=0")
    gate.speculating, gate.wait, gate._first_look = False, 0, True
    assert run(gate, iter([0.5, 0.5]), 6) == [True] + [False] * 4 + [True]
    assert gate.wait > 4 and not gate.speculating


def test_a_probe_predicted_not_to_pay_whose_tree_paid_resumes_speculation():
    gate = SpeculationGate(min_backoff=2, max_backoff=64, smoothing=1.0, start_probe=None)
    gate.start("T=0")
    run(gate, iter(lambda: 0.5, None), 30)  # switched off, backed off
    assert not gate.speculating and gate.backoff > 2
    while not gate.should_draft():
        pass
    gate.update(0.5)  # predicted not to pay
    gate.observe_realized(0.8)  # and it did not: nothing changes
    assert not gate.speculating and gate.wait > 0
    while not gate.should_draft():
        pass
    gate.update(0.5)
    gate.observe_realized(1.6)  # its verified tree paid after all
    assert gate.speculating and gate.backoff == 2 and gate.should_draft()
    gate.update(3.0)
    gate.observe_realized(0.1)  # after any step but such a probe the report is ignored
    assert gate.speculating


def test_a_request_whose_drafts_pay_after_a_phase_where_they_did_not_is_looked_at_within_the_gap():
    gate = SpeculationGate(min_backoff=2, max_backoff=256, smoothing=1.0)
    for _ in range(6):  # a phase where drafting never pays: probes fail, the back-off grows, the share falls
        gate.start("T=0")
        run(gate, iter(lambda: 0.5, None), 60)
    assert not gate.speculating
    waited = 0  # plain steps the new phase decodes before its first draft
    for _ in range(20):  # the workload changes (short requests whose every step would pay)
        gate.start("T=0")
        steps = run(gate, iter(lambda: 3.0, None), 10)
        if any(steps):
            waited += steps.index(True)
            break
        waited += 10
    # within the look gap (2 requests here); the carried countdown alone waited 158 plain steps
    assert waited <= 20
    assert gate.speculating
    gate.start("T=0")  # a request after one that ended speculating starts speculating
    assert gate.should_draft()


def test_a_request_that_starts_switched_off_probes_first_where_its_settings_probes_often_paid():
    gate = SpeculationGate(min_backoff=2, max_backoff=16, smoothing=1.0)
    gate.start("T=0")
    run(gate, itertools.cycle([3.0, 0.5]), 19)  # every probe pays, every step after one does not
    assert not gate.speculating and gate.wait > 0
    gate.start("T=0")  # the next request: a new text, looked at on its first step
    assert gate.should_draft() and gate.plain_steps == 0
    gate.update(3.0)  # it pays: speculation resumes, the back-off returns to its minimum
    assert gate.speculating and gate.backoff == 2
    # the same history with start probes off: the countdown goes on where it stopped
    off = SpeculationGate(min_backoff=2, max_backoff=16, smoothing=1.0, start_probe=None)
    off.start("T=0")
    run(off, itertools.cycle([3.0, 0.5]), 19)
    left = off.wait
    off.start("T=0")
    assert run(off, iter(lambda: 0.5, None), left + 1) == [False] * left + [True]


def test_a_setting_whose_probes_stopped_paying_keeps_its_countdown_across_requests():
    gate = SpeculationGate(min_backoff=2, max_backoff=16, smoothing=1.0)
    gate.start("T=1")
    run(gate, iter([3.0] + [0.5] * 100), 60)  # the first probe paid, every later one failed
    left = gate.wait
    assert not gate.speculating and left > 0
    gate.start("T=1")  # too few probes pay now: no first look, the countdown decides
    assert run(gate, iter(lambda: 0.5, None), left + 1) == [False] * left + [True]


def test_a_setting_that_ended_speculating_starts_its_next_sequence_speculating():
    gate = SpeculationGate()
    gate.start("T=0")
    run(gate, iter(lambda: 3.0, None), 10)
    gate.start("T=0")
    assert gate.should_draft() and gate.speculating and gate.plain_steps == 0


@pytest.mark.parametrize(
    "kwargs",
    [dict(margin=-1.0), dict(margin=math.nan), dict(smoothing=0.0), dict(smoothing=1.5), dict(min_backoff=0),
     dict(min_backoff=8, max_backoff=4), dict(growth=0.5), dict(max_backoff=2.5), dict(probe_share=0.0),
     dict(probe_share=1.5), dict(probe_share=math.nan), dict(max_backoff=64, ceiling=32), dict(start_probe=-0.1),
     dict(start_probe=1.5), dict(start_probe=math.nan)],
)
def test_bad_gate_parameters_raise_invalid_input(kwargs):
    with pytest.raises(InvalidInputError):
        SpeculationGate(**kwargs)


def run_with_probe_cost(gate: SpeculationGate, excess: float, steps: int) -> list[bool]:
    """Drive a gate whose every drafted step has no gain and, after it, reports ``excess`` plain steps."""
    drafted = []
    for _ in range(steps):
        d = gate.should_draft()
        drafted.append(d)
        if d:
            gate.update(0.0)
            gate.observe_probe_cost(excess)
    return drafted


def test_expensive_failed_probes_raise_the_cap_so_they_cost_at_most_the_probe_share():
    gate = SpeculationGate(min_backoff=4, max_backoff=64, growth=2.0, probe_share=0.01)
    drafted = run_with_probe_cost(gate, 3.0, 3000)
    assert gate.probe_excess == pytest.approx(3.0)
    assert gate.cap == 300  # ceil(3.0 / 0.01), above max_backoff
    where = [i for i, d in enumerate(drafted) if d]
    gaps = [b - a - 1 for a, b in zip(where, where[1:])]
    # the back-off doubles (4, 8, 16, ...); once two failed probes were costed (3 plain steps each),
    # each wait is the back-off times 3, up to the cap (a cold start's first probes never lengthen it)
    assert gaps[:6] == [4, 8, 16, 96, 192, 300]
    assert max(gaps) == 300 and gaps[-1] == 300
    # in the long run, the probes' excess stays within the share of the plain steps
    tail = where[-4:]
    assert 3.0 * (len(tail) - 1) <= 0.01 * (tail[-1] - tail[0])


def test_cheap_failed_probes_keep_the_cap_at_max_backoff_and_the_ceiling_bounds_it():
    cheap = SpeculationGate(max_backoff=64, probe_share=0.05)
    run_with_probe_cost(cheap, 1.0, 500)
    assert cheap.cap == 64  # 1.0 / 0.05 = 20 is under max_backoff
    costly = SpeculationGate(max_backoff=64, probe_share=0.001, ceiling=1000)
    run_with_probe_cost(costly, 50.0, 500)
    assert costly.cap == 1000
    fixed = SpeculationGate(max_backoff=64, probe_share=None)
    run_with_probe_cost(fixed, 50.0, 500)
    assert fixed.cap == 64 and fixed.probe_excess == 50.0  # measured, not used


def test_probe_costs_count_only_after_a_probe_that_did_not_pay():
    gate = SpeculationGate(min_backoff=2, max_backoff=16, smoothing=1.0, probe_share=0.01)
    gate.observe_probe_cost(9.0)  # nothing was decided yet
    assert gate.probe_excess is None
    assert gate.should_draft()
    gate.update(3.0)  # the first step pays: speculation goes on
    gate.observe_probe_cost(9.0)
    assert gate.probe_excess is None
    assert gate.should_draft()
    gate.update(0.2)  # speculation stops paying: not a probe
    gate.observe_probe_cost(9.0)
    assert gate.probe_excess is None
    while not gate.should_draft():
        pass
    gate.update(0.2)  # a probe that did not pay: its cost counts, once
    gate.observe_probe_cost(4.0)
    gate.observe_probe_cost(100.0)
    assert gate.probe_excess == 4.0


def test_the_probe_excess_and_so_the_cap_are_kept_per_sampling_setting():
    gate = SpeculationGate(min_backoff=2, max_backoff=16, probe_share=0.01)
    gate.start("T=1")
    run_with_probe_cost(gate, 3.0, 200)
    assert gate.probe_excess == pytest.approx(3.0) and gate.cap == 300
    gate.start("T=0")  # another setting has measured nothing yet: the plain cap
    assert gate.probe_excess is None and gate.cap == 16
    run_with_probe_cost(gate, 0.5, 200)
    assert gate.probe_excess == pytest.approx(0.5) and gate.cap == 50
    gate.start("T=1")
    assert gate.probe_excess == pytest.approx(3.0) and gate.cap == 300
