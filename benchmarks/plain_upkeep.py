"""What a plain step costs when a drafter is kept current: the demo pair's per-token time for ``ar``
(the target alone, the bench's baseline), the engine with the ``plain`` controller (no drafter
state), and bastion with its gate held off (``upkeep``: every step plain, the drafter fed the target
features of every committed position), with the features read through kept hooks (the default) or
through Hugging Face's ``output_hidden_states`` (``upkeep-hidden-states``, the older path).

Per method the fastest of ``--repeats`` decodes of ``--new-tokens`` tokens, the methods interleaved in
each round so a neighbour's load hits them alike; the figures to read are the ratios to ``ar``.

    python benchmarks/plain_upkeep.py --rounds 3 --new-tokens 200
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from bastion.bench.methods import ARDecoder
from engine_concurrency import make_pipeline  # the demo pipelines: "upkeep" (bastion, gate held off), "plain"


def fastest(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="decodes per method and round (the fastest counts)")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", default="Write a story about a dragon who learns to fly.")
    args = parser.parse_args()
    if min(args.rounds, args.repeats, args.new_tokens) < 1:
        parser.error("--rounds, --repeats and --new-tokens must be >= 1")
    torch.set_num_threads(args.threads)
    upkeep, old, plain = make_pipeline("upkeep"), make_pipeline("upkeep"), make_pipeline("plain")
    old.target._final_norm = None  # the last layer's features from HF's output_hidden_states
    ids = torch.tensor([upkeep.tokenizer(args.prompt)["input_ids"]])
    ar = ARDecoder(upkeep.target)
    n = args.new_tokens
    methods: dict[str, Callable[[], object]] = {
        "ar": lambda: ar.generate(ids, n, stop_on_eos=False),
        "plain": lambda: plain.generate(ids, max_new_tokens=n, stop_on_eos=False),
        "upkeep": lambda: upkeep.generate(ids, max_new_tokens=n, stop_on_eos=False),
        "upkeep-hidden-states": lambda: old.generate(ids, max_new_tokens=n, stop_on_eos=False),
    }
    for fn in methods.values():  # warm-up
        fn()
    print("| round | " + " | ".join(f"{m} ms/token" for m in methods) + " | " + " | ".join(f"{m} / ar" for m in list(methods)[1:]) + " |")
    print("|---" * (2 * len(methods)) + "|")
    for r in range(args.rounds):
        ms = {m: fastest(fn, args.repeats) / n * 1e3 for m, fn in methods.items()}
        ratios = [ms["ar"] / ms[m] for m in list(methods)[1:]]
        print(f"| {r + 1} | " + " | ".join(f"{v:.3f}" for v in ms.values()) + " | " + " | ".join(f"{x:.3f}x" for x in ratios) + " |")


if __name__ == "__main__":
    main()
