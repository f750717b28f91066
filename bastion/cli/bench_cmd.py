"""``bastion bench``: run ar, chain, static, a fixed-budget sweep and bastion side by side."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bastion.cli.options import add_component_arguments, add_model_arguments, add_verbose_argument, component_choices
from bastion.cli.parsing import csv_list, float_list, int_list


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
    p.add_argument("--drafters", type=csv_list, metavar="FAMILY[=PATH],...",
                   help="several drafters in one run, e.g. dflash,model (the demo pair's block and autoregressive "
                   "drafters) or dflash=DIR,model=DIR2 with --target: every method runs once per drafter (METHOD:FAMILY)")
    p.add_argument("--datasets", type=csv_list,
                   help="comma-separated NAME[=PATH|hf:ID]: gsm8k, humaneval, mt_bench, spec_bench (default gsm8k,humaneval,mt_bench)")
    p.add_argument("--data-dir", help="directory holding gsm8k/, humaneval/, mt_bench/, spec_bench/ (default $BASTION_DATA_DIR, "
                   "./data or ../shared/data, else the copies bundled in the package)")
    p.add_argument("--limit", type=int, help="prompts per dataset, per category for spec_bench (default 10; --quick 3)")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default 128; --quick 64)")
    p.add_argument("--methods", type=csv_list,
                   help="comma-separated methods: ar, bastion, BUILDER (every node), BUILDER@N (fixed budget) or "
                        "BUILDER@CONTROLLER (any registered pair) (default: ar,chain,static, the --budgets sweep, bastion)")
    p.add_argument("--budgets", type=int_list, help="fixed budgets of the best-first sweep (default 4,8,16,32,64; --quick 8,32)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy, with the equality check)")
    p.add_argument("--temperatures", type=float_list, metavar="T1,T2,...",
                   help="run every method at each of these temperatures, side by side (e.g. 0,0.7,1); overrides --temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold for every method (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling for every method (default 0: off)")
    p.add_argument("--seed", type=int, default=0, help="base seed of sampled runs (prompt i uses seed + i)")
    p.add_argument("--template", choices=("auto", "chat", "plain"), default="auto", help="prompt template style")
    p.add_argument("--repeats", type=int, help="runs per prompt and method, the fastest kept (default 3; --quick 1)")
    p.add_argument("--warmup-tokens", type=int, help="unrecorded warm-up generation per method (default 16; 0 disables)")
    p.add_argument("--batch-sizes", type=int_list, metavar="B1,B2,...",
                   help="batched mode: run every method at each batch size (e.g. 1,2,4,8,16,32) with generate_batch; "
                        "writes batch_sizes.md/json and throughput/width plots")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--scenario", metavar="PHASE,PHASE,...",
                   help="phases whose prompt domain changes mid-run: the Spec-Bench prompts of each category in turn "
                        "(--limit per phase; code, chat, math or any category, e.g. code,chat,math,translation), every "
                        "method's state kept across phases; reports each phase's oracle (its best fixed method)")
    p.add_argument("--contention", default="none", metavar="KIND:WORKERS[@ON/OFF]",
                   help="run a competing load beside the bench, started and stopped by it: torch:2@1.5/1 (matrix products "
                        "on 2 threads, 1.5 s on, 1 s off), busy:1 (one spinning core), none (default)")
    p.add_argument("--contention-sync", choices=("run", "none"), default="run",
                   help="an on/off load's phase: run (default) restarts it at the same point for every method's run "
                        "of a prompt, spread over the period across prompts, so bursts hit every method alike; "
                        "none lets it run free")
    p.add_argument("--quick", action="store_true", help="a short run: 3 prompts per dataset, 64 tokens, budgets 8,32")
    p.add_argument("--out", default="bench-results", help="output directory (default ./bench-results)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_model_arguments(p)
    add_component_arguments(p)
    add_verbose_argument(p)
    p.set_defaults(func=run)
    return p


def check_bench_settings(args: argparse.Namespace) -> None:
    """The bench's sampling settings (``--temperature`` or each of ``--temperatures``, ``--top-p``,
    ``--top-k``, ``--seed``, ``--max-new-tokens``) by the rule every path applies
    (:func:`bastion.cli.options.generation_settings`), and its counts (``--limit``, ``--repeats`` >= 1,
    ``--warmup-tokens`` >= 0); a bad value raises :class:`InvalidInputError` naming the option."""
    from bastion.cli.options import generation_settings
    from bastion.utils.checks import check_int
    from bastion.contract.errors import InvalidInputError

    generation_settings(args, names=("max_new_tokens", "temperature", "top_p", "top_k", "seed"))
    for t in args.temperatures or ():
        try:
            generation_settings(argparse.Namespace(temperature=t), names=("temperature",))
        except InvalidInputError as exc:
            raise InvalidInputError(f"--temperatures: {exc}") from None
    for flag, name, low in (("--limit", "limit", 1), ("--repeats", "repeats", 1), ("--warmup-tokens", "warmup_tokens", 0)):
        value = getattr(args, name, None)
        if value is not None:
            check_int(flag, value, low=low)


def build_config(args: argparse.Namespace) -> Any:
    """The :class:`BenchConfig` the parsed arguments describe (``--quick`` first, explicit flags win)."""
    from bastion.bench.methods import default_methods
    from bastion.bench.runner import QUICK, BenchConfig

    kw: dict[str, Any] = dict(QUICK) if args.quick else {}
    if args.budgets is not None:
        kw["methods"] = default_methods(args.budgets)
    if args.methods is not None:
        kw["methods"] = tuple(args.methods)
    for name in ("datasets", "limit", "max_new_tokens", "warmup_tokens", "repeats", "data_dir"):
        value = getattr(args, name)
        if value is not None:
            kw[name] = tuple(value) if name == "datasets" else value
    choices = component_choices(args)
    if args.tree_builder is not None or args.budget_controller is not None or args.budget is not None:
        # an explicitly chosen builder / controller joins the comparison as BUILDER@CONTROLLER
        pair = f"{choices['tree_builder'].name}@{choices['budget_controller'].name}"
        methods = tuple(kw.get("methods", default_methods()))
        kw["methods"] = methods if pair in methods else (*methods, pair)
    return BenchConfig(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, template=args.template,
        max_nodes=args.max_nodes, tree_options=choices["tree_builder"].options,
        controller_options=choices["budget_controller"].options,
        latency_model=choices["latency_model"].name, verifier=choices["verifier"].name,
        component_options={k: choices[k].options_for() for k in ("latency_model", "verifier") if choices[k].options_for()},
        **kw,
    )


def load_pair(args: argparse.Namespace, device: Any = None) -> tuple[Any, Any, Any]:
    """(target, drafter, tokenizer), loaded once and shared by every method."""
    from bastion.cli.options import build_pipeline
    from bastion.contract.errors import InvalidInputError

    if args.target is not None and args.drafter is None:
        raise InvalidInputError("give both --target and --drafter, or neither (the demo pair)")
    pipe = build_pipeline(args, device=device, components=False)
    return pipe.target, pipe.drafter, pipe.tokenizer


def load_drafters(target: str | None, entries: list[str], device: str, dtype: str) -> tuple[Any, dict[str, Any], Any]:
    """(target, {family: drafter}, tokenizer) for ``--drafters``: ``FAMILY`` alone names a demo drafter
    (without --target), ``FAMILY=PATH`` any checkpoint the registry's drafters claim."""
    import torch

    from bastion.cli.options import torch_dtype
    from bastion.contract.errors import InvalidInputError
    from bastion.engine.pipeline import Pipeline
    from bastion.demo import demo_drafter, demo_drafter_options, demo_paths

    specs: dict[str, str] = {}
    for entry in entries:
        family, sep, path = entry.partition("=")
        if not sep:
            if target is not None:
                raise InvalidInputError(f"--drafters {entry!r}: with --target give FAMILY=PATH")
            path = str(demo_drafter(family))
        if family in specs:
            raise InvalidInputError(f"--drafters names {family!r} twice")
        specs[family] = path
    loaded: Any = target if target is not None else str(demo_paths().target)
    dt = torch_dtype(dtype)
    if dt == "auto" and target is None and str(device).startswith("cpu"):
        dt = torch.float32  # the demo models ship in float16 and run in float32 on the CPU
    drafters: dict[str, Any] = {}
    tokenizer = None
    for family, path in specs.items():
        # the demo pair's defaults (a bfloat16 DFlash drafter beside the float32 target on such CPUs)
        opts = {"drafter": demo_drafter_options(family, device)} if target is None and dt == torch.float32 else None
        pipe = Pipeline.from_pretrained(loaded, path, device=device, dtype=dt, tokenizer=tokenizer, component_options=opts)
        loaded, tokenizer = pipe.target, pipe.tokenizer
        drafters[family] = pipe.drafter
    return loaded, drafters, tokenizer


