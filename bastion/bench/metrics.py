"""Benchmark metrics: per method x dataset aggregates and the per-dataset comparison summary.

Everything here is computed from the recorded :class:`~bastion.contract.types.GenerationResult` of each
(method, prompt) pair of one run, so every ratio (speedup, acceptance ratio) compares methods measured
side by side on the same prompts.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Iterable, Sequence

import attrs
from attrs import field, frozen

from bastion.contract.types import GenerationResult

__all__ = [
    "STAGES",
    "PromptRun",
    "MethodStats",
    "DatasetSummary",
    "Roles",
    "ALL_DATASETS",
    "sweep_budget",
    "method_roles",
    "stage_seconds",
    "pearson",
    "aggregate",
    "summarize",
    "latency_points",
    "MATCH_TOLERANCE",
    "TARGET_ACCEPT_VS_CHAIN",
    "TARGET_SPEEDUP_VS_CHAIN",
    "cost_per_token",
    "cost_gap",
]

#: per-stage time split reported for every method (``prefill`` is the prompt pass, ``other`` includes
#: the loop's bookkeeping outside the recorded stages)
STAGES: tuple[str, ...] = ("prefill", "draft", "tree", "controller", "verify", "accept", "commit", "other")

#: label of the pooled rows that aggregate every dataset
ALL_DATASETS = "all"

#: bastion "matches" the best fixed budget when its speedup is at least this fraction below it
MATCH_TOLERANCE = 0.03

#: the paper's targets, scaled to CPU: bastion vs the chain on every dataset
TARGET_ACCEPT_VS_CHAIN = 1.3
TARGET_SPEEDUP_VS_CHAIN = 1.2

_SWEEP = re.compile(r"^best-first@(\d+)$")
_FIXED = re.compile(r"^(.+)@(\d+)$")
#: budget controllers that do not choose a budget (every node, or one fixed size)
_NON_ADAPTIVE = ("full", "fixed")


def sweep_budget(method: str) -> int | None:
    """The fixed budget N of a ``best-first@N`` sweep method, else None."""
    m = _SWEEP.match(method)
    return int(m.group(1)) if m else None


@frozen
class Roles:
    """Which of a run's methods play the parts the summary compares: the adaptive controller, the chain
    and static baselines, and the fixed-budget sweep of the adaptive method's tree builder."""

    adaptive: str | None
    chain: str | None
    static: str | None
    sweep: tuple[tuple[int, str], ...]  # (N, method), N ascending


def _builder(name: str, adaptive: str) -> str:
    return "best-first" if name == adaptive else name.partition("@")[0]


def method_roles(methods: Sequence[str], adaptive: str = "bastion") -> Roles:
    """The :class:`Roles` of ``methods`` (names as ``--methods`` takes them): the named ``adaptive``
    method, else the first ``BUILDER@CONTROLLER`` with a budget-choosing controller; ``chain`` and
    ``static``, else the first other method of that tree builder (``chain@fixed``, ``static@8``); and the
    ``BUILDER@N`` methods of the adaptive method's builder (``best-first`` without an adaptive method)."""
    names = list(dict.fromkeys(methods))

    def is_adaptive(m: str) -> bool:
        _, sep, ctrl = m.partition("@")
        return bool(sep) and not ctrl.isdigit() and ctrl not in _NON_ADAPTIVE

    ours = adaptive if adaptive in names else next((m for m in names if is_adaptive(m)), None)

    def baseline(builder: str) -> str | None:
        if builder in names and builder != ours:
            return builder
        return next((m for m in names if m != ours and _builder(m, adaptive) == builder), None)

    base = _builder(ours, adaptive) if ours is not None else "best-first"
    sweep = sorted((int(f.group(2)), m) for m in names if (f := _FIXED.match(m)) and f.group(1) == base)
    return Roles(adaptive=ours, chain=baseline("chain"), static=baseline("static"), sweep=tuple(sweep))


@frozen
class PromptRun:
    """One method's generation for one prompt."""

    method: str
    dataset: str
    prompt_id: str
    result: GenerationResult = field(eq=False)

    @property
    def tokens(self) -> list[int]:
        return self.result.tokens


def stage_seconds(result: GenerationResult) -> dict[str, float]:
    """Wall seconds of ``result`` split by :data:`STAGES`; the parts add up to ``result.wall_s``."""
    out = dict.fromkeys(STAGES, 0.0)
    out["prefill"] = result.prefill_s
    for step in result.steps:
        t = step.timings
        out["draft"] += t.draft
        out["tree"] += t.tree
        out["controller"] += t.controller
        out["verify"] += t.verify
        out["accept"] += t.accept
        out["commit"] += t.commit
        out["other"] += t.other
    recorded = sum(out.values())
    out["other"] += max(0.0, result.wall_s - recorded)  # loop bookkeeping between the timed stages
    return out


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson correlation of two equal-length samples; None when undefined (n < 2 or a constant)."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson needs equal lengths, got {len(xs)} and {len(ys)}")
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx <= 1e-18 or syy <= 1e-18:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    return sxy / math.sqrt(sxx * syy)


