"""``bastion generate``: decode one prompt with a BASTION pipeline (default: the embedded demo pair).

The text streams to stdout as decode steps commit; one summary line goes to stderr: new tokens, mean
acceptance length (tokens committed per target forward), tokens/s and, with ``--compare-ar``, the
speedup over a plain autoregressive run of the same target on the same prompt. ``--json`` prints one
JSON object (text, tokens and statistics) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bastion.cli.options import add_model_options, build_pipeline, configure_output, generation_settings, set_threads


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "generate",
        help="generate text for one prompt (default: the embedded demo pair)",
        description=(
            "Decode one prompt with BASTION, streaming the text to stdout and the statistics to stderr. "
            "Without --target/--drafter the embedded demo pair is used."
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append",
                     help="the prompt text ('-' reads it from stdin); repeat it to decode several prompts as one batch")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (temperature > 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop where TEXT first appears (repeatable; the text ends before it)")
    tmpl = p.add_mutually_exclusive_group()
    tmpl.add_argument("--chat", dest="template", action="store_const", const="chat",
                      help="wrap the prompt in the tokenizer's chat template (default when it has one)")
    tmpl.add_argument("--raw", dest="template", action="store_const", const="raw",
                      help="feed the prompt as it is (no chat template)")
    p.set_defaults(template="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, statistics) instead of streaming")
    p.add_argument("--compare-ar", action="store_true", help="also decode autoregressively and report the speedup")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice; 1 is often fastest on a busy machine)")
    add_model_options(p)
    p.set_defaults(func=run)
    return p


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from --prompt (``-``: stdin) or --prompt-file (``-``: stdin)."""
    if args.prompt is not None:
        return _checked_text(sys.stdin.read() if args.prompt == "-" else args.prompt, "the prompt")
    if args.prompt_file == "-":
        return _checked_text(sys.stdin.read(), "the prompt from stdin")
    from bastion.utils.files import read_text_file

    return _checked_text(read_text_file(args.prompt_file, "--prompt-file"), f"--prompt-file {args.prompt_file}")


def read_prompts(prompts: list[str]) -> list[str]:
    """Several --prompt values: each checked non-empty; ``-`` reads stdin (at most once)."""
    from bastion.contract.errors import InvalidInputError

    if prompts.count("-") > 1:
        raise InvalidInputError("--prompt - reads stdin, which can be given only once")
    return [_checked_text(sys.stdin.read() if p == "-" else p, f"--prompt {i + 1}") for i, p in enumerate(prompts)]


def _checked_text(text: str, what: str) -> str:
    from bastion.contract.errors import InvalidInputError

    if not text.strip():
        raise InvalidInputError(f"{what} is empty")
    return text


def encode_prompt(pipe: Any, prompt: str, template: str) -> Any:
    """Token ids [1, L] of ``prompt``: through the chat template (``chat``, or ``auto`` when the tokenizer
    has one) or as it is (``raw``)."""
    import torch

    from bastion.contract.errors import InvalidInputError
    from bastion.utils.chat import has_chat_template
    from bastion.run.encode import prompt_ids

    if template == "chat" and pipe.tokenizer is not None and not has_chat_template(pipe.tokenizer):
        raise InvalidInputError("--chat: the tokenizer has no chat template; use --raw")
    return torch.tensor([prompt_ids(pipe.tokenizer, prompt, raw=template == "raw")], dtype=torch.long)


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
        same = result.tokens == ar_result.tokens[: len(result.tokens)]
        parts.append("output=identical to AR" if same else "output=differs from AR")
    return "  ".join(parts)


