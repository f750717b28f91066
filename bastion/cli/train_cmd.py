"""``bastion train``: the drafter-training recipe (and the demo pair it was made with).

Stages: ``tokenizer`` -> ``target`` (the demo target) -> ``distill`` (the target's greedy continuations
of training prompts: the bundled sets or the user's own JSONL) -> ``features`` (optional: precomputed
target features) -> ``drafter`` (DFlash format) -> ``export`` (half-precision copies); ``all`` runs the
demo recipe in order under one folder. Each stage writes its own output and can be re-run; the target,
distill, features and drafter stages resume from their last checkpoint. ``--smoke`` shrinks every
default size so the whole recipe runs in seconds (the tests use it); explicit options still win.

``distill``, ``features`` and ``drafter`` work for any Hugging Face target (local directory or hub id, in
its own dtype) on any device, and run data parallel under ``torchrun`` (see :mod:`bastion.distributed`).

Stages are a table (:data:`STAGES`); other modules add stages through :data:`STAGE_MODULES`, each
exposing ``add_stage(stages)`` that registers its sub-parser on the ``bastion train`` sub-parsers.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any, Callable

from attrs import frozen

from bastion.cli.parsing import csv_list, parse_int_list
from bastion.utils.dtypes import CLI_DTYPES, parse_dtype

SMOKE_LIMIT = 12  # documents per source in --smoke runs

#: held-out prompts per dataset of the full bench evaluation (--full-eval; runs of 1000 steps or more)
FULL_EVAL_LIMIT = 10
#: training steps per held-out prompt (per dataset) of the evaluation sized to the run
STEPS_PER_EVAL_PROMPT = 100

#: modules adding further ``bastion train`` stages (each exposes ``add_stage(stages_subparsers)``)
STAGE_MODULES: tuple[str, ...] = ("bastion.cli.train_ar_cmd", "bastion.cli.train_eagle3_cmd")


@frozen
class Stage:
    """One ``bastion train`` sub-command: its name, help, option groups and runner."""

    name: str
    help: str
    options: tuple[Callable[[argparse.ArgumentParser], None], ...]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------- options
#: defaults of the sized options: (normal, --smoke)
SIZES: dict[str, tuple[Any, Any]] = {
    # distill
    "per_source": (1500, 3),
    "max_new_tokens": (192, 16),
    "max_prompt_tokens": (256, 48),
    "gen_batch": (32, 3),
    # drafter
    "draft_layers": (2, 1),
    "block_size": (16, 4),
    "draft_steps": (2400, 3),
    "anchors": (32, 4),
    "seqs_per_step": (4, 2),
    "warmup_steps": (50, 1),
    "draft_save_every": (50, 2),
    "heldout_seqs": (96, 2),
    "eval_limit": (None, 1),  # None: sized to the run (see eval_limit)
    "eval_max_new_tokens": (64, 8),
    "eval_budgets": ("16,64", "4"),
}


def size(args: argparse.Namespace, name: str) -> Any:
    """The value of a sized option: as given, else its --smoke or normal default."""
    value = getattr(args, name, None)
    if value is not None:
        return value
    normal, smoke = SIZES[name]
    return smoke if getattr(args, "smoke", False) else normal


def _sized(p: argparse.ArgumentParser, flag: str, kind: type, help: str) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    normal, smoke = SIZES[dest]
    p.add_argument(flag, type=kind, default=None, help=f"{help} (default {normal}; --smoke {smoke})")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=None,
                   help="data folder (default: $BASTION_DATA_DIR, ./data or ../shared/data, else the bundled copies: "
                        "the benchmark sets and, for --smoke, a slice of the training sets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and a corpus slice: the recipe end to end in seconds")


def _device_opts(p: argparse.ArgumentParser) -> None:
    from bastion.training.frozen import DTYPES

    p.add_argument("--target", required=True, help="target model: local directory or hub id")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default; under torchrun cuda means cuda:LOCAL_RANK)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="target dtype (default: the checkpoint's own)")


def _target_opts(g: argparse.ArgumentParser) -> None:
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--intermediate", type=int, default=768)
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--steps", type=int, default=1500)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps (default 50; --smoke 2)")


def _distill_opts(d: argparse.ArgumentParser) -> None:
    d.add_argument("--prompts", type=Path, action="append", default=[], metavar="JSONL",
                   help="your own prompts: JSONL rows with 'prompt' or chat 'messages' (repeatable); "
                        "replaces the bundled training sets unless --with-bundled")
    d.add_argument("--with-bundled", action="store_true", help="add the bundled training sets to --prompts")
    d.add_argument("--max-prompts", type=int, default=None, help="use the first N rows of each --prompts file")
    _sized(d, "--per-source", int, "bundled prompts per source (code, math, chat)")
    _sized(d, "--max-new-tokens", int, "greedy tokens per prompt")
    _sized(d, "--max-prompt-tokens", int, "prompt tokens kept (the last ones)")
    _sized(d, "--gen-batch", int, "prompts per batched generate call, per rank")


def _drafter_opts(r: argparse.ArgumentParser) -> None:
    _sized(r, "--draft-layers", int, "draft layers")
    _sized(r, "--block-size", int, "block size B (B - 1 drafted tokens per step)")
    r.add_argument("--target-layers", type=str, default=None,
                   help="target layer ids the drafter reads: comma-separated, or dflash (one per draft layer, spread "
                        "from layer 1 to the fourth-last, as the released drafters) (default: all)")
    _sized(r, "--draft-steps", int, "optimizer steps")
    r.add_argument("--draft-lr", type=float, default=1e-3)
    _sized(r, "--warmup-steps", int, "learning-rate warm-up steps")
    _sized(r, "--anchors", int, "anchors (blocks) per sequence")
    _sized(r, "--seqs-per-step", int, "global batch: sequences per optimizer step over all ranks (gradients accumulated per sequence)")
    r.add_argument("--gamma", type=float, default=7.0, help="slot-loss decay: weight exp(-(k-1)/gamma)")
    r.add_argument("--mask-token-id", type=int, default=None, help="drafter mask token (default: the tokenizer's mask token)")
    _sized(r, "--heldout-seqs", int, "distilled sequences kept out for the teacher-forced evaluation")
    _sized(r, "--draft-save-every", int, "checkpoint every N steps")
    r.add_argument("--eval-every", type=int, default=0, help="held-out acceptance evaluation every N steps (default 0: at the end only)")
    r.add_argument("--eval-datasets", type=str, default="gsm8k,humaneval,mt_bench",
                   help="held-out prompts, as `bastion bench --datasets` (NAME[=PATH]); never training prompts")
    r.add_argument("--eval-limit", type=int, default=None,
                   help=f"held-out prompts per dataset (default: sized to the run, one per {STEPS_PER_EVAL_PROMPT} steps "
                        f"up to {FULL_EVAL_LIMIT}, none below {STEPS_PER_EVAL_PROMPT} steps: the teacher-forced figures "
                        f"only; --smoke 1)")
    r.add_argument("--full-eval", action="store_true",
                   help=f"decode the full {FULL_EVAL_LIMIT} held-out prompts per dataset however short the run")
    _sized(r, "--eval-max-new-tokens", int, "new tokens per held-out prompt")
    _sized(r, "--eval-budgets", str, "comma-separated N of the best-first@N figures")
    r.add_argument("--no-eval", action="store_true", help="skip the held-out acceptance evaluation")


def _tokenizer_stage(t: argparse.ArgumentParser) -> None:
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--vocab-size", type=int, default=8192)


def _target_stage(g: argparse.ArgumentParser) -> None:
    g.add_argument("--tokenizer", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    _target_opts(g)


def _distill_stage(d: argparse.ArgumentParser) -> None:
    _device_opts(d)
    d.add_argument("--out", type=Path, required=True, help="output file (.pt)")
    _distill_opts(d)


def _features_stage(f: argparse.ArgumentParser) -> None:
    _device_opts(f)
    f.add_argument("--data", type=Path, required=True, help="output of `bastion train distill`")
    f.add_argument("--out", type=Path, required=True, help="feature folder (memory-mapped, in the target's dtype)")
    f.add_argument("--target-layers", type=str, default=None, help="target layer ids as for the drafter (comma-separated, or dflash; default: all)")
    _sized(f, "--draft-layers", int, "draft layers (only for --target-layers dflash)")


def _drafter_stage(r: argparse.ArgumentParser) -> None:
    _device_opts(r)
    r.add_argument("--data", type=Path, required=True, help="output of `bastion train distill`")
    r.add_argument("--features", type=Path, default=None, help="precomputed features (`bastion train features`); default: online from the target")
    r.add_argument("--out", type=Path, required=True)
    _drafter_opts(r)


def _export_stage(e: argparse.ArgumentParser) -> None:
    e.add_argument("--target", type=Path, default=None, help="target folder to copy too (default: the drafter alone)")
    e.add_argument("--drafter", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--dtype", choices=CLI_DTYPES, default="float16")


def _all_stage(a: argparse.ArgumentParser) -> None:
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--vocab-size", type=int, default=8192)
    _target_opts(a)
    a.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    a.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    _distill_opts(a)
    _drafter_opts(a)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a DFlash drafter for a target (and the demo pair)",
        description="Distil a target's own generations and train a DFlash-format drafter for it "
        "(any Hugging Face target, CPU or GPU, data parallel under torchrun); also the demo tokenizer and target.",
    )
    stages = p.add_subparsers(dest="stage", metavar="STAGE", required=True)
    for stage in STAGES:
        sp = stages.add_parser(stage.name, help=stage.help, description=stage.help)
        if stage.name != "export":
            _common(sp)
        for opts in stage.options:
            opts(sp)
        sp.set_defaults(func=stage.run)
    for modname in STAGE_MODULES:
        importlib.import_module(modname).add_stage(stages)
    return p


# ---------------------------------------------------------------------------- helpers
def _data_dir(args: argparse.Namespace) -> Path:
    from bastion.utils.folders import default_data_dir

    return args.data_dir or default_data_dir()


def _training_data_dir(args: argparse.Namespace) -> Path:
    """The folder the training corpus is read from; the package's bundled slice only for ``--smoke``."""
    from bastion.contract.errors import InvalidInputError
    from bastion.utils.folders import DATA_DIR_ENV, is_bundled

    found = _data_dir(args)
    if is_bundled(found) and not args.smoke:
        raise InvalidInputError(
            "no data folder found, and the package bundles only a small slice of the training sets, for --smoke: "
            f"point --data-dir or ${DATA_DIR_ENV} at a folder holding gsm8k/train.jsonl and alpaca_eval/, "
            "or distill your own prompts with --prompts"
        )
    return found


