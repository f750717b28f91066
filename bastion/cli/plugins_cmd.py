"""``bastion plugins``: list registered components by kind, with their source."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plugins",
        help="list every registered component by kind, with its source",
        description="List every registered component (built-in or from a plugin distribution) by kind.",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from bastion import registry

    comps = registry.components()
    failures = registry.failures()
    broken = {(c.kind, c.name): err for c in comps if (err := registry.check_factory(c)) is not None}
    if args.json:
        payload = {
            # "broken" (why its factory cannot be imported) and "component" (a skipped duplicate) only when set
            "components": [{**c.as_dict(), **({"broken": broken[(c.kind, c.name)]} if (c.kind, c.name) in broken else {})}
                           for c in comps],
            "failed": [{"plugin": f.plugin, "source": f.source, "error": f.error, **({"component": f.component} if f.component else {})}
                       for f in failures],
            "blocked": registry.blocked(),
        }
        print(json.dumps(payload, indent=2))
        return 0
    for kind in registry.kinds():
        print(f"{kind}:")
        rows = [c for c in comps if c.kind == kind]
        if not rows:
            print("  (none)")
        for c in rows:
            desc = f"  - {c.description}" if c.description else ""
            err = broken.get((c.kind, c.name))
            mark = f"  BROKEN: {err}" if err else ""
            print(f"  {c.name:<20} [{c.source}]{desc}{mark}")
    for f in failures:
        if f.component:
            print(f"skipped component: {f.component} of plugin {f.plugin} ({f.source}): {f.error}")
        else:
            print(f"failed plugin: {f.plugin} ({f.source}): {f.error}")
    if broken:
        print(f"broken components: {len(broken)} (their factory cannot be imported; create() would fail)")
    for b in registry.blocked():
        print(f"blocked plugin: {b}")
    return 0
