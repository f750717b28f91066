"""``bastion train ar-drafter``: distil the target into a small autoregressive drafter (a plain causal LM).

Uses the same target-generated data as the DFlash drafter (``bastion train distill``); resumable from its
output folder; the result loads with ``AutoModelForCausalLM`` and as ``registry.create("drafter",
"model", checkpoint=<out>)``. ``--export`` also writes a float16 copy (e.g. next to the demo pair).
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_stage", "run_ar_drafter"]


def add_stage(stages: argparse._SubParsersAction) -> argparse.ArgumentParser:
    a = stages.add_parser("ar-drafter", help="distil the target into a small autoregressive drafter (resumable)")
    a.add_argument("--target", type=Path, required=True)
    a.add_argument("--data", type=Path, required=True, help="output of `bastion train distill`")
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--layers", type=int, default=1, help="decoder layers of the drafter")
    a.add_argument("--hidden", type=int, default=None, help="width (default: the target's, initialised from it)")
    a.add_argument("--steps", type=int, default=300)
    a.add_argument("--lr", type=float, default=1e-3)
    a.add_argument("--seqs-per-step", type=int, default=4)
    a.add_argument("--max-len", type=int, default=192, help="tokens per training sequence (the tail is kept)")
    a.add_argument("--heldout-seqs", type=int, default=96)
    a.add_argument("--export", type=Path, default=None, help="also write a float16 copy here")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    a.add_argument("--smoke", action="store_true", help="a few tiny steps: the stage end to end in seconds")
    a.set_defaults(func=run_ar_drafter)
    return a


def run_ar_drafter(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from bastion.training.ar_drafter import ARDrafterConfig, train_ar_drafter
    from bastion.training.distill import load_continuations
    from bastion.training.loop import set_threads

    set_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    seqs = load_continuations(args.data)
    if args.smoke:
        cfg = ARDrafterConfig(num_layers=1, hidden_size=args.hidden, seqs_per_step=2, max_len=64, steps=3,
                              warmup=1, save_every=2, seed=args.seed)
        n_held = 2
    else:
        cfg = ARDrafterConfig(num_layers=args.layers, hidden_size=args.hidden, seqs_per_step=args.seqs_per_step,
                              max_len=args.max_len, steps=args.steps, lr=args.lr, seed=args.seed)
        n_held = args.heldout_seqs
    k = max(2, len(seqs) // max(1, n_held))  # every k-th sequence held out, so each source is represented
    held = [s for i, s in enumerate(seqs) if i % k == k - 1][:n_held]
    train = [s for i, s in enumerate(seqs) if not (i % k == k - 1 and i // k < n_held)]
    drafter = train_ar_drafter(target, train, held, cfg, args.out)
    if args.export is not None:
        drafter.to(torch.float16).save_pretrained(args.export)
        (Path(args.export) / "train_summary.json").write_text((Path(args.out) / "train_summary.json").read_text())
    print(f"autoregressive drafter written to {args.out}" + (f" (float16 copy in {args.export})" if args.export else ""))
    return 0