def _limit(args: argparse.Namespace) -> int | None:
    return SMOKE_LIMIT if args.smoke else None


def _setup(args: argparse.Namespace) -> None:
    from bastion.utils.dtypes import show_dtype_choices
    from bastion.training.loop import seed_everything, set_threads

    show_dtype_choices()
    set_threads(args.threads)
    seed_everything(args.seed)


def _layer_ids(text: str | None, target: Any = None, draft_layers: int = 1) -> tuple[int, ...] | None:
    """``--target-layers``: comma-separated ids, ``dflash`` (one layer per draft layer, spread as the
    released DFlash drafters do) or None (every layer)."""
    if not text:
        return None
    if text.strip() == "dflash":
        from bastion.drafters.dflash import default_target_layer_ids

        return default_target_layer_ids(int(target.config.num_hidden_layers), draft_layers)
    return parse_int_list(text, what="--target-layers")


def _tokenizer_or_none(name: str) -> Any:
    from bastion.contract.errors import InvalidInputError
    from bastion.training.frozen import load_target_tokenizer

    try:
        return load_target_tokenizer(name)
    except InvalidInputError:
        return None


# ---------------------------------------------------------------------------- stages
def run_tokenizer(args: argparse.Namespace) -> int:
    from bastion.training.corpus import load_documents, split_documents
    from bastion.training.tokenizer import TokenizerConfig, train_tokenizer

    _setup(args)
    train, _ = split_documents(load_documents(_training_data_dir(args), limit_per_source=_limit(args)))
    vocab = 512 if args.smoke else args.vocab_size
    train_tokenizer((d.text for d in train), args.out, TokenizerConfig(vocab_size=vocab), length=len(train))
    print(f"tokenizer ({vocab} ids) written to {args.out}")
    return 0


