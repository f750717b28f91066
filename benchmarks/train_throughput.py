"""Drafter-training throughput at 1 and 2 data-parallel ranks (torchrun, gloo, one thread per rank).

Trains the same drafter (same global batch, same steps) with ``python -m bastion train drafter`` and with
``torchrun --nproc-per-node 2 -m bastion train drafter``, alternating the two ``--rounds`` times so slow
drift of the machine falls on both, and reads ``tokens_per_s`` (training-sequence tokens per second of
the training loop, start-up excluded) from each run's ``train_summary.json``. Prints a Markdown table
with the best round of each and their ratio.

    bastion train all --smoke --out runs/smoke
    python benchmarks/train_throughput.py --target runs/smoke/target --data runs/smoke/distill.pt \
        [--steps 100] [--seqs-per-step 16] [--rounds 2] [--work runs/throughput]

The ranks all-reduce once per optimizer step, so the ratio grows with ``--seqs-per-step`` (the global
batch): ``--steps 150 --seqs-per-step 64`` is the global batch of the data-parallel recipe in
``docs/train-your-own.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path


def _train(ranks: int, args: argparse.Namespace, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    opts = ["train", "drafter", "--target", args.target, "--data", args.data, "--out", str(out), "--device", "cpu",
            "--threads", "1", "--smoke", "--draft-steps", str(args.steps), "--seqs-per-step", str(args.seqs_per_step),
            "--draft-save-every", str(args.steps), "--heldout-seqs", "0", "--no-eval"]
    if args.mask_token_id is not None:
        opts += ["--mask-token-id", str(args.mask_token_id)]
    launch = [sys.executable, "-m", "bastion"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "bastion"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(launch + opts, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return float(json.loads((out / "train_summary.json").read_text())["tokens_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--seqs-per-step", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--work", default="runs/throughput")
    args = p.parse_args()
    work = Path(args.work)
    best = {1: 0.0, 2: 0.0}
    for r in range(args.rounds):
        for ranks in ((1, 2) if r % 2 == 0 else (2, 1)):
            tps = _train(ranks, args, work / f"r{r}-{ranks}")
            best[ranks] = max(best[ranks], tps)
            print(f"round {r}: {ranks} rank(s) {tps:.0f} tokens/s", file=sys.stderr)
    print("| ranks | tokens/s (best of rounds) | ratio |\n|---|---|---|")
    for ranks in (1, 2):
        print(f"| {ranks} | {best[ranks]:.0f} | {best[ranks] / best[1]:.2f} |")


if __name__ == "__main__":
    main()
