"""Acceptance lengths of the demo pair on held-out prompts, and the lossless check.

For each held-out prompt (GSM8K test questions, HumanEval prompts, MT-bench first turns; none of them
seen in training) this decodes greedily with plain autoregression (the reference), the best-first tree
at a fixed budget of 32 nodes, the drafter's chain, and the adaptive BASTION controller, and checks that
every method's tokens equal the reference. Acceptance length per domain = tokens committed / target
forwards (decode steps), pooled over the domain's prompts.

    python benchmarks/demo_acceptance.py [--target DIR --drafter DIR] [--per-domain 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=None)
    ap.add_argument("--drafter", type=Path, default=None)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--per-domain", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from bastion import registry
    from bastion.bench.methods import ARDecoder
    from bastion.engine.pipeline import Pipeline
    from bastion.demo import demo_paths
    from bastion.training.corpus import default_data_dir, heldout_prompts

    paths = demo_paths() if args.target is None else None
    target_dir = args.target or paths.target
    drafter_dir = args.drafter or paths.drafter
    fixed = lambda: registry.create("budget_controller", "fixed", budget=args.budget)  # noqa: E731
    base = Pipeline.from_pretrained(target_dir, drafter_dir, budget_controller=fixed())
    methods = {
        f"best-first@{args.budget}": base,
        "chain": Pipeline(base.target, base.drafter, tree_builder="chain", budget_controller=fixed()),
        "bastion": Pipeline(base.target, base.drafter, budget_controller="bastion"),
    }
    ar = ARDecoder(base.target)
    tok = base.tokenizer
    prompts = heldout_prompts(args.data_dir or default_data_dir(), per_domain=args.per_domain)

    stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0, 0.0]))
    mismatches: list[str] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, (domain, text) in enumerate(prompts):
            ids = torch.tensor([tok.encode(text)[-384:]], dtype=torch.long)
            ref = ar.generate(ids, max_new_tokens=args.max_new_tokens)
            s = stats[domain]["ar"]
            s[0] += len(ref.tokens); s[1] += len(ref.tokens); s[2] += ref.wall_s; s[3] += len(ref.tokens)
            for name, pipe in methods.items():
                res = pipe.generate(ids, max_new_tokens=args.max_new_tokens)
                if res.tokens != ref.tokens:
                    mismatches.append(f"{domain}#{i} {name}")
                s = stats[domain][name]
                s[0] += sum(st.emitted for st in res.steps); s[1] += len(res.steps); s[2] += res.wall_s
                s[3] += sum(st.budget for st in res.steps)
                s.append(len(res.tokens))
            bf = stats[domain][f"best-first@{args.budget}"]
            print(f"[{i + 1}/{len(prompts)}] {domain}: {len(ref.tokens)} tokens, best-first acceptance so far "
                  f"{bf[0] / max(1.0, bf[1]):.2f}", flush=True)

    # acceptance length = tokens committed per decode step (one target forward each), pooled per domain;
    # the first token comes from the prefill and is not counted (as in GenerationResult.acceptance_length)
    table = {}
    for domain, per in stats.items():
        row = {}
        for name, v in per.items():
            tokens = sum(v[4:]) if name != "ar" else v[0]
            row[name] = {
                "acceptance_length": round(v[0] / max(1.0, v[1]), 3),
                "tokens_per_s": round(tokens / v[2], 1) if v[2] else None,
                "mean_budget": round(v[3] / max(1.0, v[1]), 2),
            }
        table[domain] = row
    report = {
        "prompts_per_domain": args.per_domain,
        "max_new_tokens": args.max_new_tokens,
        "budget": args.budget,
        "all_outputs_equal_ar": not mismatches,
        "mismatches": mismatches,
        "wall_s": round(time.perf_counter() - t0, 1),
        "domains": table,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0 if not mismatches else 1


if __name__ == "__main__":
    raise SystemExit(main())
