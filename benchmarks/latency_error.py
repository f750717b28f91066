"""How well does the online-fitted latency model predict a real target's verify times?

Measures ``Target.forward_tree`` times of the demo target (or ``--target DIR``) for tree sizes
n = 1 .. 192 at contexts 16 .. 1024, feeds half of the timings to a fresh ``roofline`` latency model in
shuffled order (as a decode run would: online, one observation at a time) and predicts the other half.
Reports the median and 90th-percentile relative error with and without the residual table.

Usage: python benchmarks/latency_error.py [--target DIR] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch

from bastion.controllers.latency.calibrate import measure_verify_curve
from bastion.controllers.latency.roofline import RooflineLatency
from bastion.huggingface.causal_lm import HFTarget

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192)
CONTEXTS = (16, 64, 256, 700)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="a causal LM directory (default: the demo target)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="timings per (n, context) for fitting, and as many held out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.target is None:
        from bastion.demo import demo_paths

        args.target = demo_paths().target
    target = HFTarget.from_pretrained(args.target)
    # one thread: its CPU time is the clock, robust to other processes on the machine
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    curve = measure_verify_curve(target, SIZES, CONTEXTS, repeats=2 * args.repeats, warmup=3, seed=args.seed, clock=clock)
    train = [(n, c, s) for n, c, times in curve for s in times[::2]]
    random.Random(args.seed).shuffle(train)
    rows = []
    for residual in (False, True):
        model = RooflineLatency(profile=None, residual=residual, window=max(512, len(train)))
        model.bind(target)
        for n, c, s in train:
            model.observe(n, c, s)
        model.refit()
        errors = np.array([abs(model.predict(n, c) - statistics.median(t[1::2])) / statistics.median(t[1::2]) for n, c, t in curve])
        rows.append((residual, float(np.median(errors)), float(np.quantile(errors, 0.9)), float(errors.max())))
    print(f"{len(curve)} (n, context) points, n = {SIZES[0]}..{SIZES[-1]}, contexts {CONTEXTS}, "
          f"{len(train)} timings fitted online, torch threads {args.threads}")
    print("| model | median rel. error | 90th percentile | max |")
    print("|---|---|---|---|")
    for residual, med, p90, worst in rows:
        name = "roofline + residual" if residual else "roofline only"
        print(f"| {name} | {100 * med:.1f}% | {100 * p90:.1f}% | {100 * worst:.0f}% |")


if __name__ == "__main__":
    main()
