"""Several drafter families in one benchmark run (``bastion bench --drafters dflash,model``).

A method name may end in ``:FAMILY`` (``chain:model``, ``best-first@8:dflash``, ``bastion:model``): the
method runs with that family's drafter. :func:`family_methods` expands plain method names over the
families, leaving ``ar`` alone (the one shared baseline) and leaving out pairings a tree builder declines
(``static`` takes marginals only). :func:`family_summaries` gives each family the usual per-dataset
summary (chain, best fixed budget, bastion), and :func:`families_table` puts them in one table.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from bastion.bench.methods import ADAPTIVE, AR, FAMILY_SEP as _SEP, split_family
from bastion.bench.metrics import DatasetSummary, MethodStats, summarize
from bastion.core.errors import InvalidInputError

__all__ = ["split_family", "family_methods", "family_summaries", "families_table"]


def family_methods(methods: Sequence[str], drafters: Mapping[str, Any], accepts: Mapping[str, frozenset[str]]) -> tuple[str, ...]:
    """Every method of ``methods`` once per drafter family (``ar`` once), skipping builder / drafter
    pairings the builder declines. ``accepts`` maps a tree builder name to the proposal kinds it takes."""
    out: list[str] = []
    for m in methods:
        if m == AR:
            out.append(m)
            continue
        builder = "best-first" if m == ADAPTIVE else m.partition("@")[0]
        for family, drafter in drafters.items():
            kind = getattr(drafter, "proposes", None) or "marginals"
            if kind in accepts.get(builder, frozenset({"marginals"})):
                out.append(f"{m}{_SEP}{family}")
    if not out:
        raise InvalidInputError("no method pairs with any of the drafters")
    return tuple(out)


def family_summaries(stats: Sequence[MethodStats], families: Sequence[str]) -> dict[str, list[DatasetSummary]]:
    """Per family, the per-dataset summary of its methods (names stripped of the family) against ar."""
    out: dict[str, list[DatasetSummary]] = {}
    for family in families:
        mine = []
        for s in stats:
            base, fam = split_family(s.method)
            if fam == family:
                mine.append(attrs.evolve(s, method=base))
        out[family] = summarize(mine)
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def families_table(summaries: Mapping[str, Sequence[DatasetSummary]]) -> str:
    """One markdown table: per family and dataset, acceptance length and speedup over ar of chain, the
    best fixed budget of the best-first sweep and bastion, and bastion against the best fixed budget."""
    head = ["drafter", "dataset", "chain (acc / speedup)", "best fixed N (acc / speedup)", "bastion (acc / speedup, mean N)", "bastion / best fixed"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, summary in summaries.items():
        for d in summary:
            rows.append(
                "| "
                + " | ".join(
                    [
                        family,
                        d.dataset,
                        f"{_f(d.chain_accept)} / {_f(d.chain_speedup)}x",
                        f"{_f(d.best_fixed_accept)} / {_f(d.best_fixed_speedup)}x (N={d.best_fixed_budget or '-'})",
                        f"{_f(d.bastion_accept)} / {_f(d.bastion_speedup)}x ({_f(d.bastion_mean_budget, '{:.1f}')})",
                        _f(d.speedup_vs_best, "{:.3f}"),
                    ]
                )
                + " |"
            )
    return "\n".join(rows)
