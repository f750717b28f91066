"""``bastion train``: the demo-pair training recipe.

Stages: ``tokenizer`` -> ``target`` -> ``distill`` (the target's greedy continuations of training prompts)
-> ``drafter`` (DFlash format) -> ``export`` (float16 copies for shipping); ``all`` runs them in order
under one folder. Each stage writes its own output and can be re-run; the target, distill and drafter
stages resume from their last checkpoint. ``--smoke`` shrinks every size and the corpus so the whole
recipe runs in seconds (the tests use it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SMOKE_LIMIT = 12  # documents per source in --smoke runs


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=None, help="shared data folder (default: $BASTION_DATA_DIR, ./data or ../shared/data)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and a corpus slice: the recipe end to end in seconds")


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
    g.add_argument("--save-every", type=int, default=50)


def _distill_opts(d: argparse.ArgumentParser) -> None:
    d.add_argument("--per-source", type=int, default=1500, help="prompts per source (code, math, chat)")
    d.add_argument("--max-new-tokens", type=int, default=192)
    d.add_argument("--gen-batch", type=int, default=32)


def _drafter_opts(r: argparse.ArgumentParser) -> None:
    r.add_argument("--draft-layers", type=int, default=2)
    r.add_argument("--block-size", type=int, default=16)
    r.add_argument("--target-layers", type=str, default=None, help="comma-separated target layer ids (default: all)")
    r.add_argument("--draft-steps", type=int, default=2400)
    r.add_argument("--draft-lr", type=float, default=1e-3)
    r.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence")
    r.add_argument("--seqs-per-step", type=int, default=4)
    r.add_argument("--gamma", type=float, default=7.0, help="slot-loss decay: weight exp(-(k-1)/gamma)")
    r.add_argument("--mask-token-id", type=int, default=None, help="drafter mask token (default: the tokenizer's mask token)")
    r.add_argument("--heldout-seqs", type=int, default=96, help="distilled sequences kept out for evaluation")


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
    _target_opts(g)
    g.set_defaults(func=run_target)

    d = st.add_parser("distill", help="the target's greedy continuations of training prompts (resumable)")
    _common(d)
    d.add_argument("--target", type=Path, required=True)
    d.add_argument("--out", type=Path, required=True, help="output file (.pt)")
    _distill_opts(d)
    d.set_defaults(func=run_distill)

    r = st.add_parser("drafter", help="train a DFlash drafter for a target (resumable)")
    _common(r)
    r.add_argument("--target", type=Path, required=True)
    r.add_argument("--data", type=Path, required=True, help="output of `bastion train distill`")
    r.add_argument("--out", type=Path, required=True)
    _drafter_opts(r)
    r.set_defaults(func=run_drafter)

    e = st.add_parser("export", help="write float16 copies of a target + drafter (e.g. into the package)")
    e.add_argument("--target", type=Path, required=True)
    e.add_argument("--drafter", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16")
    e.set_defaults(func=run_export)

    a = st.add_parser("all", help="every stage in order under one folder")
    _common(a)
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--vocab-size", type=int, default=8192)
    _target_opts(a)
    _distill_opts(a)
    _drafter_opts(a)
    a.set_defaults(func=run_all)
    return p


# ---------------------------------------------------------------------------- helpers
def _data_dir(args: argparse.Namespace) -> Path:
    from bastion.training.corpus import default_data_dir

    return args.data_dir or default_data_dir()


def _limit(args: argparse.Namespace) -> int | None:
    return SMOKE_LIMIT if args.smoke else None


def _setup(args: argparse.Namespace) -> None:
    from bastion.training.loop import seed_everything, set_threads

    set_threads(args.threads)
    seed_everything(args.seed)


def _load_target(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# ---------------------------------------------------------------------------- stages
def run_tokenizer(args: argparse.Namespace) -> int:
    from bastion.training.corpus import load_documents, split_documents
    from bastion.training.tokenizer import TokenizerConfig, train_tokenizer

    _setup(args)
    train, _ = split_documents(load_documents(_data_dir(args), limit_per_source=_limit(args)))
    vocab = 512 if args.smoke else args.vocab_size
    train_tokenizer((d.text for d in train), args.out, TokenizerConfig(vocab_size=vocab), length=len(train))
    print(f"tokenizer ({vocab} ids) written to {args.out}")
    return 0


def run_target(args: argparse.Namespace) -> int:
    from bastion.training.corpus import load_documents, split_documents
    from bastion.training.target import TargetConfig, train_target
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
                           warmup=args.warmup, save_every=args.save_every, seed=args.seed)
    train, held = split_documents(load_documents(_data_dir(args), limit_per_source=_limit(args)),
                                  heldout_fraction=0.2 if args.smoke else 0.01)
    out = Path(args.out)
    train_ids = load_or_encode(out / "tokens-train.npy", tok, train)
    held_ids = load_or_encode(out / "tokens-heldout.npy", tok, held)
    train_target(cfg, tok, train_ids, held_ids, out)
    return 0


def run_distill(args: argparse.Namespace) -> int:
    from bastion.training.corpus import distill_prompts
    from bastion.training.distill import DistillConfig, generate_continuations
    from bastion.training.tokenizer import load_tokenizer

    _setup(args)
    tok = load_tokenizer(args.target)
    target = _load_target(args.target)
    per_source = 3 if args.smoke else args.per_source
    cfg = (DistillConfig(max_new_tokens=16, max_prompt_tokens=48, batch_size=3) if args.smoke
           else DistillConfig(max_new_tokens=args.max_new_tokens, batch_size=args.gen_batch))
    prompts = distill_prompts(_data_dir(args), per_source=per_source)
    seqs = generate_continuations(target, tok, prompts, args.out, cfg)
    n_new = sum(len(s.ids) - s.prompt_len for s in seqs)
    print(f"{len(seqs)} sequences, {n_new} generated tokens written to {args.out}")
    return 0


def run_drafter(args: argparse.Namespace) -> int:
    from bastion.training.distill import load_continuations
    from bastion.training.drafter import DrafterTrainConfig, train_drafter
    from bastion.training.tokenizer import load_tokenizer

    _setup(args)
    tok = load_tokenizer(args.target)
    target = _load_target(args.target)
    seqs = load_continuations(args.data)
    layers = None if not args.target_layers else tuple(int(x) for x in args.target_layers.split(","))
    if args.smoke:
        cfg = DrafterTrainConfig(num_layers=1, block_size=4, target_layer_ids=layers, anchors_per_seq=4,
                                 seqs_per_step=2, steps=3, warmup=1, save_every=2, seed=args.seed)
        n_held = 2
    else:
        cfg = DrafterTrainConfig(num_layers=args.draft_layers, block_size=args.block_size, target_layer_ids=layers,
                                 anchors_per_seq=args.anchors, seqs_per_step=args.seqs_per_step,
                                 steps=args.draft_steps, lr=args.draft_lr, gamma=args.gamma, seed=args.seed)
        n_held = args.heldout_seqs
    # held-out sequences: every k-th one, so each source is represented
    k = max(2, len(seqs) // max(1, n_held))
    held = [s for i, s in enumerate(seqs) if i % k == k - 1][:n_held]
    train = [s for i, s in enumerate(seqs) if not (i % k == k - 1 and i // k < n_held)]
    mask_id = args.mask_token_id if args.mask_token_id is not None else tok.mask_token_id
    if mask_id is None:
        from bastion.core.errors import InvalidInputError

        raise InvalidInputError("the tokenizer has no mask token; pass --mask-token-id")
    train_drafter(target, train, held, cfg, mask_id, args.out)
    return 0


def run_export(args: argparse.Namespace) -> int:
    from bastion.training.export import export_pair

    out = export_pair(args.target, args.drafter, args.out, getattr(torch, args.dtype))
    print(f"exported target + drafter to {out}")
    return 0


def run_all(args: argparse.Namespace) -> int:
    root = Path(args.out)
    ns = dict(vars(args))
    steps = [
        (run_tokenizer, {"out": root / "tokenizer"}),
        (run_target, {"tokenizer": root / "tokenizer", "out": root / "target"}),
        (run_distill, {"target": root / "target", "out": root / "distill.pt"}),
        (run_drafter, {"target": root / "target", "data": root / "distill.pt", "out": root / "drafter"}),
        (run_export, {"target": root / "target", "drafter": root / "drafter", "out": root / "export", "dtype": "float16"}),
    ]
    for fn, extra in steps:
        code = fn(argparse.Namespace(**{**ns, **extra}))
        if code:
            return code
    return 0
