"""Phased scenarios: a workload whose prompt domain changes mid-run.

``bastion bench --scenario code,chat,math,translation`` runs the Spec-Bench prompts of each phase in
turn (``--limit`` prompts per phase), with every method's pipeline, controller state included, kept
from one phase to the next: exactly what a long-running server sees when its traffic shifts. A phase
is a Spec-Bench category (``coding``, ``writing``, ``math_reasoning``, ``translation``, ``summarization``,
``qa``, ``rag``, ...) or one of the short names ``code``, ``chat``, ``math``.

The report gives, per phase, every method's speedup over ``ar`` and the phase's **oracle**: the best
fixed method of that phase (any method other than ``ar`` and the adaptive ones, chosen after the fact),
with the adaptive method's share of it; and over the whole run, the adaptive method's time against the
per-phase oracles' summed time for the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import attrs
from attrs import frozen

from bastion.bench.datasets import Prompt, load_dataset
from bastion.bench.methods import ADAPTIVE, AR, split_family
from bastion.bench.metrics import MethodStats
from bastion.contract.errors import InvalidInputError

__all__ = ["PHASE_ALIASES", "PhaseRow", "phase_table", "parse_scenario", "scenario_prompts", "scenario_rows"]

#: short names for Spec-Bench categories
PHASE_ALIASES = {"code": "coding", "chat": "writing", "math": "math_reasoning"}


def parse_scenario(text: str) -> tuple[str, ...]:
    """``"code,chat,math"`` -> the Spec-Bench categories of the phases, in order."""
    phases = tuple(PHASE_ALIASES.get(p.strip(), p.strip()) for p in text.split(",") if p.strip())
    if not phases:
        raise InvalidInputError("--scenario needs at least one phase, e.g. code,chat,math,translation")
    return phases


def scenario_prompts(phases: Sequence[str], limit: int | None, data_dir: str | Path | None = None) -> list[Prompt]:
    """The prompts of each phase in turn (at most ``limit`` per phase), labelled ``K:CATEGORY`` (K from
    1) so every table reports the phases apart and in order."""
    pool = load_dataset("spec_bench", data_dir=data_dir)
    known = sorted({p.category for p in pool if p.category})
    out: list[Prompt] = []
    for k, phase in enumerate(phases, start=1):
        chosen = [p for p in pool if p.category == phase][: limit or None]
        if not chosen:
            raise InvalidInputError(f"--scenario phase {phase!r} is not a Spec-Bench category; categories: {', '.join(known)}")
        out.extend(attrs.evolve(p, dataset=f"{k}:{phase}") for p in chosen)
    return out


@frozen
class PhaseRow:
    """One phase: every method's speedup over ``ar``, the oracle (best fixed method) and the adaptive
    method's share of it."""

    phase: str
    speedups: dict[str, float]
    oracle: str
    adaptive_share: float | None


def _fixed(name: str) -> bool:
    base = split_family(name)[0]
    return base != AR and base != ADAPTIVE and not base.endswith(f"@{ADAPTIVE}")


def scenario_rows(stats: Sequence[MethodStats]) -> tuple[list[PhaseRow], float | None]:
    """Per-phase rows and the whole run's adaptive / per-phase-oracle ratio (oracle seconds for the
    adaptive method's tokens over the adaptive method's seconds; None without an adaptive method)."""
    by_phase: dict[str, dict[str, MethodStats]] = {}
    for s in stats:
        if s.dataset != "all":
            by_phase.setdefault(s.dataset, {})[s.method] = s
    rows: list[PhaseRow] = []
    oracle_s = adaptive_s = 0.0
    for phase in sorted(by_phase, key=lambda d: int(d.split(":", 1)[0]) if d.split(":", 1)[0].isdigit() else 0):
        methods = by_phase[phase]
        speedups = {m: s.speedup for m, s in methods.items() if s.speedup is not None}
        fixed = [m for m in methods if _fixed(m) and methods[m].tokens_per_s > 0]
        if not fixed:
            continue
        oracle = max(fixed, key=lambda m: methods[m].tokens_per_s)
        adaptive = methods.get(ADAPTIVE)
        share = None if adaptive is None else adaptive.tokens_per_s / methods[oracle].tokens_per_s
        rows.append(PhaseRow(phase, speedups, oracle, share))
        if adaptive is not None:
            oracle_s += adaptive.new_tokens / methods[oracle].tokens_per_s
            adaptive_s += adaptive.wall_s
    whole = oracle_s / adaptive_s if adaptive_s > 0 else None
    return rows, whole


def phase_table(stats: Sequence[MethodStats]) -> str:
    """The scenario report as markdown."""
    rows, whole = scenario_rows(stats)
    if not rows:
        return ""
    methods = sorted({m for r in rows for m in r.speedups if m != AR})
    head = "| phase | " + " | ".join(methods) + " | oracle (best fixed) | bastion / oracle |"
    lines = ["### Phases (the prompt domain changes mid-run; speedup over ar)", "", head, "|" + "---|" * (len(methods) + 3)]
    for r in rows:
        cells = [f"{r.speedups[m]:.2f}x" if m in r.speedups else "-" for m in methods]
        share = "-" if r.adaptive_share is None else f"{r.adaptive_share:.2f}"
        lines.append(f"| {r.phase} | " + " | ".join(cells) + f" | {r.oracle} | {share} |")
    if whole is not None:
        lines += ["", f"Whole run: bastion / per-phase oracle = {whole:.2f} (the oracle picks the best fixed method of each phase after the fact)."]
    return "\n".join(lines) + "\n"
