"""Autoregressive baseline: the bench's ``ar`` (through the Target interface, one single-node
``forward_tree`` + ``commit`` per token) against the Hugging Face model stepped directly with a
``DynamicCache``, on the embedded demo pair, greedy, 64 new tokens, one CPU thread. Both paths must
emit the same tokens; prints the median wall time per prompt of each and their same-run ratio.

    python benchmarks/ar_paths.py [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import bastion
from bastion.bench.methods import ARDecoder

PROMPTS = (
    "What is 17 times 23?",
    "Write a function that reverses a list.",
    "Name three colours.",
    "A train travels 60 km in 45 minutes. What is its speed?",
)


def hf_direct(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[list[int], float]:
    """Greedy decoding calling the HF model with its cache, timed from prefill to the last token."""
    from transformers import DynamicCache

    from bastion.huggingface.compat import cache_kwargs

    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, **cache_kwargs(model, cache), logits_to_keep=1).logits[0, -1]  # [V]
        out = [int(logits.argmax())]
        while len(out) < new_tokens:
            step = torch.tensor([[out[-1]]], device=ids.device)  # [1, 1]
            out.append(int(model(input_ids=step, **cache_kwargs(model, cache)).logits[0, -1].argmax()))
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipe = bastion.Pipeline.demo()
    ar = ARDecoder(pipe.target)
    times: dict[str, list[float]] = {"hf-direct": [], "target": []}
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            ids = pipe.encode(prompt)
            tokens, seconds = hf_direct(pipe.target.model, ids, args.tokens)
            res = ar.generate(ids, max_new_tokens=args.tokens, stop_on_eos=False)
            assert res.tokens == tokens, "the two AR paths disagree"
            times["hf-direct"].append(seconds)
            times["target"].append(res.wall_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    print({k: f"{v * 1e3:.1f} ms" for k, v in med.items()}, f"per {args.tokens} tokens (median)")
    print(f"target / hf-direct time: {med['target'] / med['hf-direct']:.3f}")


if __name__ == "__main__":
    main()