def run_target(args: argparse.Namespace) -> int:
    from bastion.training.corpus import load_documents, split_documents
    from bastion.training.target_model import TargetConfig, train_target
    from bastion.training.tokenizer import load_tokenizer
    from bastion.training.tokens import load_or_encode

    _setup(args)
    tok = load_tokenizer(args.tokenizer)
    if args.smoke:
        cfg = TargetConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           max_positions=512, seq_len=32, batch_size=2, steps=4, warmup=1, save_every=2,
                           eval_windows=2, seed=args.seed)
    else:
        cfg = TargetConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                           seq_len=args.seq_len, batch_size=args.batch, steps=args.steps, lr=args.lr,
                           warmup=args.warmup, save_every=args.save_every or 50, seed=args.seed)
    train, held = split_documents(load_documents(_training_data_dir(args), limit_per_source=_limit(args)),
                                  heldout_fraction=0.2 if args.smoke else 0.01)
    out = Path(args.out)
    train_ids = load_or_encode(out / "tokens-train.npy", tok, train)
    held_ids = load_or_encode(out / "tokens-heldout.npy", tok, held)
    train_target(cfg, tok, train_ids, held_ids, out)
    return 0


def _distill_prompts(args: argparse.Namespace, tok: Any) -> list[tuple[str, str]]:
    """(source, rendered prompt) pairs: the user's files, and/or the bundled training sets."""
    from bastion.training.corpus import distill_prompts, render_prompt
    from bastion.training.prompts import read_user_prompts

    prompts: list[tuple[str, str]] = []
    for path in args.prompts:
        prompts += read_user_prompts(path, tok, limit=args.max_prompts)
    if not args.prompts or args.with_bundled:
        bundled = distill_prompts(_training_data_dir(args), per_source=size(args, "per_source"))
        prompts += [(src, render_prompt(tok, src, text)) for src, text in bundled]
    return prompts


