"""Does a step cost more at a long context? Draft and verify time of the demo pair at two contexts.

The clock is the calling thread's CPU time (torch on one thread), which other processes competing for
the cores do not inflate. Drafting: ``DFlashDrafter.propose`` after a context of random features (the
drafter has no position limit). Verifying: ``Target.forward_tree`` of best-first-shaped probe trees of
each size; the demo target accepts 1024 positions, so its long context is ``--verify-long`` (900, leaving room for the probes).
Prints a Markdown table of median milliseconds and the long / short ratio.

    python benchmarks/context_cost.py                       # draft 128 vs 2048, verify 128 vs 900
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import bastion
from bastion.controllers.latency.calibrate import measure_verify_curve
from bastion.contract.types import DraftContext, DraftStep


def draft_ms(pipe: bastion.Pipeline, context: int, steps: int) -> float:
    drafter = pipe.drafter
    feats = torch.randn(context, drafter.config.feature_size)
    drafter.begin(DraftContext(tokens=torch.zeros(context, dtype=torch.long), features=feats))
    times, length = [], context
    for _ in range(steps):
        t0 = time.thread_time()
        drafter.propose(DraftStep(root_token=3, context_len=length))
        times.append(time.thread_time() - t0)
        drafter.commit(torch.tensor([3]), torch.randn(1, drafter.config.feature_size))
        length += 1
    return 1e3 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", type=int, default=128)
    ap.add_argument("--draft-long", type=int, default=2048)
    ap.add_argument("--verify-long", type=int, default=900)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 32])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2, help="alternate short / long this many times; medians of all")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pipe = bastion.Pipeline.demo()
    draft: dict[int, list[float]] = {args.short: [], args.draft_long: []}
    verify: dict[tuple[int, int], list[float]] = {}
    for _ in range(args.rounds):
        for c in draft:
            draft[c].append(draft_ms(pipe, c, args.steps))
        curve = measure_verify_curve(pipe.target, args.sizes, [args.short, args.verify_long], repeats=args.steps // 2,
                                     warmup=3, clock=time.thread_time)
        for n, c, times in curve:  # c: the context the point was measured at (grows by one per forward)
            key = (n, args.short if abs(c - args.short) < abs(c - args.verify_long) else args.verify_long)
            verify.setdefault(key, []).extend(times)
    print("| stage | context short | context long | ms short | ms long | long / short |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    short, long = statistics.median(draft[args.short]), statistics.median(draft[args.draft_long])
    print(f"| draft (K = {pipe.drafter.num_draft_tokens}) | {args.short} | {args.draft_long} | {short:.2f} | {long:.2f} | {long / short:.2f} |")
    for n in args.sizes:
        s = 1e3 * statistics.median(verify[(n, args.short)])
        lg = 1e3 * statistics.median(verify[(n, args.verify_long)])
        print(f"| verify n = {n} | {args.short} | {args.verify_long} | {s:.2f} | {lg:.2f} | {lg / s:.2f} |")


if __name__ == "__main__":
    main()
