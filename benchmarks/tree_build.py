"""Time tree building from drafter-sized marginals and split it into its phases.

Default workload: logits [15, 151936] float32 (a block-16 drafter over the Qwen3 vocabulary), budgets
N = 64, 256, 1024. Per build, median over repeats, in milliseconds:

* ``softmax``  Marginals.from_logits (input checks + log_softmax), paid once per step by the pipeline
* ``probe``    per-depth top-(probe_k + 1) on the device + the single host transfer
* ``full``     per-depth top-(N - 1) + host transfer (what a build costs when the probe is not enough)
* ``heap``     best-first selection on host floats/ints (over the probed candidates when exact)
* ``pack``     host lists -> Tree tensors
* ``build``    BestFirstBuilder.build end to end; ``path``: ``direct`` (N - 1 <= probe_k, one top-k),
  ``probe`` (the probe sufficed) or ``full`` (probe, then the full top-k)

Two clocks are reported: wall time, and the calling thread's CPU time (``--threads 1`` keeps torch's
work on the calling thread, so CPU time is then robust to other processes competing for the cores).

Usage: python benchmarks/tree_build.py [--depth 15] [--vocab 151936] [--nodes 64 256 1024]
       [--repeats 30] [--threads 1] [--logits peaked|flat]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from bastion.core import Marginals
from bastion.trees import BestFirstBuilder, ChainBuilder, StaticBuilder, expand_best_first
from bastion.trees.common import make_tree, top_candidates


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[float, float]:
    """(wall, thread CPU) medians in milliseconds."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        _sync(device)
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        _sync(device)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def drafter_like_logits(depth: int, vocab: int, kind: str, seed: int = 0) -> torch.Tensor:
    """``peaked``: a few strong candidates per depth (sharper near the root) over a Gaussian tail, like a
    trained drafter. ``flat``: Gaussian logits only, a worst case for the probe."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(depth, vocab, generator=gen)  # [K, V]
    if kind == "peaked":
        hot = torch.randint(0, vocab, (depth, 8), generator=gen)  # [K, 8]
        boost = torch.linspace(16.0, 8.0, depth).unsqueeze(1) - 1.5 * torch.arange(8).float()  # [K, 8]
        x.scatter_add_(1, hot, boost)
    else:
        x = x * 2.0
    return x


def fmt(pair: tuple[float, float]) -> str:
    return f"{pair[0]:7.2f}/{pair[1]:<7.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--logits", choices=["peaked", "flat"], default="peaked")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    logits = drafter_like_logits(args.depth, args.vocab, args.logits).to(device)  # [K, V] float32
    m = Marginals.from_logits(logits)
    builder = BestFirstBuilder()
    probe_k = builder.probe_k or 0
    print(f"logits [{args.depth}, {args.vocab}] float32 ({args.logits}) on {device}, torch threads = {args.threads}")
    print("times in ms as wall/cpu (median of", args.repeats, "runs)")
    print(f"softmax (Marginals.from_logits): {fmt(median_ms(lambda: Marginals.from_logits(logits), args.repeats, device))}")
    head = ("N", "probe", "full", "heap", "pack", "build", "path", "A_hat", "depth")
    print(f"{head[0]:>5} " + " ".join(f"{h:>15}" for h in head[1:6]) + f" {head[6]:>6} {head[7]:>7} {head[8]:>5}")
    for n in args.nodes:
        k = min(n - 1, m.vocab_size)
        probe = top_candidates(m.log_probs, m.depth, probe_k + 1)
        full = top_candidates(m.log_probs, m.depth, k)
        probed = expand_best_first(probe, 0, n, width=probe_k)
        exact = probe_k < k and probed.is_exact(n)
        heap_cand, heap_width = (probe, probe_k) if exact else (full, None)
        t_probe = median_ms(lambda: top_candidates(m.log_probs, m.depth, probe_k + 1), args.repeats, device)
        t_full = median_ms(lambda: top_candidates(m.log_probs, m.depth, k), args.repeats, device)
        t_heap = median_ms(lambda: expand_best_first(heap_cand, 0, n, width=heap_width), args.repeats, device)
        lists = expand_best_first(heap_cand, 0, n, width=heap_width).lists()
        t_pack = median_ms(lambda: make_tree(*lists, device), args.repeats, device)
        t_build = median_ms(lambda: builder.build(m, 0, n), args.repeats, device)
        tree = builder.build(m, 0, n)
        path = "direct" if probe_k >= k else ("probe" if exact else "full")
        print(
            f"{n:>5} {fmt(t_probe)} {fmt(t_full)} {fmt(t_heap)} {fmt(t_pack)} {fmt(t_build)} {path:>6}"
            f" {tree.accept_score():7.3f} {tree.max_depth:>5}"
        )
    n_max = max(args.nodes)
    for name, other in (("chain", ChainBuilder()), ("static (default)", StaticBuilder())):
        t = median_ms(lambda: other.build(m, 0, n_max), args.repeats, device)
        tree = other.build(m, 0, n_max)
        print(f"{name}: {fmt(t)} per build, {len(tree)} nodes, A_hat = {tree.accept_score():.3f}")


if __name__ == "__main__":
    main()
