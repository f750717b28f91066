"""Ratios paired within rounds: what a shared, drifting machine still lets a benchmark compare.

A benchmark that runs several settings one after another, round after round, can compare them two
ways: each setting's fastest round against the others' (rounds minutes apart, so the machine's drift
between them enters the ratio), or the ratio of two settings *within* each round (seconds apart), then
its median over rounds. On a machine whose speed moves by tens of percent within minutes only the second
resolves differences of a few percent; its smallest and largest round say how far one round can be
trusted.
"""

from __future__ import annotations

import statistics
from typing import Hashable, Iterable, Mapping, Sequence

import attrs

__all__ = ["PairedRatio", "paired_ratios", "ratio_table"]


@attrs.frozen
class PairedRatio:
    """``reference`` over ``against`` at one ``level`` (a concurrency, a batch size): the median of the
    per-round ratios, the smallest and largest round, and how many rounds had both."""

    level: Hashable
    against: str
    median: float
    low: float
    high: float
    rounds: int


def paired_ratios(
    rounds: Iterable[Mapping[tuple[str, Hashable], float]], reference: str, against: Sequence[str]
) -> list[PairedRatio]:
    """Per level: ``reference`` / each setting of ``against``, and / the best of them (``"best"``: the
    largest of ``against`` in that same round, when there are two or more), from each round's rates
    ``{(setting, level): rate}`` (higher is better, e.g. tokens/s) -> one :class:`PairedRatio` per
    (level, comparison), levels in first-seen order, ``"best"`` first. A round without the reference, or
    without any comparison, at a level is left out of that level's ratios; a comparison missing from a
    round is left out of that round's "best" (non-positive rates count as missing)."""
    per: dict[tuple[Hashable, str], list[float]] = {}
    levels: dict[Hashable, None] = {}
    for rates in rounds:
        here = dict.fromkeys(level for _, level in rates)
        levels.update(here)
        for level in here:
            mine = rates.get((reference, level), 0.0)
            others = {name: rates[(name, level)] for name in against if rates.get((name, level), 0.0) > 0}
            if mine <= 0 or not others:
                continue
            for name, rate in others.items():
                per.setdefault((level, name), []).append(mine / rate)
            if len(against) > 1:
                per.setdefault((level, "best"), []).append(mine / max(others.values()))
    order = ["best", *against]
    out = []
    for level in levels:
        for name in order:
            values = per.get((level, name))
            if values:
                out.append(PairedRatio(level, name, statistics.median(values), min(values), max(values), len(values)))
    return out


def ratio_table(ratios: Sequence[PairedRatio], reference: str, level_name: str = "C") -> str:
    """A Markdown table of paired ratios: a row per level, a column per comparison, each cell
    ``median (low-high)``."""
    names = list(dict.fromkeys(r.against for r in ratios))
    others = ", ".join(n for n in names if n != "best")
    head = [f"{reference} / " + ("best of {" + others + "}" if n == "best" else n) for n in names]
    lines = [f"| {level_name} | " + " | ".join(head) + " |", "|---:|" + "---|" * len(names)]
    for level in dict.fromkeys(r.level for r in ratios):
        cells = {r.against: r for r in ratios if r.level == level}
        row = [f"{cells[n].median:.2f} ({cells[n].low:.2f}-{cells[n].high:.2f})" if n in cells else "-" for n in names]
        lines.append(f"| {level} | " + " | ".join(row) + " |")
    return "\n".join(lines)
