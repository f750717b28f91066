"""Continuous batching in one process: an engine kept at C running requests, per budget controller.

What a server's engine thread does, without the HTTP layer, the client or the event loop on the same
cores: bench prompts are queued so that C requests run at once (a finished one is replaced at the next
step), each controller on its own pipeline. At each concurrency every controller first makes one
warm-up pass (its costs and acceptance are learnt on the same prompts); then the controllers take
turns, pass by pass, and each pass reports completion tokens/s, the share of steps that drafted and the
widths chosen; a last table gives the first controller (``--reference``) over each other one, the ratio
taken within each pass (median over passes, smallest and largest pass). Compare controllers within one
run: the machine drifts, and its noise moves every figure between runs.

Run: ``python benchmarks/engine_concurrency.py --concurrency 2,4,8 --controllers bastion,plain,fixed:8``
(demo pair, CPU, one torch thread by default).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import bastion
from bastion.bench.datasets import load_dataset
from bastion.bench.paired import paired_ratios, ratio_table
from bastion.bench.templates import encode_prompt
from bastion.engine import Engine, GenerationConfig


#: ``upkeep``: the bastion controller with its gate held off (one probe per batch size, then none for
#: 4096 steps): an engine that keeps its drafter current on every step but drafts next to never, to
#: tell that upkeep apart from probing when bastion trails ``plain``
_HELD_OFF = {"margin": float("inf"), "min_backoff": 4096, "max_backoff": 4096, "ceiling": 4096, "start_probe": None}


def make_pipeline(spec: str) -> bastion.Pipeline:
    """``NAME``, ``fixed:N`` or ``upkeep`` -> the demo pipeline with that budget controller."""
    if spec == "upkeep":
        return bastion.Pipeline.demo(component_options={"budget_controller": {"gate": _HELD_OFF}})
    name, _, budget = spec.partition(":")
    options = {"budget_controller": {"budget": int(budget)}} if budget else {}
    return bastion.Pipeline.demo(budget_controller=name, component_options=options)


def run(pipe: bastion.Pipeline, prompts: list[torch.Tensor], concurrency: int, max_tokens: int) -> tuple[float, float, dict[int, int]]:
    """Decode every prompt with at most ``concurrency`` running -> (tokens/s, share drafted, width counts)."""
    engine = Engine(pipe, max_running=concurrency, prefill_chunk=256)
    config = GenerationConfig(max_new_tokens=max_tokens)
    queue = list(prompts)
    widths: collections.Counter[int] = collections.Counter()
    steps = drafted = tokens = 0
    start = time.perf_counter()
    while queue or not engine.idle:
        while queue and len(engine.running) + len(engine.waiting) < concurrency:
            engine.add(queue.pop(0), config)
        engine.step()
        step = engine.last_step
        if step is not None:
            steps += 1
            drafted += int(step.drafted)
            widths[step.width] += 1
            tokens += step.emitted
    return tokens / (time.perf_counter() - start), drafted / max(steps, 1), dict(sorted(widths.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="2,4,8", help="comma-separated running-request counts")
    parser.add_argument("--controllers", default="bastion,plain,fixed:8", help="NAME, fixed:N or upkeep (bastion never drafting), comma-separated")
    parser.add_argument("--datasets", default="gsm8k,mt_bench")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per data set")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="measured passes after the warm-up pass")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reference", default=None, help="the controller whose ratios over the others, paired within each pass, are reported (default: the first)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels) or args.repeats < 1 or args.max_tokens < 1:
        parser.error("--concurrency levels, --repeats and --max-tokens must be >= 1")
    records = [p for ds in args.datasets.split(",") for p in load_dataset(ds, limit=args.prompts, data_dir=args.data_dir)]
    print(f"{len(records)} prompts, {args.max_tokens} tokens each, demo pair, {args.threads} thread(s)")
    print("| concurrency | controller | pass | tok/s | drafted | widths |")
    print("|---|---|---|---|---|---|")
    specs = args.controllers.split(",")
    if args.reference is not None and args.reference not in specs:
        parser.error(f"--reference {args.reference!r} is not one of --controllers ({', '.join(specs)})")
    pipes = {spec: make_pipeline(spec) for spec in specs}
    first = pipes[specs[0]]
    prompts = [encode_prompt(r, first.tokenizer, first.target.vocab_size)[0] for r in records]  # each [L]
    passes: list[dict[tuple[str, int], float]] = [{} for _ in range(args.repeats)]
    for c in levels:
        for spec in specs:
            run(pipes[spec], prompts, c, args.max_tokens)  # warm-up: costs and acceptance learnt
        for k in range(args.repeats):
            shift = k % len(specs)  # the controllers take turns, who goes first rotating: the machine drifts
            for spec in specs[shift:] + specs[:shift]:
                rate, share, widths = run(pipes[spec], prompts, c, args.max_tokens)
                passes[k][(spec, c)] = rate
                print(f"| {c} | {spec} | {k + 1} | {rate:.1f} | {share:.0%} | {widths} |", flush=True)
    reference = args.reference or specs[0]
    against = [spec for spec in specs if spec != reference]
    if against:
        print(f"\n{reference} over each controller within the same pass (median over {args.repeats} pass(es), "
              "smallest-largest pass in brackets):\n")
        print(ratio_table(paired_ratios(passes, reference, against), reference, level_name="concurrency"))


if __name__ == "__main__":
    main()
