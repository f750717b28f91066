"""Several drafter families in one benchmark run (``bastion bench --drafters dflash,model``).

A method name may end in ``:FAMILY`` (``chain:model``, ``best-first@8:dflash``, ``bastion:model``): the
method runs with that family's drafter. :func:`family_methods` expands plain method names over the
families, leaving ``ar`` alone (the one shared baseline) and leaving out pairings a tree builder declines
(``static`` takes marginals only) or a method declines (``eagle3`` runs with EAGLE-3 drafters only).

Each family has its **own default tree**, the way its method decodes on its own: the top-1 ``chain`` for
block drafters (DFlash) and plain autoregressive drafters, EAGLE-3's whole candidate tree (the ``eagle3``
method) for EAGLE-3 drafters. When the methods include ``bastion``, :func:`family_methods` adds a family's
own default tree if the methods lack it, so every family's adaptive run has its own decoding beside it.
:func:`family_summaries` gives each family the usual per-dataset summary (chain, best fixed budget,
bastion) plus its own default tree, and :func:`families_table` puts them in one table.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import attrs

from attrs import frozen

from bastion.bench.methods import ADAPTIVE, AR, EAGLE3, FAMILY_SEP as _SEP, is_eagle3_drafter, split_family
from bastion.bench.metrics import DatasetSummary, MethodStats, summarize
from bastion.contract.errors import InvalidInputError

__all__ = ["split_family", "own_tree", "family_methods", "FamilySummary", "family_summaries", "families_table"]


def own_tree(drafter: Any) -> str:
    """The method a drafter's family decodes with on its own: ``eagle3`` for an EAGLE-3 drafter, else
    ``chain``."""
    return EAGLE3 if is_eagle3_drafter(drafter) else "chain"


def family_methods(methods: Sequence[str], drafters: Mapping[str, Any], accepts: Mapping[str, frozenset[str]]) -> tuple[str, ...]:
    """Every method of ``methods`` once per drafter family (``ar`` once), skipping builder / drafter
    pairings the builder declines and ``eagle3`` for drafters other than EAGLE-3's; with ``bastion`` among
    the methods, each family's :func:`own_tree` is added when missing. ``accepts`` maps a tree builder name
    to the proposal kinds it takes."""
    out: list[str] = []
    methods = list(methods)
    if ADAPTIVE in methods:
        methods += [t for t in dict.fromkeys(own_tree(d) for d in drafters.values()) if t not in methods]
    for m in methods:
        if m == AR:
            out.append(m)
            continue
        builder = "best-first" if m in (ADAPTIVE, EAGLE3) else m.partition("@")[0]
        for family, drafter in drafters.items():
            if m == EAGLE3 and not is_eagle3_drafter(drafter):
                continue
            kind = getattr(drafter, "proposes", None) or "marginals"
            if kind in accepts.get(builder, frozenset({"marginals"})):
                out.append(f"{m}{_SEP}{family}")
    if not out:
        raise InvalidInputError("no method pairs with any of the drafters")
    return tuple(out)


@frozen
class FamilySummary(DatasetSummary):
    """A family's :class:`DatasetSummary` with its own default tree (``eagle3`` or ``chain``) beside it."""

    own_method: str | None = None
    own_speedup: float | None = None
    own_accept: float | None = None
    speedup_vs_own: float | None = None  # bastion speedup / the own default tree's


def family_summaries(stats: Sequence[MethodStats], families: Sequence[str]) -> dict[str, list[FamilySummary]]:
    """Per family, the per-dataset summary of its methods (names stripped of the family) against ar, with
    its own default tree: ``eagle3`` when the family ran it, else its ``chain``."""
    out: dict[str, list[FamilySummary]] = {}
    for family in families:
        mine = []
        for s in stats:
            base, fam = split_family(s.method)
            if fam == family:
                mine.append(attrs.evolve(s, method=base))
        own = EAGLE3 if any(s.method == EAGLE3 for s in mine) else "chain"
        rows = []
        for d in summarize(mine):
            ref = next((s for s in mine if s.method == own and s.dataset == d.dataset), None)
            ref_speed = ref.speedup if ref is not None else None
            ratio = d.bastion_speedup / ref_speed if d.bastion_speedup is not None and ref_speed else None
            rows.append(FamilySummary(**attrs.asdict(d, recurse=False), own_method=own if ref is not None else None,
                                      own_speedup=ref_speed, own_accept=ref.acceptance_length if ref is not None else None,
                                      speedup_vs_own=ratio))
        out[family] = rows
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _own(d: DatasetSummary) -> str:
    method = getattr(d, "own_method", None)
    if method is None:
        return "-"
    return f"{method}: {_f(getattr(d, 'own_accept', None))} / {_f(getattr(d, 'own_speedup', None))}x"


def families_table(summaries: Mapping[str, Sequence[DatasetSummary]]) -> str:
    """One markdown table: per family and dataset, acceptance length and speedup over ar of chain, the
    best fixed budget of the best-first sweep, the family's own default tree (:class:`FamilySummary`) and
    bastion, and bastion against the best fixed budget and against the own default tree."""
    head = ["drafter", "dataset", "chain (acc / speedup)", "best fixed N (acc / speedup)", "own default tree (acc / speedup)",
            "bastion (acc / speedup, mean N)", "bastion / best fixed", "bastion / own tree"]
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
                        _own(d),
                        f"{_f(d.bastion_accept)} / {_f(d.bastion_speedup)}x ({_f(d.bastion_mean_budget, '{:.1f}')})",
                        _f(d.speedup_vs_best, "{:.3f}"),
                        _f(getattr(d, "speedup_vs_own", None), "{:.3f}"),
                    ]
                )
                + " |"
            )
    return "\n".join(rows)