def run(args: argparse.Namespace) -> int:
    from bastion.bench.reporting import markdown_report, write_report
    from bastion.bench.runner import load_prompts, run_bench
    from bastion.cli.options import configure_output, set_threads
    from bastion.distributed import setup, teardown

    configure_output(args.verbose)
    set_threads(args.threads)
    check_bench_settings(args)  # every number checked before the data or any model loads
    from bastion.bench.contention import Contention, parse_contention

    if not args.no_plots:  # a missing plotting library fails before any model loads, not after the bench
        import importlib.util

        from bastion.contract.errors import InvalidInputError

        try:
            found = importlib.util.find_spec("matplotlib") is not None
        except ValueError:  # present in sys.modules as None: imports of it fail
            found = False
        if not found:
            raise InvalidInputError(
                "the bench's PNG plots need matplotlib, which is not installed: pip install 'bastion[plot]' "
                "(or pass --no-plots)"
            )
    contention = Contention(parse_contention(args.contention), sync=args.contention_sync == "run")  # a bad spec fails before any model loads
    config = build_config(args)
    if args.scenario:
        from bastion.bench.scenario import parse_scenario, scenario_prompts

        prompts = scenario_prompts(parse_scenario(args.scenario), config.limit, config.data_dir)
    else:
        prompts = load_prompts(config)  # a missing data file fails before any model loads
    if config.repeats == 1:
        print("note: one round per prompt (--quick or --repeats 1): timings are noisy; use --repeats 3 or more "
              "for figures you report", file=sys.stderr)
    if args.batch_sizes:  # one process, one device: every method at every batch size
        target, drafter, tokenizer = load_pair(args)
        with contention:
            return _run_batch_sizes(args, config, target, drafter, tokenizer)
    ctx = setup(args.device)  # under torchrun: one share of the prompts per rank, pooled on rank 0
    try:
        if args.drafters:
            import attrs

            from bastion import registry
            from bastion.bench.families import family_methods

            if args.drafter is not None:
                from bastion.contract.errors import InvalidInputError

                raise InvalidInputError("give --drafter or --drafters, not both")
            target, drafter, tokenizer = load_drafters(args.target, args.drafters, str(ctx.device), args.dtype)
            accepts = {n: registry.create("tree_builder", n).accepts for n in registry.names("tree_builder")}
            config = attrs.evolve(config, methods=family_methods(config.methods, drafter, accepts))
        else:
            target, drafter, tokenizer = load_pair(args, device=ctx.device)
        contention.start()
        if args.temperatures:
            from bastion.bench.runner import run_bench_temperatures

            runs = run_bench_temperatures(
                config, args.temperatures, target, drafter, tokenizer, progress=not args.no_progress, ctx=ctx, prompts=prompts,
                before_run=contention.align,
            )
        else:
            result = run_bench(config, target, drafter, tokenizer, progress=not args.no_progress, ctx=ctx, prompts=prompts,
                               before_run=contention.align)
    finally:
        contention.stop()
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
    if args.scenario:
        from pathlib import Path

        from bastion.bench.scenario import phase_table

        table = phase_table(result.stats)
        path = Path(args.out) / "scenario.md"
        path.write_text(table, encoding="utf-8")
        sys.stdout.write("\n" + table)
        files = [*files, path]
    print(f"\nwrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0


def _run_batch_sizes(args: argparse.Namespace, config: Any, target: Any, drafter: Any, tokenizer: Any) -> int:
    from bastion.bench.batch_sizes import batch_table, best_table, run_batch_sweep, write_batch_report

    sweep = run_batch_sweep(config, args.batch_sizes, target, drafter, tokenizer, progress=not args.no_progress)
    files = write_batch_report(sweep, args.out, plots=not args.no_plots)
    sys.stdout.write(batch_table(sweep) + "\n\n" + best_table(sweep) + "\n")
    print(f"\nwrote {', '.join(str(f) for f in files)}", file=sys.stderr)
    return 0
