"""``bastion generate``: decode one prompt with a BASTION pipeline (default: the embedded demo pair).

Prints the generated text, then one summary line: new tokens, mean acceptance length (tokens committed
per target forward), tokens/s and, with ``--compare-ar``, the speedup over a plain autoregressive run
of the same target on the same prompt.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bastion.cli.options import add_model_options, build_pipeline


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt (default: the embedded demo pair)",
        description="Decode one prompt with BASTION. Without --target/--drafter the embedded demo pair is used.",
    )
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="feed the prompt as it is (no chat template)")
    p.add_argument("--compare-ar", action="store_true", help="also decode autoregressively and report the speedup")
    add_model_options(p)
    p.set_defaults(func=run)
    return p


def _encode(tokenizer: Any, prompt: str, raw: bool) -> list[int]:
    from bastion.run.encode import prompt_ids

    return prompt_ids(tokenizer, prompt, raw=raw)


def summary_line(result: Any, ar_result: Any = None) -> str:
    parts = [
        f"tokens={len(result.tokens)}",
        f"acceptance={result.acceptance_length:.2f}",
        f"tok/s={result.tokens_per_second:.1f}",
    ]
    if ar_result is not None:
        ar_tps = ar_result.tokens_per_second
        parts.append(f"ar_tok/s={ar_tps:.1f}")
        parts.append(f"speedup={result.tokens_per_second / ar_tps:.2f}x" if ar_tps > 0 else "speedup=n/a")
        if result.tokens == ar_result.tokens:
            parts.append("output=identical to AR")
        else:
            parts.append("output=differs from AR")
    return "  ".join(parts)


def run(args: argparse.Namespace) -> int:
    import torch

    pipe = build_pipeline(args)
    ids = torch.tensor([_encode(pipe.tokenizer, args.prompt, args.raw)], dtype=torch.long)
    with torch.inference_mode():
        result = pipe.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        ar = None
        if args.compare_ar:
            from bastion.bench.methods import ARDecoder

            ar = ARDecoder(pipe.target).generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    print(pipe.tokenizer.decode(result.tokens, skip_special_tokens=True))
    print(summary_line(result, ar), file=sys.stdout)
    return 0
