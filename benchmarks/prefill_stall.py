"""How long one long prompt stalls the requests already decoding, with and without chunked prefill.

Four short chat requests decode in an engine; after a few steps a long prompt arrives. The figure is
the longest gap between two steps of the running requests while the newcomer is prefilled (and joins),
against their median step time before it arrived. Run: ``python benchmarks/prefill_stall.py``
(demo pair, CPU; ``--threads 1`` by default so the numbers are comparable on a busy machine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import bastion
from bastion.engine import Engine, GenerationConfig


def measure(pipe: bastion.Pipeline, chunk: int | None, long_len: int) -> tuple[float, float, int]:
    """-> (median step seconds before the arrival, longest step while it was prefilled, steps it took)."""
    engine = Engine(pipe, prefill_chunk=chunk)
    questions = ("What is 2+3?", "Name a prime number.", "Say hello in French.", "What colour is the sky?")
    cfg = GenerationConfig(max_new_tokens=400, stop_on_eos=False)
    running = [engine.add(pipe.encode_chat(q)[0], cfg) for q in questions]
    before = []
    for _ in range(12):
        t = time.perf_counter()
        engine.step()
        before.append(time.perf_counter() - t)
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(10, pipe.target.vocab_size - 10, (long_len,), generator=gen)
    late = engine.add(long, GenerationConfig(max_new_tokens=8, stop_on_eos=False))
    during, steps = [], 0
    while late.t_admitted is None:
        t = time.perf_counter()
        engine.step()
        during.append(time.perf_counter() - t)
        steps += 1
    for r in running:
        engine.cancel(r)
    engine.run()
    return statistics.median(before[4:]), max(during), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long", type=int, default=900, help="tokens of the long prompt")
    parser.add_argument("--chunks", default="0,512,256,128", help="prefill chunk sizes to compare (0: whole prompt)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = bastion.Pipeline.demo()
    measure(pipe, None, 64)  # warm up
    print(f"long prompt: {args.long} tokens, beside 4 decoding requests (demo pair, {args.threads} thread(s))")
    print("| prefill chunk | median step before (ms) | longest step while prefilling (ms) | stall / step | steps to join |")
    print("|---|---|---|---|---|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        runs = [measure(pipe, chunk or None, args.long) for _ in range(args.repeats)]
        base = statistics.median(r[0] for r in runs)
        worst = statistics.median(r[1] for r in runs)
        label = "whole prompt" if chunk == 0 else str(chunk)
        print(f"| {label} | {base * 1e3:.1f} | {worst * 1e3:.1f} | {worst / base:.1f}x | {runs[0][2]} |")


if __name__ == "__main__":
    main()
