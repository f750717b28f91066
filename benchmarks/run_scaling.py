"""Throughput of ``bastion run`` on the demo pair: batched versus one ``generate`` call per prompt, and
two torchrun ranks versus one.

1. ``single``: one process, ``Pipeline.generate`` called once per prompt (what ``bastion generate`` does
   per prompt, without its process start-up).
2. ``run``: the same prompts through ``bastion run --batch-size B`` in the same process
   (:func:`bastion.run.run_prompts`, which calls ``Pipeline.generate_batch``).
3. ``ranks``: ``torchrun --nproc-per-node 1`` and ``--nproc-per-node 2 -m bastion run`` as subprocesses,
   each rank with one thread; wall time of the whole launch and the slowest rank's decoding time.

Every configuration runs with one torch thread per process, greedy, on GSM8K test questions. The outputs
of all configurations are checked to be identical. Prints a Markdown table; ``--json PATH`` saves it.

    python benchmarks/run_scaling.py [--prompts 200] [--max-new-tokens 64] [--batch-size 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bastion import Pipeline
from bastion.utils.folders import default_data_dir
from bastion.run import RunConfig, run_prompts
from bastion.run.encode import prompt_ids

REPO = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, n: int, data_dir: Path) -> list[str]:
    questions = [json.loads(line)["question"] for line in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:n]]
    path.write_text("".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in enumerate(questions)))
    return questions


def single_calls(pipe: Pipeline, questions: list[str], max_new: int) -> tuple[float, int, list[list[int]]]:
    t0 = time.perf_counter()
    outs = []
    with torch.inference_mode():
        for q in questions:
            ids = torch.tensor([prompt_ids(pipe.tokenizer, q)])
            outs.append(pipe.generate(ids, max_new_tokens=max_new).tokens)
    return time.perf_counter() - t0, sum(map(len, outs)), outs


def batched_run(pipe: Pipeline, inp: Path, out: Path, max_new: int, batch: int) -> tuple[float, int, list[list[int]]]:
    out.unlink(missing_ok=True)
    cfg = RunConfig(input=str(inp), output=str(out), batch_size=batch, max_new_tokens=max_new, progress=False)
    t0 = time.perf_counter()
    summary = run_prompts(cfg, pipe, log=lambda _m: None)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary is not None
    return wall, summary.new_tokens, [r["token_ids"] for r in rows]


def torchrun(nproc: int, inp: Path, out: Path, max_new: int, batch: int) -> tuple[float, float, list[list[int]]]:
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "bastion", "run",
        "--input", str(inp), "--output", str(out), "--batch-size", str(batch), "--max-new-tokens", str(max_new),
        "--threads", "1", "--device", "cpu", "--no-progress",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    line = next(ln for ln in proc.stderr.splitlines() if " rows: " in ln)
    decode_s = float(line.split(" new tokens in ")[1].split("s")[0])
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    return wall, decode_s, [r["token_ids"] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--data-dir", type=Path, default=None)
    ap.add_argument("--skip-ranks", action="store_true", help="skip the torchrun part")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bastion-run-scaling-"))
    inp = work / "prompts.jsonl"
    questions = write_prompts(inp, args.prompts, args.data_dir or default_data_dir())
    pipe = Pipeline.demo()
    with torch.inference_mode():  # warm-up outside the figures
        pipe.generate(torch.tensor([prompt_ids(pipe.tokenizer, questions[0])]), max_new_tokens=8)

    res: dict = {"prompts": len(questions), "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size}
    s_wall, s_tok, s_out = single_calls(pipe, questions, args.max_new_tokens)
    b_wall, b_tok, b_out = batched_run(pipe, inp, work / "batched.jsonl", args.max_new_tokens, args.batch_size)
    assert b_out == s_out, "bastion run must give the tokens of single generate calls"
    res.update(single_s=s_wall, single_tok_s=s_tok / s_wall, run_s=b_wall, run_tok_s=b_tok / b_wall,
               throughput_ratio=(b_tok / b_wall) / (s_tok / s_wall))  # fmt: skip
    rows = [
        "| configuration | wall s | tokens/s | ratio |",
        "|---|---|---|---|",
        f"| {len(questions)} single `generate` calls | {s_wall:.1f} | {s_tok / s_wall:.1f} | 1.00x |",
        f"| `bastion run --batch-size {args.batch_size}` | {b_wall:.1f} | {b_tok / b_wall:.1f} | {res['throughput_ratio']:.2f}x |",
    ]
    if not args.skip_ranks:
        w1, d1, o1 = torchrun(1, inp, work / "r1.jsonl", args.max_new_tokens, args.batch_size)
        w2, d2, o2 = torchrun(2, inp, work / "r2.jsonl", args.max_new_tokens, args.batch_size)
        assert o1 == o2 == s_out, "1-rank and 2-rank outputs must equal the single calls"
        res.update(rank1_wall_s=w1, rank1_decode_s=d1, rank2_wall_s=w2, rank2_decode_s=d2,
                   rank_speedup_wall=w1 / w2, rank_speedup_decode=d1 / d2)  # fmt: skip
        rows += [
            "",
            "| torchrun, 1 thread per rank | launch wall s | decode s (slowest rank) |",
            "|---|---|---|",
            f"| 1 rank | {w1:.1f} | {d1:.1f} |",
            f"| 2 ranks | {w2:.1f} | {d2:.1f} |",
            f"| 1 rank / 2 ranks | {w1 / w2:.2f}x | {d1 / d2:.2f}x |",
        ]
    res["cpu_count"] = os.cpu_count()
    res["load_avg_1min"] = os.getloadavg()[0]
    print("\n".join(rows))
    print(f"\n{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
