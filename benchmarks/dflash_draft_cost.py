"""Draft cost of the DFlash drafter per step: cached context vs recomputing the context every step.

Usage: python benchmarks/dflash_draft_cost.py [--device cpu] [--hidden 256] [--layers 2] [--block 16]
       python benchmarks/dflash_draft_cost.py --demo --contexts 128,2048   # the demo pair's drafter and head

On CPU with one thread (the default) the clock is the calling thread's CPU time, which other processes
competing for the cores do not inflate. Builds a random target geometry (no download), a random DFlash drafter for it, and times
``propose`` after committing one token per step (the incremental cache) against one block forward that
re-projects the whole context. Prints a Markdown table of median milliseconds per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bastion.contract.types import DraftContext, DraftStep
from bastion.drafters.dflash import DFlashDrafter
from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--contexts", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time of this thread is the clock)")
    ap.add_argument("--demo", action="store_true", help="the demo pair's trained drafter with its target's embedding and "
                    "head (random features: the cost does not depend on their values)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 and args.device == "cpu" else time.perf_counter
    device = torch.device(args.device)
    torch.manual_seed(0)
    target_cfg = dict(
        hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=8,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
        vocab_size=args.vocab, rms_norm_eps=1e-6, rope_theta=1e6,
    )
    if args.demo:
        import bastion

        pipe = bastion.Pipeline.demo(device=args.device)
        drafter, cfg = pipe.drafter, pipe.drafter.config
        embed, head = pipe.target.input_embeddings(), pipe.target.output_head()
        args.hidden, args.layers, args.block, args.vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.block_size, cfg.vocab_size
    else:
        cfg = DFlashConfig.for_target(target_cfg, num_layers=args.layers, block_size=args.block, target_layer_ids=(1, 4, 6))
        drafter = DFlashDrafter(DFlashDraftModel(cfg), device=device)
        embed = torch.nn.Embedding(args.vocab, args.hidden).to(device)
        head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(device)
        drafter._embed, drafter._head = embed, head  # a stand-in target's modules (benchmark only)

    print(f"device {device}, hidden {args.hidden}, draft layers {args.layers}, block {args.block}, vocab {args.vocab}\n")
    print("| context | cached propose (ms) | full-context forward (ms) |")
    print("| ---: | ---: | ---: |")
    for ctx in (int(c) for c in args.contexts.split(",")):
        feats = torch.randn(ctx, cfg.feature_size, device=device)
        drafter.begin(DraftContext(tokens=torch.zeros(ctx, dtype=torch.long), features=feats))
        cached, full = [], []
        length = ctx
        for _ in range(args.steps):
            _sync(device)
            t0 = clock()
            drafter.propose(DraftStep(root_token=3, context_len=length))
            _sync(device)
            cached.append(clock() - t0)
            drafter.commit(torch.tensor([3]), torch.randn(1, cfg.feature_size, device=device))
            length += 1
        block = torch.full((1, args.block), cfg.mask_token_id, device=device)
        with torch.inference_mode():
            for _ in range(args.steps):
                _sync(device)
                t0 = clock()
                drafter.model.block_logits(
                    feats[None], block, embed=embed, head=head, block_positions=torch.arange(ctx, ctx + args.block, device=device)
                )
                _sync(device)
                full.append(clock() - t0)
        print(f"| {ctx} | {1e3 * statistics.median(cached[2:]):.2f} | {1e3 * statistics.median(full[2:]):.2f} |")


if __name__ == "__main__":
    main()
