"""Drafter-training throughput and memory on one device, for a Qwen3-1.7B-shaped target.

No downloads: the target is built from a config with random weights (Qwen3-1.7B's shape: hidden 2048,
intermediate 6144, 28 layers, 16 heads, 8 KV heads, head_dim 128, vocabulary 151,936, tied embeddings)
in bfloat16 on the device, frozen. The drafter has the recipe's default training shape
(:class:`~bastion.training.drafter.DrafterTrainConfig`: 2 layers, block 16, every target layer read, 32
anchors per sequence, 4 sequences per optimizer step) and is trained by the recipe's own step
(:func:`~bastion.training.drafter.train_step`: features captured online from the frozen target, bfloat16
autocast on CUDA, the weighted block loss, AdamW with clipping) on random token sequences of
``--seq-len`` tokens: ``--warmup`` steps, then ``--steps`` timed ones.

Reported (stdout, one JSON object; ``--out`` writes it to a file too): training-sequence tokens per
second over the timed steps, the peak of ``torch.cuda.max_memory_allocated`` over the whole run (CUDA
only), and the memory plan's prediction (:mod:`bastion.training.memory`) for the same shapes.

    python benchmarks/train_device.py --device cuda          # the Qwen3-1.7B shape: about a minute
    python benchmarks/train_device.py --tiny --device cpu    # a tiny target: seconds, any machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

#: Qwen3-1.7B's shape (its config.json, weights aside)
QWEN3_1_7B: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_target(tiny: bool, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Any:
    """A frozen random-weight Qwen3 target: the 1.7B shape, or the test suite's tiny one."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from bastion.testing.tiny import tiny_config
    from bastion.training.frozen import freeze

    torch.manual_seed(seed)
    cfg = tiny_config("qwen3") if tiny else Qwen3Config(**QWEN3_1_7B)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return freeze(model)


def random_sequences(n: int, length: int, vocab: int, mask_token_id: int, seed: int = 0) -> list:
    """``n`` random token sequences of ``length`` tokens (never the mask token); the second half stands
    for the target's continuation (where the anchors fall)."""
    from bastion.training.distill import DistillSequence

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 1, (length,), generator=gen)  # [L]
        ids[ids >= mask_token_id] += 1  # skip the mask id
        out.append(DistillSequence("random", ids, length // 2))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bastion.distributed import DistContext
    from bastion.training.drafter import DrafterTrainConfig, prepare_training, train_step
    from bastion.training.memory import memory_plan, parameter_count

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_start = time.perf_counter()
    target = build_target(args.tiny, device, dtype)
    vocab = int(target.config.vocab_size)
    mask_id = vocab - 1
    defaults = DrafterTrainConfig()
    cfg = DrafterTrainConfig(
        num_layers=args.draft_layers or defaults.num_layers,
        block_size=args.block_size or defaults.block_size,
        anchors_per_seq=args.anchors or defaults.anchors_per_seq,
        seqs_per_step=args.seqs_per_step or defaults.seqs_per_step,
        steps=args.warmup + args.steps,
        warmup=max(1, args.warmup),
    )
    seqs = random_sequences(2 * cfg.seqs_per_step, args.seq_len, vocab, mask_id)
    train_ids = list(range(len(seqs)))
    state, _, _ = prepare_training(target, cfg, mask_id, ctx=DistContext(device=device), log=lambda *_: None)
    init_s = time.perf_counter() - t_start
    losses = []
    for step in range(args.warmup):
        losses.append(train_step(state, seqs, train_ids, step)[0])
    _sync(device)
    t0 = time.perf_counter()
    tokens = 0
    for step in range(args.warmup, args.warmup + args.steps):
        loss, n = train_step(state, seqs, train_ids, step)
        losses.append(loss)
        tokens += n
    _sync(device)
    seconds = time.perf_counter() - t0
    plan = memory_plan(target.config, parameter_count(target), parameter_count(state.model), seq_len=args.seq_len,
                       anchors=cfg.anchors_per_seq, block_size=cfg.block_size, target_bytes=dtype.itemsize)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "target": "tiny qwen3" if args.tiny else "Qwen3-1.7B shape (random weights)",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "target_dtype": args.dtype or ("bf16" if device.type == "cuda" else "fp32"),
        "target_parameters": parameter_count(target),
        "drafter_parameters": parameter_count(state.model),
        "drafter": {"layers": cfg.num_layers, "block_size": cfg.block_size,
                    "target_layers": len(state.model.config.target_layer_ids), "anchors_per_seq": cfg.anchors_per_seq},
        "seq_len": args.seq_len,
        "seqs_per_step": cfg.seqs_per_step,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "tokens": tokens,
        "seconds": round(seconds, 6),  # enough digits that tokens / seconds gives tokens_per_s back
        "tokens_per_s": round(tokens / seconds, 1),
        "step_s": round(seconds / args.steps, 6),
        "init_s": round(init_s, 1),
        "losses": [round(float(x), 4) for x in losses],  # read once, at the end: no host sync in the timed loop
        "max_memory_allocated_gb": None if peak is None else round(peak / 1e9, 2),
        "memory_plan_gb": plan.gigabytes(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="the tiny test target and sizes: seconds on a CPU")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="target dtype (default bf16 on CUDA, fp32 elsewhere)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per training sequence (default 2048; --tiny 64)")
    p.add_argument("--seqs-per-step", type=int, default=None, help="sequences per optimizer step (default: the recipe's)")
    p.add_argument("--anchors", type=int, default=None, help="anchors per sequence (default: the recipe's)")
    p.add_argument("--draft-layers", type=int, default=None, help="draft layers (default: the recipe's)")
    p.add_argument("--block-size", type=int, default=None, help="block size (default: the recipe's)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; --tiny 2)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    tiny_sizes = dict(seq_len=64, warmup=1, steps=2, anchors=4, block_size=4, draft_layers=1, seqs_per_step=2)
    sizes = dict(seq_len=2048, warmup=3, steps=20)
    for key, value in (tiny_sizes if args.tiny else sizes).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
