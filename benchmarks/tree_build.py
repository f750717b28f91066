"""Time tree building from drafter-sized marginals and split it into its phases.

Default workload: logits [15, 151936] float32 (a block-16 drafter over the Qwen3 vocabulary), budgets
N = 64, 256, 1024. Per build, median over repeats, in milliseconds:

* ``softmax``  Marginals.from_logits (input checks + log_softmax), paid once per step by the pipeline
* ``probe``    per-depth top-(probe_k + 1) on the device + the single host transfer
* ``thresh``   depth 1's top-(N - 1) + one comparison pass over the deeper depths + host transfer (what
  a build adds when the probe is not enough)
* ``heap``     best-first selection on host floats/ints (over the probed candidates when exact)
* ``pack``     host lists -> Tree tensors
* ``build``    BestFirstBuilder.build end to end; ``path``: ``direct`` (N - 1 <= probe_k, one top-k),
  ``probe`` (the probe sufficed) or ``threshold`` (probe, then one comparison pass for the tokens that
  can still reach the probe's last score)

Then, from the raw logits to a tree (what a decode step pays), against two reference-style builders
written here for comparison, all exact best-first heaps over host candidates:

* ``bastion``      Marginals.from_logits + BestFirstBuilder.build
* ``topk-N``       one top-(N - 1) over the raw logits, logsumexp normalisation of the picked values,
  heap, and an [N, N] ancestor-visibility matrix (the layout of the DDTree release)
* ``topk-128``     the same with ranks capped at 128 per depth (as the official BASTION reproduction
  script does; its trees differ from the optimum once a depth needs more than 128 ranks)

Two clocks are reported: wall time, and the calling thread's CPU time (``--threads 1`` keeps torch's
work on the calling thread, so CPU time is then robust to other processes competing for the cores).

Usage: python benchmarks/tree_build.py [--depth 15] [--vocab 151936] [--nodes 64 256 1024]
       [--repeats 30] [--threads 1] [--logits peaked|flat]
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import time
from typing import Callable

import numpy as np
import torch

from bastion.core import Marginals
from bastion.trees import BestFirstBuilder, ChainBuilder, StaticBuilder, expand_best_first
from bastion.trees.best_first import threshold_candidates
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


def reference_build(logits: torch.Tensor, n: int, cap: int | None) -> tuple[list[int], list[int], torch.Tensor]:
    """A reference-style best-first build from raw logits [K, V]: one top-k of ``min(n - 1, cap)`` ranks,
    logsumexp normalisation of the picked values, a heap over (score, depth, rank), and an [n, n]
    ancestor-visibility matrix filled row by row from the parent's row."""
    k = min(n - 1, logits.shape[-1]) if cap is None else min(n - 1, cap, logits.shape[-1])
    x = logits.float()
    vals, idx = torch.topk(x, k, dim=-1)  # [K, k]
    vals = (vals - torch.logsumexp(x, dim=-1, keepdim=True)).tolist()
    idx = idx.tolist()
    tokens, parents = [0], [-1]
    heap = [(-vals[0][0], 0, 0, 0, 0.0)]
    while heap and len(tokens) < n:
        neg, d, r, p, ps = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(idx[d][r])
        parents.append(p)
        if r + 1 < k:
            heapq.heappush(heap, (-(ps + vals[d][r + 1]), d, r + 1, p, ps))
        if d + 1 < len(vals):
            heapq.heappush(heap, (neg - vals[d + 1][0], d + 1, 0, node, -neg))
    size = len(tokens)
    vis = np.zeros((size, size), dtype=np.bool_)
    vis[0, 0] = True
    for i in range(1, size):
        vis[i, :i] = vis[parents[i], :i]
        vis[i, i] = True
    return tokens, parents, torch.from_numpy(vis)


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
    head = ("N", "probe", "thresh", "heap", "pack", "build", "path", "A_hat", "depth")
    print(f"{head[0]:>5} " + " ".join(f"{h:>15}" for h in head[1:6]) + f" {head[6]:>6} {head[7]:>7} {head[8]:>5}")
    for n in args.nodes:
        k = min(n - 1, m.vocab_size)
        probe = top_candidates(m.log_probs, m.depth, probe_k + 1)
        probed = expand_best_first(probe, 0, n, width=probe_k)
        exact = probe_k < k and probed.is_exact(n)
        if probe_k >= k:
            heap_cand, heap_width = top_candidates(m.log_probs, m.depth, k), None
        elif exact:
            heap_cand, heap_width = probe, probe_k
        else:
            heap_cand, heap_width = threshold_candidates(m.log_probs, probe, probed.scores[-1], k, n), None
        floor = probed.scores[-1]
        t_probe = median_ms(lambda: top_candidates(m.log_probs, m.depth, probe_k + 1), args.repeats, device)
        t_full = median_ms(lambda: threshold_candidates(m.log_probs, probe, floor, k, n), args.repeats, device)
        t_heap = median_ms(lambda: expand_best_first(heap_cand, 0, n, width=heap_width), args.repeats, device)
        lists = expand_best_first(heap_cand, 0, n, width=heap_width).lists()
        t_pack = median_ms(lambda: make_tree(*lists, device), args.repeats, device)
        t_build = median_ms(lambda: builder.build(m, 0, n), args.repeats, device)
        tree = builder.build(m, 0, n)
        path = "direct" if probe_k >= k else ("probe" if exact else "threshold")
        print(
            f"{n:>5} {fmt(t_probe)} {fmt(t_full)} {fmt(t_heap)} {fmt(t_pack)} {fmt(t_build)} {path:>6}"
            f" {tree.accept_score():7.3f} {tree.max_depth:>5}"
        )
    print("from raw logits to a tree, wall/cpu ms (same run):")
    print(f"{'N':>5} {'bastion':>15} {'topk-N':>15} {'topk-128':>15}")
    for n in args.nodes:
        ours = median_ms(lambda: builder.build(Marginals.from_logits(logits), 0, n), args.repeats, device)
        wide = median_ms(lambda: reference_build(logits, n, None), args.repeats, device)
        capped = median_ms(lambda: reference_build(logits, n, 128), args.repeats, device)
        print(f"{n:>5} {fmt(ours)} {fmt(wide)} {fmt(capped)}")
    n_max = max(args.nodes)
    for name, other in (("chain", ChainBuilder()), ("static (default)", StaticBuilder())):
        t = median_ms(lambda: other.build(m, 0, n_max), args.repeats, device)
        tree = other.build(m, 0, n_max)
        print(f"{name}: {fmt(t)} per build, {len(tree)} nodes, A_hat = {tree.accept_score():.3f}")


if __name__ == "__main__":
    main()