def result_json(result: Any, ar_result: Any = None) -> dict[str, Any]:
    """The machine-readable form of a generation (``--json``)."""
    out: dict[str, Any] = {
        "text": result.text,
        "tokens": list(result.tokens),
        "stop_reason": result.stop_reason,
        "prompt_tokens": result.prompt_len,
        "new_tokens": len(result.tokens),
        "steps": len(result.steps),
        "acceptance_length": result.acceptance_length,
        "mean_budget": result.mean_budget,
        "tokens_per_second": result.tokens_per_second,
        "wall_s": result.wall_s,
        "prefill_s": result.prefill_s,
    }
    if ar_result is not None:
        out["ar_tokens_per_second"] = ar_result.tokens_per_second
        out["speedup"] = result.tokens_per_second / ar_result.tokens_per_second if ar_result.tokens_per_second > 0 else None
        out["identical_to_ar"] = result.tokens == ar_result.tokens[: len(result.tokens)]
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    configure_output(args.verbose)
    set_threads(args.threads)
    config = generation_settings(args)  # every setting checked before any model loads
    if args.prompt and len(args.prompt) > 1:  # several prompts: one batch
        return _run_batch(args, config)
    args.prompt = args.prompt[0] if args.prompt else None
    prompt = read_prompt(args)  # before any model loads
    pipe = build_pipeline(args)
    ids = encode_prompt(pipe, prompt, args.template)
    with torch.inference_mode():
        if args.json:
            result = pipe.generate(ids, config=config)
        else:
            stream = pipe.stream(ids, config=config)
            for chunk in stream:
                sys.stdout.write(chunk)
                sys.stdout.flush()
            sys.stdout.write("\n")
            result = stream.result
        ar = None
        if args.compare_ar:
            from bastion.bench.methods import ARDecoder

            sp = config.sampling
            ar = ARDecoder(pipe.target).generate(ids, max_new_tokens=max(1, len(result.tokens)), temperature=sp.temperature, seed=sp.seed)
    if args.json:
        print(json.dumps(result_json(result, ar), indent=2))
    else:
        print(summary_line(result, ar), file=sys.stderr)
    warn_if_cut_short(result, pipe.target.max_positions)
    return 0


def _run_batch(args: argparse.Namespace, config: Any) -> int:
    """Several ``--prompt``s: one ``generate_batch`` call. Text mode prints each row's text under a
    header on stdout and the statistics on stderr; ``--json`` prints one JSON list, one object per row."""
    import time

    import torch

    texts = read_prompts(args.prompt)  # before any model loads
    pipe = build_pipeline(args)
    rows = [encode_prompt(pipe, p, args.template)[0] for p in texts]
    sp = config.sampling
    kw = dict(max_new_tokens=config.max_new_tokens, temperature=sp.temperature, seed=sp.seed, top_p=sp.top_p, top_k=sp.top_k)
    with torch.inference_mode():
        start = time.perf_counter()
        results = pipe.generate_batch(rows, config=config)
        wall = time.perf_counter() - start
        ars: list[Any] = [None] * len(rows)
        if args.compare_ar:
            from bastion.bench.methods import ARDecoder

            start = time.perf_counter()
            ars = ARDecoder(pipe.target).generate_batch(rows, **kw)
            ar_wall = time.perf_counter() - start
    if args.json:
        print(json.dumps([result_json(r, ar) for r, ar in zip(results, ars)], indent=2))
    else:
        for i, result in enumerate(results):
            print(f"--- prompt {i + 1} ---")
            print(result.text if result.text is not None else pipe.decode(result.tokens))
            print(f"prompt {i + 1}: {summary_line(result, ars[i])}", file=sys.stderr)
    total = sum(len(r.tokens) for r in results)
    line = f"batch={len(rows)}  tokens={total}  tok/s={total / wall:.1f}"
    if args.compare_ar:
        line += f"  ar_tok/s={total / ar_wall:.1f}  speedup={ar_wall / wall:.2f}x"
    print(line, file=sys.stderr)
    for result in results:
        warn_if_cut_short(result, pipe.target.max_positions)
    return 0


def warn_if_cut_short(result: Any, max_positions: int) -> None:
    """One warning line on stderr when the target's position limit ended the output early."""
    if result.stop_reason == "position-limit":
        print(
            f"bastion: warning: output stopped after {len(result.tokens)} tokens: prompt ({result.prompt_len}) + "
            f"output reached the target's position limit ({max_positions})",
            file=sys.stderr,
        )