@frozen
class MethodStats:
    """Aggregates of one method on one dataset (or on all datasets pooled: ``dataset == "all"``)."""

    method: str
    dataset: str
    prompts: int
    new_tokens: int
    steps: int
    wall_s: float
    acceptance_length: float  # mean tokens committed per step, bonus included
    tokens_per_s: float
    speedup: float | None  # tokens/s over the reference (ar) tokens/s, same prompts, same run
    mean_budget: float  # mean nodes verified per step, root included
    budget_hist: dict[int, int]  # budget -> steps
    stage_s: dict[str, float]  # seconds per stage (see STAGES), summed over prompts
    equal_to_ref: int | None  # prompts whose tokens equal the reference's (None: no check / reference itself)
    predicted_accept: float | None  # mean A_hat of the verified trees
    accept_corr: float | None  # Pearson(predicted A_hat, realized tokens per step) over steps
    drafted_share: float = 0.0  # share of steps that drafted (the rest were plain target steps)
    #: over the steps with a calibrated prediction: mean raw A_hat, mean calibrated A_cal, mean realized
    #: tokens per step (None when the method does not calibrate)
    reliability: tuple[float, float, float] | None = None

    @property
    def stage_frac(self) -> dict[str, float]:
        total = sum(self.stage_s.values())
        return {k: (v / total if total > 0 else 0.0) for k, v in self.stage_s.items()}

    @property
    def equal_rate(self) -> float | None:
        return None if self.equal_to_ref is None else self.equal_to_ref / self.prompts

    def as_dict(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        d["budget_hist"] = {str(k): v for k, v in sorted(self.budget_hist.items())}
        d["stage_frac"] = self.stage_frac
        d["equal_rate"] = self.equal_rate
        return d


def _stats(method: str, dataset: str, runs: Sequence[PromptRun], ref: dict[tuple[str, str], PromptRun] | None,
           ref_tps: float | None, check_equal: bool) -> MethodStats:
    steps = [s for r in runs for s in r.result.steps]
    new_tokens = sum(len(r.result.tokens) for r in runs)
    wall = sum(r.result.wall_s for r in runs)
    tps = new_tokens / wall if wall > 0 else 0.0
    stage = dict.fromkeys(STAGES, 0.0)
    for r in runs:
        for k, v in stage_seconds(r.result).items():
            stage[k] += v
    equal: int | None = None
    if check_equal and ref is not None:
        equal = sum(1 for r in runs if (r.dataset, r.prompt_id) in ref and ref[(r.dataset, r.prompt_id)].tokens == r.tokens)
    predicted = [s.predicted_accept for s in steps]
    realized = [float(s.accepted + 1) for s in steps]
    calibrated = [s for s in steps if s.calibrated_accept is not None]
    reliability = None
    if calibrated:
        k = len(calibrated)
        reliability = (
            sum(s.predicted_accept for s in calibrated) / k,
            sum(s.calibrated_accept for s in calibrated) / k,  # type: ignore[misc]
            sum(s.accepted + 1 for s in calibrated) / k,
        )
    return MethodStats(
        method=method,
        dataset=dataset,
        prompts=len(runs),
        new_tokens=new_tokens,
        steps=len(steps),
        wall_s=wall,
        acceptance_length=(sum(realized) / len(steps)) if steps else 0.0,
        tokens_per_s=tps,
        speedup=(tps / ref_tps) if ref_tps else None,
        mean_budget=(sum(s.budget for s in steps) / len(steps)) if steps else 0.0,
        budget_hist=dict(sorted(Counter(s.budget for s in steps).items())),
        stage_s=stage,
        equal_to_ref=equal,
        predicted_accept=(sum(predicted) / len(predicted)) if predicted else None,
        accept_corr=pearson(predicted, realized),
        drafted_share=(sum(1 for s in steps if s.drafted) / len(steps)) if steps else 0.0,
        reliability=reliability,
    )


def aggregate(runs: Iterable[PromptRun], reference: str = "ar", check_equal: bool = True) -> list[MethodStats]:
    """Per (method, dataset) statistics plus pooled ``"all"`` rows, in first-seen method order.

    ``reference`` names the baseline method (speedups and the output-equality check are relative to
    it); ``check_equal`` should be False for sampled (T > 0) runs.
    """
    runs = list(runs)
    methods = list(dict.fromkeys(r.method for r in runs))
    datasets = list(dict.fromkeys(r.dataset for r in runs))
    ref = {(r.dataset, r.prompt_id): r for r in runs if r.method == reference} if reference in methods else None
    out: list[MethodStats] = []
    groups = [*datasets, ALL_DATASETS] if len(datasets) > 1 else datasets
    for ds in groups:
        in_ds = [r for r in runs if ds == ALL_DATASETS or r.dataset == ds]
        ref_tps = None
        if ref is not None:
            ref_runs = [r for r in in_ds if r.method == reference]
            wall = sum(r.result.wall_s for r in ref_runs)
            ref_tps = sum(len(r.tokens) for r in ref_runs) / wall if wall > 0 else None
        for m in methods:
            mine = [r for r in in_ds if r.method == m]
            if mine:
                out.append(_stats(m, ds, mine, ref, ref_tps, check_equal and m != reference))
    return out


@frozen
class DatasetSummary:
    """The paper's comparison on one dataset: baselines, the best fixed budget of the sweep and bastion."""

    dataset: str
    chain_speedup: float | None
    chain_accept: float | None
    static_speedup: float | None
    static_accept: float | None
    best_fixed_budget: int | None  # the sweep's N with the highest speedup
    best_fixed_speedup: float | None
    best_fixed_accept: float | None
    bastion_speedup: float | None
    bastion_accept: float | None
    bastion_mean_budget: float | None
    accept_vs_chain: float | None  # bastion acceptance length / chain's
    speedup_vs_chain: float | None  # bastion speedup / chain's
    speedup_vs_best: float | None  # bastion speedup / best fixed budget's
    beat_chain: bool | None  # bastion speedup > chain's
    matched_best: bool | None  # bastion speedup >= (1 - MATCH_TOLERANCE) x best fixed budget's
    #: the methods in each part (see :class:`Roles`): "bastion", "chain", "static", "best-first@N" by default
    adaptive_method: str | None = None
    chain_method: str | None = None
    static_method: str | None = None
    best_fixed_method: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(stats: Sequence[MethodStats], adaptive: str = "bastion") -> list[DatasetSummary]:
    """One :class:`DatasetSummary` per dataset present in ``stats`` (``"all"`` last when present), with
    the parts played by the methods :func:`method_roles` picks (``adaptive`` names the adaptive method)."""
    roles = method_roles([s.method for s in stats], adaptive=adaptive)
    out: list[DatasetSummary] = []
    for ds in dict.fromkeys(s.dataset for s in stats):
        by = {s.method: s for s in stats if s.dataset == ds}
        pick = lambda m: by.get(m) if m is not None else None  # noqa: E731
        chain, static, ours = pick(roles.chain), pick(roles.static), pick(roles.adaptive)
        sweep = [(b, by[m]) for b, m in roles.sweep if m in by]
        best = max(sweep, key=lambda bs: (bs[1].speedup or 0.0, -bs[0]), default=None)
        best_speed = best[1].speedup if best else None
        ours_speed = ours.speedup if ours else None
        chain_speed = chain.speedup if chain else None
        out.append(
            DatasetSummary(
                dataset=ds,
                chain_speedup=chain_speed,
                chain_accept=chain.acceptance_length if chain else None,
                static_speedup=static.speedup if static else None,
                static_accept=static.acceptance_length if static else None,
                best_fixed_budget=best[0] if best else None,
                best_fixed_speedup=best_speed,
                best_fixed_accept=best[1].acceptance_length if best else None,
                bastion_speedup=ours_speed,
                bastion_accept=ours.acceptance_length if ours else None,
                bastion_mean_budget=ours.mean_budget if ours else None,
                accept_vs_chain=_ratio(ours.acceptance_length if ours else None, chain.acceptance_length if chain else None),
                speedup_vs_chain=_ratio(ours_speed, chain_speed),
                speedup_vs_best=_ratio(ours_speed, best_speed),
                beat_chain=(ours_speed > chain_speed) if ours_speed is not None and chain_speed is not None else None,
                matched_best=(ours_speed >= (1 - MATCH_TOLERANCE) * best_speed)
                if ours_speed is not None and best_speed is not None
                else None,
                adaptive_method=ours.method if ours else None,
                chain_method=chain.method if chain else None,
                static_method=static.method if static else None,
                best_fixed_method=best[1].method if best else None,
            )
        )
    return out


def latency_points(runs: Iterable[PromptRun], exclude: Sequence[str] = ("ar",)) -> list[tuple[int, int, float]]:
    """(budget, context_len, measured verify seconds) of every tree step of the run."""
    return [
        (s.budget, s.context_len, s.timings.verify)
        for r in runs
        if r.method not in exclude
        for s in r.result.steps
    ]


def cost_per_token(stats: MethodStats) -> dict[str, float]:
    """Seconds per generated token spent in each stage (see :data:`STAGES`)."""
    n = max(1, stats.new_tokens)
    return {k: v / n for k, v in stats.stage_s.items()}


def cost_gap(mine: MethodStats, other: MethodStats) -> list[tuple[str, float]]:
    """Per-stage difference of seconds per token, ``mine - other``, largest extra cost first: what a
    slower method pays for, stage by stage."""
    a, b = cost_per_token(mine), cost_per_token(other)
    return sorted(((k, a[k] - b[k]) for k in STAGES), key=lambda kv: kv[1], reverse=True)
