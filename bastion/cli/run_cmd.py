"""``bastion run``: decode every prompt of a JSON Lines file; resumable; data parallel under torchrun.

    bastion run --input prompts.jsonl --output outputs.jsonl
    torchrun --nproc-per-node 4 -m bastion run --input prompts.jsonl --output outputs.jsonl
"""

from __future__ import annotations

import argparse
import sys

from bastion.cli.options import add_model_options, build_pipeline


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run",
        help="decode a whole prompt file (JSON Lines), resumable, data parallel under torchrun",
        description=(
            'Decode every row of --input ({"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, '
            "optional per-row max_new_tokens) and append one output row per input row to --output. A rerun "
            "with the same --output skips the ids already done. Launch with `torchrun --nproc-per-node N -m "
            "bastion run ...` to split the rows over N processes (one device each); rank 0 merges the output "
            "in input order. Without --target/--drafter the embedded demo pair is used."
        ),
    )
    p.add_argument("--input", required=True, help="prompt file (JSON Lines), or - for stdin")
    p.add_argument("--output", required=True, help="output file (JSON Lines, appended and resumed), or - for stdout")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="for rows without their own max_new_tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="stop: report every bad input line and decode nothing (default); skip: write error rows and go on",
    )
    p.add_argument("--raw", action="store_true", help="feed 'prompt' texts as they are (no chat template)")
    p.add_argument("--threads", type=int, help="torch CPU threads per process (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_model_options(p, device_default="auto")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from bastion.core.errors import InvalidRowsError
    from bastion.distributed import setup, teardown
    from bastion.run.runner import RunConfig, run_prompts

    from bastion.cli.options import configure_output

    configure_output(args.verbose)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = RunConfig(
        input=args.input,
        output=args.output,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        top_p=args.top_p,
        top_k=args.top_k,
        on_error=args.on_error,
        raw=args.raw,
        progress=not args.no_progress,
    )
    ctx = setup(args.device if not args.device_map else "cpu")
    try:
        pipe = build_pipeline(args, device=ctx.device)
        try:
            summary = run_prompts(config, pipe, ctx)
        except InvalidRowsError as exc:
            if not ctx.is_main:  # every rank finds the same lines; rank 0 reports them
                return 2
            print(f"bastion: error: {exc}", file=sys.stderr)
            return 2
        if summary is not None:
            print(summary.describe(), file=sys.stderr)
    finally:
        teardown(ctx)
    return 0
