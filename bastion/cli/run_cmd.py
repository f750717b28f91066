"""``bastion run``: decode every prompt of a JSON Lines file; resumable; data parallel under torchrun.

    bastion run --input prompts.jsonl --output outputs.jsonl
    torchrun --nproc-per-node 4 -m bastion run --input prompts.jsonl --output outputs.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bastion.cli.options import add_model_options, build_pipeline, set_threads


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run",
        help="decode a whole prompt file (JSON Lines), resumable, data parallel under torchrun",
        description=(
            'Decode every row of --input ({"prompt": "..."} or {"messages": [...]}, with an optional "id" '
            "(default: the line number) and per-row max_new_tokens, temperature, top_p, top_k, seed and stop; "
            "or OpenAI batch requests with custom_id and body) and append one output row per input row to "
            "--output. A rerun with the same --output skips the rows already done; an existing output that "
            "bastion run did not write for this input is refused unless --overwrite. Launch with `torchrun "
            "--nproc-per-node N -m bastion run ...` to split the rows over N processes (one device each); "
            "rank 0 merges the output in input order. Without --target/--drafter the embedded demo pair is used."
        ),
    )
    p.add_argument("--input", required=True, help="prompt file (JSON Lines), or - for stdin")
    p.add_argument("--output", required=True, help="output file (JSON Lines, appended and resumed), or - for stdout")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="for rows without their own max_new_tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed in [0, 2**64): row seeds are --seed plus the input line")
    p.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="stop: report every bad input line and decode nothing (default); skip: write error rows and go on",
    )
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --output (its rows, part files and manifest) instead of resuming it")
    p.add_argument("--raw", action="store_true", help="feed 'prompt' texts as they are (no chat template)")
    p.add_argument("--threads", type=int, help="torch CPU threads per process (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_model_options(p, device_default="auto")
    p.set_defaults(func=run)
    return p


def _model_name(target: str | None) -> str:
    """How the output's manifest names the target: a local folder by its absolute path, else as given."""
    if target is None:
        return "demo"
    return str(Path(target).resolve()) if Path(target).is_dir() else target


def run(args: argparse.Namespace) -> int:
    from bastion.contract.errors import BastionError
    from bastion.distributed import setup, teardown
    from bastion.run.job import RunConfig, run_file

    from bastion.cli.options import configure_output

    configure_output(args.verbose)
    set_threads(args.threads)
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
        overwrite=args.overwrite,
        model={"target": _model_name(args.target), "dtype": args.dtype},
    )
    ctx = setup(args.device if not args.device_map else "cpu")
    try:
        try:
            summary = run_file(config, lambda: build_pipeline(args, device=ctx.device), ctx)
        except BastionError:
            if not ctx.is_main:  # every rank stops; rank 0 reports why
                teardown(ctx)  # here an error is in flight: leave without the closing barrier, as rank 0 does
                return 2
            raise
        if summary is not None:
            print(summary.describe(), file=sys.stderr)
    finally:
        teardown(ctx)
    return 0
