"""Where a bastion step's CPU time goes on the demo pair, by component, in thread CPU time.

Wraps each component's per-step method (drafter propose / commit, tree build, controller decide /
observe, target forward / commit, verifier, latency-model observe, prefill) with a thread-CPU-time
counter (torch on one thread: other processes competing for the cores do not inflate it), decodes the
first ``--limit`` prompts of GSM8K, HumanEval and MT-bench, and prints each part's share of the total.

    python benchmarks/step_split.py                 # the default pipeline (speculation gate on)
    python benchmarks/step_split.py --no-gate       # every step drafts
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import bastion
from bastion.bench.datasets import load_dataset
from bastion.bench.templates import render_prompt

#: (component attribute of the pipeline, method, label)
PARTS = (
    ("drafter", "propose", "draft"),
    ("drafter", "commit", "drafter commit"),
    ("tree_builder", "build", "tree"),
    ("budget_controller", "decide", "controller decide"),
    ("budget_controller", "observe", "controller observe"),
    ("target", "prefill", "prefill"),
    ("target", "forward_tree", "verify forward"),
    ("target", "commit", "target commit"),
    ("verifier", "verify", "verdict"),
    ("latency_model", "observe", "latency observe"),
)


def _timed(obj: Any, method: str, label: str, spent: dict[str, list[float]]) -> None:
    inner = getattr(obj, method)

    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            entry = spent.setdefault(label, [0.0, 0])
            entry[0] += time.thread_time() - t0
            entry[1] += 1

    setattr(obj, method, call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=3, help="prompts per data set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--no-gate", action="store_true", help="draft every step (the speculation gate off)")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    options = {"budget_controller": {"gate": False}} if args.no_gate else None
    pipe = bastion.Pipeline.demo(component_options=options)
    prompts = [
        pipe.encode(render_prompt(p, pipe.tokenizer))
        for name in ("gsm8k", "humaneval", "mt_bench")
        for p in load_dataset(name, limit=args.limit, data_dir=args.data_dir)
    ]
    pipe.generate(prompts[0], max_new_tokens=16)  # warm-up outside the count
    spent: dict[str, list[float]] = {}
    for attr, method, label in PARTS:
        _timed(getattr(pipe, attr), method, label, spent)
    total, tokens, steps, drafted = 0.0, 0, 0, 0
    for ids in prompts:
        t0 = time.thread_time()
        res = pipe.generate(ids, max_new_tokens=args.max_new_tokens)
        total += time.thread_time() - t0
        tokens += len(res.tokens)
        steps += len(res.steps)
        drafted += sum(s.drafted for s in res.steps)
    print(f"{len(prompts)} prompts, {tokens} tokens, {steps} steps ({drafted} drafted), "
          f"{tokens / steps:.2f} tokens per step, {1e3 * total / tokens:.2f} ms CPU per token\n")
    print("| part | share of CPU time | ms per call | calls |")
    print("| --- | ---: | ---: | ---: |")
    for label, (seconds, calls) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        print(f"| {label} | {100 * seconds / total:.1f}% | {1e3 * seconds / max(1, calls):.3f} | {calls} |")
    rest = total - sum(s for s, _ in spent.values())
    print(f"| rest of the loop | {100 * rest / total:.1f}% | | |")


if __name__ == "__main__":
    main()