def run_distill(args: argparse.Namespace) -> int:
    from bastion.distributed import setup, teardown
    from bastion.training.distill import DistillConfig, generate_continuations
    from bastion.training.frozen import load_frozen_target, load_target_tokenizer

    _setup(args)
    ctx = setup(args.device)
    try:
        tok = load_target_tokenizer(args.target)
        prompts = _distill_prompts(args, tok)
        target = load_frozen_target(args.target, ctx.device, args.dtype)
        cfg = DistillConfig(max_new_tokens=size(args, "max_new_tokens"), max_prompt_tokens=size(args, "max_prompt_tokens"),
                            batch_size=size(args, "gen_batch"))
        seqs = generate_continuations(target, tok, prompts, args.out, cfg, ctx)
        if ctx.is_main:
            n_new = sum(len(s.ids) - s.prompt_len for s in seqs)
            print(f"{len(seqs)} sequences, {n_new} generated tokens written to {args.out}")
    finally:
        teardown(ctx)
    return 0


def run_features(args: argparse.Namespace) -> int:
    from bastion.distributed import setup, teardown
    from bastion.training.distill import load_continuations
    from bastion.training.features import write_features
    from bastion.training.frozen import load_frozen_target

    _setup(args)
    ctx = setup(args.device)
    try:
        target = load_frozen_target(args.target, ctx.device, args.dtype)
        layers = _layer_ids(args.target_layers, target, size(args, "draft_layers")) or tuple(range(target.config.num_hidden_layers))
        seqs = load_continuations(args.data)
        store = write_features(target, seqs, layers, args.out, ctx)
        if ctx.is_main:
            print(f"features of {len(seqs)} sequences ({store.offsets[-1]} tokens x {store.width}, {store.dtype}) written to {args.out}")
    finally:
        teardown(ctx)
    return 0


