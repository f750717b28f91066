"""``bastion bench``: run ar, chain, static, a fixed-budget sweep and bastion side by side."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from bastion.cli.parsing import csv_list, float_list, int_list
from bastion.core.dtypes import CLI_DTYPES, parse_dtype


def _tree_option(text: str) -> tuple[str, str, Any]:
    """``BUILDER.KEY=VALUE`` with a JSON value (plain strings allowed)."""
    key, sep, raw = text.partition("=")
    builder, dot, opt = key.partition(".")
    if not sep or not dot or not builder or not opt:
        raise argparse.ArgumentTypeError(f"expected BUILDER.KEY=VALUE (e.g. static.branching=[4,2,1]), got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return builder, opt, value


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="benchmark ar, chain, static, fixed budgets and bastion side by side",
        description=(
            "Run every method on the same prompts with one loaded target and drafter, interleaved per "
            "prompt; print a markdown table and write results.json, CSV files and PNG plots to --out. "
            "Without --target/--drafter the embedded demo pair is used."
        ),
    )
    p.add_argument("--target", help="target model: local directory or hub id (default: the demo pair)")
    p.add_argument("--drafter", help="drafter: registered name, DFlash checkpoint dir or hub id (default: the demo pair)")
    p.add_argument("--datasets", type=csv_list, help="comma-separated NAME[=PATH|hf:ID] (default gsm8k,humaneval,mt_bench)")
    p.add_argument("--data-dir", help="directory holding gsm8k/, humaneval/, mt_bench/ (default $BASTION_DATA_DIR, ./data or ../shared/data)")
    p.add_argument("--limit", type=int, help="prompts per dataset (default 10; --quick 3)")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default 128; --quick 64)")
    p.add_argument("--methods", type=csv_list, help="comma-separated methods: ar, chain, static, NAME@N, bastion (default: all, sweep from --budgets)")
    p.add_argument("--budgets", type=int_list, help="fixed budgets of the best-first sweep (default 4,8,16,32,64; --quick 8,32)")
    p.add_argument("--max-nodes", type=int, help="the adaptive controller's largest tree (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy, with the equality check)")
    p.add_argument("--temperatures", type=float_list, metavar="T1,T2,...",
                   help="run every method at each of these temperatures, side by side (e.g. 0,0.7,1); overrides --temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold for every method (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling for every method (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampled runs (prompt i uses seed + i)")
    p.add_argument("--template", choices=("auto", "chat", "plain"), default="auto", help="prompt template style")
    p.add_argument("--repeats", type=int, help="runs per prompt and method, the fastest kept (default 3; --quick 1)")
    p.add_argument("--warmup-tokens", type=int, help="unrecorded warm-up generation per method (default 16; 0 disables)")
    p.add_argument("--tree-option", type=_tree_option, action="append", default=[], metavar="BUILDER.KEY=VALUE",
                   help="option for a tree builder, JSON value (repeatable), e.g. static.branching=[4,2,2,1]")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto; under torchrun a bare cuda is cuda:LOCAL_RANK")
    p.add_argument("--dtype", choices=CLI_DTYPES, default="float32")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--quick", action="store_true", help="a short run: 3 prompts per dataset, 64 tokens, budgets 8,32")
    p.add_argument("--out", default="bench-results", help="output directory (default ./bench-results)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run)
    return p


def build_config(args: argparse.Namespace) -> Any:
    """The :class:`BenchConfig` the parsed arguments describe (``--quick`` first, explicit flags win)."""
    from bastion.bench.methods import default_methods
    from bastion.bench.runner import QUICK, BenchConfig

    kw: dict[str, Any] = dict(QUICK) if args.quick else {}
    if args.budgets is not None:
        kw["methods"] = default_methods(args.budgets)
    if args.methods is not None:
        kw["methods"] = tuple(args.methods)
    for name in ("datasets", "limit", "max_new_tokens", "max_nodes", "warmup_tokens", "repeats", "data_dir"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = tuple(value) if name == "datasets" else value
    tree_options: dict[str, dict[str, Any]] = {}
    for builder, key, value in args.tree_option:
        tree_options.setdefault(builder, {})[key] = value
    return BenchConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, template=args.template, tree_options=tree_options, **kw)


def load_pair(target: str | None, drafter: str | None, device: str, dtype: str) -> tuple[Any, Any, Any]:
    """(target, drafter, tokenizer), loaded once and shared by every method."""
    from bastion.core.errors import InvalidInputError
    from bastion.core.pipeline import Pipeline

    if (target is None) != (drafter is None):
        raise InvalidInputError("give both --target and --drafter, or neither (the demo pair)")
    if target is None:
        from bastion.demo import demo_paths

        paths = demo_paths()
        target, drafter = str(paths.target), str(paths.drafter)
    pipe = Pipeline.from_pretrained(target, drafter, device=device, dtype=parse_dtype(dtype))
    return pipe.target, pipe.drafter, pipe.tokenizer


def run(args: argparse.Namespace) -> int:
    import torch

    from bastion.bench.reporting import markdown_report, write_report
    from bastion.bench.runner import run_bench
    from bastion.distributed import setup, teardown

    if args.threads:
        torch.set_num_threads(args.threads)
    config = build_config(args)
    ctx = setup(args.device)  # under torchrun: one share of the prompts per rank, pooled on rank 0
    try:
        target, drafter, tokenizer = load_pair(args.target, args.drafter, str(ctx.device), args.dtype)
        if args.temperatures:
            from bastion.bench.runner import run_bench_temperatures

            runs = run_bench_temperatures(
                config, args.temperatures, target, drafter, tokenizer, progress=not args.no_progress, ctx=ctx
            )
        else:
            result = run_bench(config, target, drafter, tokenizer, progress=not args.no_progress, ctx=ctx)
    finally:
        teardown(ctx)
    if args.temperatures:
        if runs is None:  # not rank 0
            return 0
        from bastion.bench.reporting import write_temperatures_report

        text, paths = write_temperatures_report(runs, args.out, plots=not args.no_plots)
        sys.stdout.write(text)
        print(f"\nwrote {len(paths)} files under {args.out}", file=sys.stderr)
        return 0
    if result is None:  # not rank 0
        return 0
    files = write_report(result, args.out, plots=not args.no_plots)
    sys.stdout.write(markdown_report(result))
    print(f"\nwrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0
