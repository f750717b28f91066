"""``bastion train``: the demo-pair training recipe (tokenizer -> target -> distill -> drafter -> export).

Every stage writes into its own directory and can be re-run; the target and drafter stages resume from
their last checkpoint. ``--smoke`` shrinks every size so the whole recipe runs in seconds (used by tests).
"""

from __future__ import annotations

import argparse
from pathlib import Path

STAGES = ("tokenizer", "target", "distill", "drafter", "export", "all")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=None, help="shared data folder (default: $BASTION_DATA or ../shared/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and a corpus slice: the recipe end to end in seconds")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train the demo tokenizer, target and DFlash drafter",
        description="Train a byte-level BPE tokenizer, a small Qwen3 target and a DFlash-format drafter for it.",
    )
    st = p.add_subparsers(dest="stage", metavar="STAGE", required=True)

    t = st.add_parser("tokenizer", help="train the byte-level BPE tokenizer")
    _common(t)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--vocab-size", type=int, default=8192)
    t.set_defaults(func=run_tokenizer)

    g = st.add_parser("target", help="train the Qwen3 target (resumable)")
    _common(g)
    g.add_argument("--tokenizer", type=Path, required=True)
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--intermediate", type=int, default=768)
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--steps", type=int, default=1600)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--warmup", type=int, default=100)
    g.add_argument("--save-every", type=int, default=50)
    g.set_defaults(func=run_target)

    return p


def _data_dir(args: argparse.Namespace) -> Path:
    from bastion.training.corpus import default_data_dir

    return args.data_dir or default_data_dir()


def _limit(args: argparse.Namespace) -> int | None:
    return 12 if args.smoke else None


def run_tokenizer(args: argparse.Namespace) -> int:
    from bastion.training.corpus import load_documents, split_documents
    from bastion.training.loop import seed_everything
    from bastion.training.tokenizer import TokenizerConfig, train_tokenizer

    seed_everything(args.seed)
    docs = load_documents(_data_dir(args), limit_per_source=_limit(args))
    train, _ = split_documents(docs)
    vocab = 512 if args.smoke else args.vocab_size
    train_tokenizer((d.text for d in train), args.out, TokenizerConfig(vocab_size=vocab), length=len(train))
    print(f"tokenizer ({vocab} ids) written to {args.out}")
    return 0


def run_target(args: argparse.Namespace) -> int:
    from bastion.training.corpus import load_documents, split_documents
    from bastion.training.loop import set_threads
    from bastion.training.target import TargetConfig, train_target
    from bastion.training.tokenizer import load_tokenizer
    from bastion.training.tokens import load_or_encode

    set_threads(args.threads)
    tok = load_tokenizer(args.tokenizer)
    if args.smoke:
        cfg = TargetConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           max_positions=256, seq_len=64, batch_size=2, steps=4, warmup=1, save_every=2,
                           eval_windows=2, seed=args.seed)
    else:
        cfg = TargetConfig(hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                           num_kv_heads=args.kv_heads, intermediate_size=args.intermediate,
                           seq_len=args.seq_len, batch_size=args.batch, steps=args.steps, lr=args.lr,
                           warmup=args.warmup, save_every=args.save_every, seed=args.seed)
    docs = load_documents(_data_dir(args), limit_per_source=_limit(args))
    train, held = split_documents(docs, heldout_fraction=0.1 if args.smoke else 0.01)
    out = Path(args.out)
    train_ids = load_or_encode(out / "tokens-train.npy", tok, train)
    held_ids = load_or_encode(out / "tokens-heldout.npy", tok, held)
    train_target(cfg, tok, train_ids, held_ids, out)
    return 0