def _split(seqs: list, n_held: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices: every k-th sequence is held out, so each source is represented."""
    from bastion.training.drafter import trainable_indices

    k = max(2, len(seqs) // max(1, n_held))
    held = [i for i in range(len(seqs)) if i % k == k - 1][:n_held]
    return trainable_indices(seqs, exclude=held), held


def eval_limit(args: argparse.Namespace) -> int:
    """Held-out prompts per dataset the bench acceptance evaluation decodes: ``--eval-limit`` as given;
    else :data:`FULL_EVAL_LIMIT` with ``--full-eval``; else 1 with ``--smoke``; else sized to the run:
    one per :data:`STEPS_PER_EVAL_PROMPT` training steps, at most :data:`FULL_EVAL_LIMIT`, at least one
    when ``--eval-every`` asks for evaluations. 0: no prompts, the teacher-forced figures on the
    held-out sequences only (a bench decode of 30 prompts costs minutes on a CPU, far more than a
    short run's training)."""
    if args.eval_limit is not None:
        return int(args.eval_limit)
    if args.full_eval:
        return FULL_EVAL_LIMIT
    if args.smoke:
        return int(SIZES["eval_limit"][1])
    sized = min(FULL_EVAL_LIMIT, size(args, "draft_steps") // STEPS_PER_EVAL_PROMPT)
    return max(sized, 1) if args.eval_every else sized


def _acceptance(args: argparse.Namespace, target: Any, tok: Any) -> Any:
    """The held-out acceptance evaluation as a callable on the draft model (None with --no-eval, or when
    the run is too short for one: see :func:`eval_limit`)."""
    if args.no_eval:
        return None
    limit = eval_limit(args)
    if limit == 0:
        print(f"held-out evaluation: teacher-forced only for a {size(args, 'draft_steps')}-step run "
              f"(--full-eval or --eval-limit N decodes held-out prompts)")
        return None
    from bastion.training.evaluate import AcceptanceEvalConfig, acceptance_eval

    budgets = parse_int_list(str(size(args, "eval_budgets")), what="--eval-budgets", low=1)
    cfg = AcceptanceEvalConfig(
        datasets=tuple(csv_list(args.eval_datasets)),
        limit=limit,
        max_new_tokens=size(args, "eval_max_new_tokens"),
        budgets=budgets,
        data_dir=str(_data_dir(args)),
    )
    return lambda model: acceptance_eval(target, model, tok, cfg)


def _check_out_folder(out: Path) -> None:
    """``--out`` must be a folder (or not exist yet, nor any file above it)."""
    from bastion.contract.errors import FileSystemError

    out = Path(out)
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            raise FileSystemError(f"--out {out}: {path} is a file, not a folder; choose another --out")


def run_drafter(args: argparse.Namespace) -> int:
    from bastion.distributed import setup, teardown
    from bastion.training.distill import load_continuations
    from bastion.training.drafter import DrafterTrainConfig, train_drafter
    from bastion.training.features import FeatureStore
    from bastion.training.frozen import load_frozen_target, resolve_mask_token

    _setup(args)
    _check_out_folder(args.out)  # before the target loads: a file in the way fails now, not after training
    ctx = setup(args.device)
    try:
        tok = _tokenizer_or_none(args.target)
        target = load_frozen_target(args.target, ctx.device, args.dtype)
        seqs = load_continuations(args.data)
        layers = _layer_ids(args.target_layers, target, size(args, "draft_layers"))
        cfg = DrafterTrainConfig(
            num_layers=size(args, "draft_layers"), block_size=size(args, "block_size"), target_layer_ids=layers,
            anchors_per_seq=size(args, "anchors"), seqs_per_step=size(args, "seqs_per_step"),
            steps=size(args, "draft_steps"), lr=args.draft_lr, warmup=size(args, "warmup_steps"), gamma=args.gamma,
            save_every=size(args, "draft_save_every"), eval_every=args.eval_every, seed=args.seed,
        )
        train, held = _split(seqs, size(args, "heldout_seqs"))
        mask_id = resolve_mask_token(tok, args.mask_token_id, int(target.get_output_embeddings().weight.shape[0]))
        features = None
        if args.features is not None:
            read = layers or tuple(range(target.config.num_hidden_layers))
            features = FeatureStore.open(args.features, layer_ids=read, sequences=len(seqs))
        train_drafter(target, seqs, train, held, cfg, mask_id, args.out, features=features, ctx=ctx,
                      evaluate=_acceptance(args, target, tok))
    finally:
        teardown(ctx)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from bastion.training.export import export_pair

    out = export_pair(args.target, args.drafter, args.out, parse_dtype(args.dtype))
    print(f"exported {'target + ' if args.target is not None else ''}drafter ({args.dtype}) to {out}")
    return 0


def run_all(args: argparse.Namespace) -> int:
    from bastion.contract.errors import InvalidInputError
    from bastion.distributed import env_ranks

    if env_ranks()[1] > 1:
        raise InvalidInputError("`bastion train all` runs in one process; launch the distill / features / drafter stages with torchrun")
    root = Path(args.out)
    ns = dict(vars(args))
    steps = [
        (run_tokenizer, {"out": root / "tokenizer"}),
        (run_target, {"tokenizer": root / "tokenizer", "out": root / "target"}),
        (run_distill, {"target": str(root / "target"), "out": root / "distill.pt"}),
        (run_drafter, {"target": str(root / "target"), "data": root / "distill.pt", "out": root / "drafter", "features": None}),
        (run_export, {"target": root / "target", "drafter": root / "drafter", "out": root / "export", "dtype": "float16"}),
    ]
    for fn, extra in steps:
        code = fn(argparse.Namespace(**{**ns, **extra}))
        if code:
            return code
    return 0


#: the built-in stages, in recipe order
STAGES: tuple[Stage, ...] = (
    Stage("tokenizer", "train the byte-level BPE tokenizer of the demo target", (_tokenizer_stage,), run_tokenizer),
    Stage("target", "train the Qwen3 demo target (resumable)", (_target_stage,), run_target),
    Stage("distill", "the target's greedy continuations of your prompts or the bundled ones (resumable, torchrun)", (_distill_stage,), run_distill),
    Stage("features", "precompute the target features the drafter reads (resumable, torchrun)", (_features_stage,), run_features),
    Stage("drafter", "train a DFlash drafter for a target (resumable, torchrun)", (_drafter_stage,), run_drafter),
    Stage("export", "write half-precision copies of a drafter (and its target) in the released format", (_export_stage,), run_export),
    Stage("all", "every demo stage in order under one folder", (_all_stage,), run_all),
)
