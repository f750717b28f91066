"""``bastion train eagle3``: train an EAGLE-3 drafter for a target with the training-time test.

Reads the target-generated data of ``bastion train distill`` (the DFlash and autoregressive drafters'
data), resumes from its output folder, and writes an EAGLE-3 checkpoint in the SafeAILab / SpecForge layout
that the ``eagle3`` drafter loads (``drafter=<out>``, or ``registry.create("drafter", "eagle3",
checkpoint=<out>)``); ``--export`` also writes a float16 copy (as shipped beside the demo pair).
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_stage", "run_eagle3"]

#: defaults of the sized options: (normal, --smoke)
SIZES: dict[str, tuple[object, object]] = {
    "steps": (600, 6),
    "ttt_steps": (7, 3),
    "seqs_per_step": (4, 2),
    "max_len": (256, 48),
    "heldout_seqs": (64, 2),
    "warmup": (30, 1),
    "save_every": (50, 3),
}


def _sized(p: argparse.ArgumentParser, flag: str, help: str) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    normal, smoke = SIZES[dest]
    p.add_argument(flag, type=int, default=None, help=f"{help} (default {normal}; --smoke {smoke})")


def add_stage(stages: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from bastion.training.frozen import DTYPES

    a = stages.add_parser(
        "eagle3",
        help="train an EAGLE-3 drafter for a target (training-time test; resumable)",
        description="Train an EAGLE-3 draft network (one decoder layer over three target layers' features) on the "
        "target's own greedy continuations, unrolled on its own hidden states as at inference; saved in the "
        "SafeAILab / SpecForge checkpoint layout.",
    )
    a.add_argument("--target", required=True, help="target model: local directory or hub id")
    a.add_argument("--data", type=Path, required=True, help="output of `bastion train distill`")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    a.add_argument("--dtype", choices=DTYPES, default="auto", help="target dtype (default: the checkpoint's own)")
    a.add_argument("--feature-layers", default=None, metavar="I,J,K",
                   help="the three target layers whose outputs the drafter reads (default: EAGLE-3's, the hidden states "
                        "entering layers 2, L // 2 and L - 3, when distinct; else the first, middle and last layer)")
    a.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary: the N target tokens most frequent in the continuations (default: the whole "
                        "vocabulary up to 32000 ids)")
    a.add_argument("--intermediate", type=int, default=None, help="MLP width of the draft layer (default: the target's)")
    _sized(a, "--steps", "optimizer steps")
    _sized(a, "--ttt-steps", "unrolled steps per position (training-time test depth, step 0 included)")
    a.add_argument("--step-decay", type=float, default=0.8, help="weight of unrolled step k: DECAY ** k (default 0.8)")
    _sized(a, "--seqs-per-step", "sequences per optimizer step (gradients accumulated per sequence)")
    _sized(a, "--max-len", "tokens per training sequence (the tail is kept)")
    a.add_argument("--lr", type=float, default=1e-3)
    _sized(a, "--warmup", "learning-rate warm-up steps")
    _sized(a, "--save-every", "checkpoint every N steps")
    _sized(a, "--heldout-seqs", "distilled sequences kept out for the teacher-forced evaluation")
    a.add_argument("--export", type=Path, default=None, help="also write a float16 copy here")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a.add_argument("--smoke", action="store_true", help="a few tiny steps: the stage end to end in seconds")
    a.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    a.set_defaults(func=run_eagle3)
    return a


def _size(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name)
    if value is not None:
        return int(value)
    normal, smoke = SIZES[name]
    return int(smoke if args.smoke else normal)  # type: ignore[call-overload]


def run_eagle3(args: argparse.Namespace) -> int:
    import torch

    from bastion.cli.parsing import parse_int_list
    from bastion.utils.dtypes import show_dtype_choices
    from bastion.drafters.eagle3 import Eagle3DraftModel
    from bastion.training.distill import load_continuations
    from bastion.training.eagle3 import Eagle3TrainConfig, train_eagle3
    from bastion.training.frozen import load_frozen_target
    from bastion.training.loop import set_threads

    show_dtype_choices()
    set_threads(args.threads)
    target = load_frozen_target(args.target, args.device, args.dtype)
    seqs = load_continuations(args.data)
    layers = None if args.feature_layers is None else tuple(parse_int_list(args.feature_layers, what="--feature-layers"))
    cfg = Eagle3TrainConfig(
        draft_vocab=args.draft_vocab, feature_layers=layers, intermediate_size=args.intermediate,
        ttt_steps=_size(args, "ttt_steps"), step_decay=args.step_decay, seqs_per_step=_size(args, "seqs_per_step"),
        max_len=_size(args, "max_len"), steps=_size(args, "steps"), lr=args.lr, warmup=_size(args, "warmup"),
        save_every=_size(args, "save_every"), seed=args.seed,
    )
    n_held = _size(args, "heldout_seqs")
    k = max(2, len(seqs) // max(1, n_held))  # every k-th sequence held out, so each source is represented
    held_ids = {i for i in range(len(seqs)) if i % k == k - 1 and i // k < n_held}
    train = [s for i, s in enumerate(seqs) if i not in held_ids]
    held = [s for i, s in enumerate(seqs) if i in held_ids]
    model = train_eagle3(target, train, held, cfg, args.out, progress=not args.no_progress)
    summary = (Path(args.out) / "train_summary.json").read_text()
    if args.export is not None:
        half: Eagle3DraftModel = model.to(torch.float16)
        half.save_pretrained(args.export)
        (Path(args.export) / "train_summary.json").write_text(summary)
    import json

    held_figs = json.loads(summary).get("heldout") or {}
    print(f"EAGLE-3 drafter written to {args.out}" + (f" (float16 copy in {args.export})" if args.export else "")
          + f"; held-out top-1 per step {held_figs.get('top1')}, chain acceptance {held_figs.get('chain_acceptance')}")
    return 0
