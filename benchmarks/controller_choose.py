"""Cost of one budget decision and of one online refit of the roofline latency model.

Times ``BastionController.choose`` over trees of up to 1024 candidate sizes with the ``roofline`` latency
model of a Qwen3-8B-shaped target (the shape sets the arithmetic, not the speed of the choice), and the
``refit`` the latency model runs every few steps. Prints a Markdown table; ``--json PATH`` also saves it.

    python benchmarks/controller_choose.py [--repeats 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from bastion.controllers import BastionController, ModelCost, RooflineLatency

QWEN3_8B = ModelCost(
    num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288, vocab_size=151936
)


def best_first_scores(n: int, rng: np.random.Generator) -> torch.Tensor:
    """Non-increasing log rho in node order, root first, like a best-first tree of n nodes."""
    logp = np.sort(np.log(rng.uniform(1e-4, 1.0, n - 1)))[::-1].copy()
    return torch.from_numpy(np.concatenate([[0.0], logp])).float()


def time_calls(fn, repeats: int) -> dict[str, float]:
    """Median / p90 wall time and median CPU time of the calling thread, in microseconds.

    CPU time is reported next to wall time because a shared machine can deschedule the process in the
    middle of a call; the thread's CPU time is what the call itself costs."""
    for _ in range(min(200, repeats)):  # warm caches
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    wall.sort()
    return {
        "median_us": statistics.median(wall) * 1e6,
        "p90_us": wall[int(0.9 * len(wall))] * 1e6,
        "cpu_median_us": statistics.median(cpu) * 1e6,
        "cpu_mean_us": statistics.fmean(cpu) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    latency = RooflineLatency(cost=QWEN3_8B, device="cpu", peak_flops=989e12, bandwidth=3.35e12, profile=None)
    rows = []
    for n_max in (64, 256, 1024):
        scores = best_first_scores(n_max, rng)
        for label, ctrl in (
            ("scan", BastionController(rule="scan")),
            ("first-decrease", BastionController(rule="first-decrease")),
            ("scan, 11 buckets", BastionController(buckets=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])),
        ):
            stats = time_calls(lambda: ctrl.choose(scores, 1500, latency, 2e-3), args.repeats)
            rows.append({"what": f"choose ({label})", "n_max": n_max, **stats})

    # refit cost: 512 stored timings (the default window), warm start as in the decode loop
    for i in range(512):
        n = int(rng.integers(1, 1025))
        c = int(rng.integers(0, 8192))
        latency.observe(n, c, latency.predict(n, c) * float(rng.uniform(0.9, 1.1)))
    stats = time_calls(latency.refit, max(20, args.repeats // 100))
    rows.append({"what": "roofline refit (512 timings, warm start)", "n_max": 0, **stats})
    stats = time_calls(lambda: latency.observe(64, 1500, 0.02), args.repeats)
    rows.append({"what": f"roofline observe (refit every {latency.refit_every})", "n_max": 0, **stats})

    print(f"CPU threads: 1 of {os.cpu_count()}; torch {torch.__version__}")
    print("| what | candidates | wall median (us) | wall p90 (us) | CPU median (us) | CPU mean (us) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['what']} | {r['n_max'] or '-'} | {r['median_us']:.1f} | {r['p90_us']:.1f} "
            f"| {r['cpu_median_us']:.1f} | {r['cpu_mean_us']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
