"""Benchmark metrics and the comparison summary, on hand-made generation results with known answers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bastion.bench.metrics import (
    ALL_DATASETS,
    STAGES,
    PromptRun,
    aggregate,
    latency_points,
    pearson,
    stage_seconds,
    summarize,
    sweep_budget,
)
from bastion.contract.types import GenerationResult, StageTimings, StepRecord


def _result(accepted: list[int], budget: int | list[int], wall: float, tokens: list[int] | None = None,
            predicted: list[float] | None = None, prefill: float = 0.1) -> GenerationResult:
    budgets = budget if isinstance(budget, list) else [budget] * len(accepted)
    steps = [
        StepRecord(
            budget=b, accepted=a, emitted=a + 1, context_len=10 + i, predicted_accept=(predicted[i] if predicted else 1.0 + a),
            predicted_speedup=None, timings=StageTimings(draft=0.01, tree=0.002, controller=0.001, verify=0.03, accept=0.001, commit=0.002, other=0.001),
        )
        for i, (a, b) in enumerate(zip(accepted, budgets))
    ]
    n = sum(a + 1 for a in accepted)
    return GenerationResult(tokens=tokens if tokens is not None else list(range(n)), steps=steps, prompt_len=10,
                            prefill_s=prefill, wall_s=wall, stop_reason="length")


def _runs() -> list[PromptRun]:
    out = []
    for ds in ("gsm8k", "mt_bench"):
        for pid in ("0", "1"):
            out.append(PromptRun("ar", ds, pid, _result([0] * 12, 1, wall=1.2)))  # 12 tokens in 1.2 s: 10 tok/s
            out.append(PromptRun("chain", ds, pid, _result([2, 2, 2, 2], 16, wall=0.6)))  # 12 tokens: 20 tok/s
            out.append(PromptRun("best-first@8", ds, pid, _result([3, 3, 3], 8, wall=0.4)))  # 30 tok/s
            out.append(PromptRun("best-first@32", ds, pid, _result([5, 5], 32, wall=0.5)))  # 24 tok/s
            # bastion differs from ar on prompt "1" of mt_bench only
            toks = list(range(12)) if not (ds == "mt_bench" and pid == "1") else [0] * 12
            out.append(PromptRun("bastion", ds, pid, _result([3, 3, 3], [4, 8, 12], wall=0.41, tokens=toks)))
    return out


def test_acceptance_length_throughput_and_speedup_are_same_run_ratios() -> None:
    stats = {(s.method, s.dataset): s for s in aggregate(_runs())}
    ar, chain, bf8 = stats[("ar", "gsm8k")], stats[("chain", "gsm8k")], stats[("best-first@8", "gsm8k")]
    assert ar.acceptance_length == 1.0 and ar.speedup == pytest.approx(1.0)
    assert ar.tokens_per_s == pytest.approx(24 / 2.4)
    assert chain.acceptance_length == pytest.approx(3.0) and chain.speedup == pytest.approx(2.0)
    assert bf8.acceptance_length == pytest.approx(12 / 3) and bf8.speedup == pytest.approx(3.0)
    assert bf8.mean_budget == 8 and bf8.budget_hist == {8: 6}
    ours = stats[("bastion", "gsm8k")]
    assert ours.budget_hist == {4: 2, 8: 2, 12: 2} and ours.mean_budget == pytest.approx(8.0)
    assert stats[("chain", ALL_DATASETS)].prompts == 4 and stats[("chain", ALL_DATASETS)].new_tokens == 48


def test_equality_check_counts_prompts_whose_tokens_match_the_reference() -> None:
    stats = {(s.method, s.dataset): s for s in aggregate(_runs())}
    assert stats[("ar", "gsm8k")].equal_to_ref is None  # the reference is not compared with itself
    assert stats[("bastion", "gsm8k")].equal_to_ref == 2
    assert stats[("bastion", "mt_bench")].equal_to_ref == 1 and stats[("bastion", "mt_bench")].equal_rate == 0.5
    assert stats[("bastion", ALL_DATASETS)].equal_to_ref == 3
    sampled = {(s.method, s.dataset): s for s in aggregate(_runs(), check_equal=False)}
    assert sampled[("bastion", "gsm8k")].equal_to_ref is None


def test_stage_split_adds_up_to_wall_time_with_unrecorded_time_in_other() -> None:
    res = _result([1, 1], 4, wall=1.0, prefill=0.2)
    split = stage_seconds(res)
    assert tuple(split) == STAGES
    assert sum(split.values()) == pytest.approx(1.0)
    assert split["verify"] == pytest.approx(0.06) and split["prefill"] == pytest.approx(0.2)
    # other = wall minus prefill minus the six timed stages (0.046 s per step besides "other")
    assert split["other"] == pytest.approx(1.0 - 0.2 - 2 * 0.046)
    stats = aggregate(_runs())
    for s in stats:
        assert sum(s.stage_frac.values()) == pytest.approx(1.0)


def test_predicted_acceptance_correlation_is_pearson_over_steps() -> None:
    realized = [1, 3, 2, 5, 1]
    predicted = [1.5, 2.5, 2.0, 4.0, 1.2]
    run = PromptRun("bastion", "gsm8k", "0", _result([r - 1 for r in realized], 8, wall=1.0, predicted=predicted))
    (s,) = aggregate([run], reference="ar")
    mx, my = sum(predicted) / 5, sum(realized) / 5
    num = sum((x - mx) * (y - my) for x, y in zip(predicted, realized))
    den = math.sqrt(sum((x - mx) ** 2 for x in predicted) * sum((y - my) ** 2 for y in realized))
    assert s.accept_corr == pytest.approx(num / den)
    assert s.speedup is None  # no ar in the run: no speedup can be claimed
    assert pearson([1.0, 1.0], [2.0, 3.0]) is None and pearson([1.0], [2.0]) is None


@given(st.lists(st.tuples(st.floats(-100, 100), st.floats(-100, 100)), min_size=2, max_size=30))
def test_pearson_is_bounded_and_symmetric(pairs: list[tuple[float, float]]) -> None:
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    r = pearson(xs, ys)
    if r is not None:
        assert -1.0 - 1e-9 <= r <= 1.0 + 1e-9
        assert r == pytest.approx(pearson(ys, xs))


def test_summary_picks_the_best_fixed_budget_and_judges_bastion_against_it() -> None:
    summary = {d.dataset: d for d in summarize(aggregate(_runs()))}
    gsm = summary["gsm8k"]
    assert gsm.best_fixed_budget == 8 and gsm.best_fixed_speedup == pytest.approx(3.0)
    assert gsm.chain_speedup == pytest.approx(2.0) and gsm.static_speedup is None
    assert gsm.bastion_speedup == pytest.approx(12 / 0.41 / 10)
    assert gsm.speedup_vs_best == pytest.approx(0.4 / 0.41)
    assert gsm.matched_best is True  # 2.4% slower: inside the 3% tolerance
    assert gsm.beat_chain is True and gsm.accept_vs_chain == pytest.approx(4.0 / 3.0)
    assert summary[ALL_DATASETS].best_fixed_budget == 8


def test_summary_reports_a_miss_when_bastion_trails_the_best_budget_by_more_than_tolerance() -> None:
    runs = [r for r in _runs() if r.method != "bastion"]
    runs += [PromptRun("bastion", "gsm8k", pid, _result([2, 2, 2, 2], 10, wall=0.7)) for pid in ("0", "1")]
    gsm = {d.dataset: d for d in summarize(aggregate(runs))}["gsm8k"]
    assert gsm.matched_best is False and gsm.beat_chain is False
    assert gsm.speedup_vs_chain == pytest.approx(0.6 / 0.7)


def test_sweep_names_and_latency_points() -> None:
    assert sweep_budget("best-first@16") == 16 and sweep_budget("bastion") is None and sweep_budget("chain@4") is None
    pts = latency_points(_runs())
    assert len(pts) == 2 * 2 * (4 + 3 + 2 + 3)  # every non-ar step
    assert all(s == pytest.approx(0.03) for _, _, s in pts)
    assert {n for n, _, _ in pts} == {16, 8, 32, 4, 12}


def test_cost_gap_splits_the_per_token_time_difference_by_stage() -> None:
    from bastion.bench.metrics import cost_gap
    from bastion.bench.reporting import targets_table

    runs = [r for r in _runs() if r.method != "bastion"]
    runs += [PromptRun("bastion", "gsm8k", pid, _result([2, 2, 2, 2], 10, wall=0.7)) for pid in ("0", "1")]
    by = {(s.method, s.dataset): s for s in aggregate(runs)}
    ours, chain = by[("bastion", "gsm8k")], by[("chain", "gsm8k")]
    gap = cost_gap(ours, chain)
    assert [k for k, _ in gap][0] == "other"  # same steps and stage times; only the unrecorded time differs
    assert gap[0][1] == pytest.approx(2 * 0.1 / 24)
    assert sum(d for _, d in gap) == pytest.approx(ours.wall_s / ours.new_tokens - chain.wall_s / chain.new_tokens)
    table = targets_table(aggregate(runs), summarize(aggregate(runs)))
    assert "| gsm8k | 1.00 below | 0.86 below | 0.57 below | other +8.33 |" in table
    assert "(paper: >= 1.30)" in table


def test_the_latency_plot_range_keeps_the_bulk_and_leaves_a_burst_outlier_off_the_axis():
    from bastion.bench.plots import latency_axis_range

    bulk = [1.0 + 0.1 * i for i in range(20)]
    lo, hi, clipped = latency_axis_range([*bulk, 300.0])
    assert lo <= min(bulk) and hi >= max(bulk) and hi < 300.0 and clipped == 1
    assert latency_axis_range(bulk)[2] == 0


def test_the_report_header_names_the_drafter_dtype_when_it_differs_from_the_targets() -> None:
    import torch

    from bastion.bench.reporting import _dtypes
    from bastion.bench.runner import drafter_dtype

    class _Model:
        dtype = torch.bfloat16

    class _Drafter:
        model = _Model()

    assert drafter_dtype(_Drafter()) == "bfloat16"
    assert drafter_dtype({"dflash": _Drafter(), "other": object()}) == "dflash: bfloat16"
    assert drafter_dtype(object()) is None
    assert _dtypes({"dtype": "float32", "drafter_dtype": "bfloat16"}) == "float32, drafter bfloat16"
    assert _dtypes({"dtype": "float32", "drafter_dtype": "float32"}) == "float32"
    assert _dtypes({"dtype": "float32"}) == "float32"
