"""One script to run on a GPU: is bastion lossless there, how many syncs does a step cost, how good is
the latency model, and where does a step's time go. No downloads: models are random-weight, built from
configs (a Qwen3-1.7B and a Qwen3-8B shape by default).

Checks, per model shape and dtype (fp32 and bf16):

* **lossless greedy**: bastion's output against Hugging Face ``model.generate`` (greedy) on the same
  prompts. A mismatch is classified: at the first differing position the target's own logits for the
  two candidate tokens are compared; a gap below ``--tie-tol`` (relative to the logit scale) is a
  *near-tie* (both are the argmax up to rounding, as happens in bf16 when the cached and uncached
  attention kernels round differently) and anything else is a *real mismatch*, which fails the check;
* **syncs per step**: on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` reports every synchronising
  call; their count over a generation divided by its steps;
* **verify latency curve**: ``Target.forward_tree`` times for n = 1 .. 512 at two context lengths, and
  the median / max relative error of the online-fitted ``roofline`` latency model on them;
* **stage split**: the share of draft / tree / controller / verify / accept / commit in a step;
* **compiled verify path** (opt-in in the library, off by default until measured): eager against
  compiled verify latency at ``--compile-sizes`` (one graph per size; CUDA graphs on CUDA) and the two
  contexts, the compile time per size, and lossless greedy decoding through the compiled path.

Results go to ``--out`` as ``device_check.json`` and ``device_check.md``; the exit status is non-zero
when a real mismatch is found.

Usage::

    python benchmarks/device_check.py                     # on a GPU: both shapes, fp32 and bf16
    python benchmarks/device_check.py --shapes 1.7b --dtypes bf16
    python benchmarks/device_check.py --quick             # on a GPU: fewer prompts, sizes and tokens
    python benchmarks/device_check.py --tiny --device cpu # seconds, on any machine (CI runs it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

#: the architecture facts of the public Qwen3 checkpoints (random weights are drawn for them)
SHAPES: dict[str, dict[str, Any]] = {
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STAGES = ("draft", "tree", "controller", "verify", "accept", "commit")


def build_pair(shape: str, dtype: torch.dtype, device: str, seed: int = 0):  # type: ignore[no-untyped-def]
    """A random Qwen3 target of ``shape`` and a random 1-layer DFlash drafter for it, as a pipeline."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    import bastion
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter

    torch.manual_seed(seed)
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # peaked next-token distributions, as a trained model has
        model.get_output_embeddings().weight.mul_(8.0)
    model.eval()
    dcfg = DFlashConfig.for_target(cfg, num_layers=1, block_size=16)
    drafter = DFlashDrafter(DFlashDraftModel(dcfg), device=device, dtype=dtype)
    # a fixed tree every step: a random drafter is never accepted, so the default controller's gate would
    # decode plainly, and the sync count and stage split are about speculative steps
    fixed = bastion.registry.create("budget_controller", "fixed", budget=32)
    pipe = bastion.Pipeline(target=HFTarget(model), drafter=drafter, budget_controller=fixed)
    return pipe, model


def accepting_pipe(model: Any) -> Any:
    """The same target with a drafter that is right most of the time (noisy copies of the target's own
    greedy rollout): lossless checks then cover multi-token acceptance and commits, not only rejections."""
    import bastion
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.testing.drafters import NoisyOracleDrafter

    return bastion.Pipeline(target=HFTarget(model), drafter=NoisyOracleDrafter(model, block_size=8, noise=1.0),
                            budget_controller=bastion.registry.create("budget_controller", "fixed", budget=32))


def classify_mismatch(model: Any, prompt: torch.Tensor, ref: list[int], got: list[int], tie_tol: float) -> dict[str, Any]:
    """Where bastion and HF first differ, and whether the target itself calls it a near-tie there."""
    i = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if i is None:
        if len(ref) == len(got):
            return {"kind": "equal"}
        return {"kind": "real", "position": min(len(ref), len(got)), "why": "different lengths"}
    prefix = torch.cat([prompt[0], torch.tensor(ref[:i], device=prompt.device, dtype=torch.long)])[None]
    with torch.no_grad():
        logits = model(prefix).logits[0, -1].float()  # [V]
    gap = float(logits[ref[i]] - logits[got[i]])
    scale = float(logits.abs().max()) or 1.0
    kind = "near-tie" if abs(gap) <= tie_tol * scale else "real"
    return {"kind": kind, "position": i, "logit_gap": gap, "logit_scale": scale}


def check_lossless(pipe: Any, model: Any, prompts: list[torch.Tensor], new_tokens: int, tie_tol: float) -> dict[str, Any]:
    rows, accepted = [], []
    for prompt in prompts:
        with torch.no_grad():
            ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
        res = pipe.generate(prompt, max_new_tokens=new_tokens, stop_on_eos=False)
        rows.append(classify_mismatch(model, prompt, ref, res.tokens, tie_tol))
        accepted.append(res.acceptance_length)
    kinds = [r["kind"] for r in rows]
    return {"prompts": len(rows), "equal": kinds.count("equal"), "near_tie": kinds.count("near-tie"),
            "real": kinds.count("real"), "acceptance_length": statistics.mean(accepted), "details": rows}


def count_syncs(pipe: Any, prompt: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Synchronising CUDA calls per decode step (CUDA only; None elsewhere)."""
    if pipe.target.device.type != "cuda":
        return {"per_step": None, "note": "sync debug mode exists on CUDA only"}
    pipe.generate(prompt, max_new_tokens=4)  # warm-up outside the count
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            res = pipe.generate(prompt, max_new_tokens=new_tokens, stop_on_eos=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message).lower() for w in caught)
    return {"per_step": syncs / max(1, len(res.steps)), "total": syncs, "steps": len(res.steps)}


def latency_curve(pipe: Any, sizes: list[int], contexts: list[int], repeats: int) -> dict[str, Any]:
    """Measured verify times and the online-fitted roofline's errors on them (half the timings fit the
    model, in shuffled order as a decode run would feed it; the other half are predicted)."""
    import random

    from bastion.controllers.latency.calibrate import measure_verify_curve
    from bastion.controllers.latency.roofline import RooflineLatency

    target = pipe.target
    curve = measure_verify_curve(target, sizes, contexts, repeats=2 * repeats, warmup=2)
    model = RooflineLatency(profile=None, window=4096)
    model.bind(target)
    train = [(n, c, s) for n, c, times in curve for s in times[::2]]
    random.Random(0).shuffle(train)
    for n, c, s in train:
        model.observe(n, c, s)
    model.refit()
    points, errors = [], []
    for n, c, times in curve:
        held = statistics.median(times[1::2])
        pred = model.predict(n, c)
        errors.append(abs(pred - held) / held)
        points.append({"n": n, "context": c, "seconds": held, "predicted": pred})
    return {"median_rel_error": statistics.median(errors), "max_rel_error": max(errors), "points": points}


def stage_split(pipe: Any, prompt: torch.Tensor, new_tokens: int) -> dict[str, float]:
    res = pipe.generate(prompt, max_new_tokens=new_tokens, stop_on_eos=False)
    totals = {k: sum(getattr(s.timings, k) for s in res.steps) for k in STAGES}
    whole = sum(totals.values()) or 1.0
    out = {k: v / whole for k, v in totals.items()}
    out["ms_per_step"] = 1e3 * whole / max(1, len(res.steps))
    out["acceptance_length"] = res.acceptance_length
    return out


def _warm_compiled(target: Any, sizes: list[int], context: int) -> dict[int, float]:
    """Compile (and on CUDA capture) every size's graph: three forwards each, the first one's seconds
    (compile included) per size."""
    from bastion.controllers.latency.calibrate import probe_tree
    from bastion.utils.sync import device_sync

    gen = torch.Generator().manual_seed(1)
    target.prefill(torch.randint(3, target.vocab_size, (1, context), generator=gen))
    first: dict[int, float] = {}
    for n in sizes:
        tree = probe_tree(n, target.vocab_size, gen)
        for r in range(3):  # compile; CUDA graph warm-up; capture
            device_sync(target.device)
            t0 = time.perf_counter()
            target.forward_tree(tree)
            device_sync(target.device)
            if r == 0:
                first[n] = time.perf_counter() - t0
            target.commit(torch.zeros(1, dtype=torch.long))
        print(f"  compiled verify n={n}: first call (compile) {first[n]:.1f} s", flush=True)
    target.reset()
    return first


def compiled_check(pipe: Any, model: Any, prompts: list[torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    """Eager vs compiled verify latency at ``args.compile_sizes`` x ``args.contexts``, compile seconds per
    size, and lossless greedy decoding through the compiled path (whose buckets the controller uses)."""
    from bastion.controllers.latency.calibrate import measure_verify_curve
    from bastion.huggingface.compiled_verify import CompileOptions

    sizes = sorted(set(args.compile_sizes))
    target = pipe.target
    eager = measure_verify_curve(target, sizes, args.contexts, repeats=args.repeats, warmup=2)
    opts = CompileOptions(buckets=tuple(sizes), backend=args.compile_backend)
    try:
        pipe.compile_verify(opts)
        t0 = time.perf_counter()
        first = _warm_compiled(target, sizes, min(args.contexts))
        compile_s = time.perf_counter() - t0
        compiled = measure_verify_curve(target, sizes, args.contexts, repeats=args.repeats, warmup=2)
        lossless = check_lossless(pipe, model, prompts, args.new_tokens, args.tie_tol)
    except Exception as exc:  # a compiler failure is reported, not fatal: the other checks still count
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "backend": args.compile_backend}
    finally:
        pipe.compile_verify(False)
    points = []
    for (n, c, te), (_, _, tc) in zip(eager, compiled):
        e, k = statistics.median(te), statistics.median(tc)
        points.append({"n": n, "context": c, "eager_s": e, "compiled_s": k, "speedup": e / k})
    return {"backend": args.compile_backend, "mode": opts.compile_mode(target.device), "compile_s": compile_s,
            "first_call_s": {str(n): s for n, s in first.items()}, "points": points, "lossless": lossless}


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "runs": []}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        for dname in args.dtypes:
            t0 = time.perf_counter()
            pipe, model = build_pair(shape, DTYPES[dname], args.device)
            vocab = SHAPES[shape]["vocab_size"]
            prompts = [torch.randint(3, vocab, (1, length), generator=gen).to(args.device) for length in args.prompt_lens]
            entry: dict[str, Any] = {"shape": shape, "dtype": dname}
            entry["lossless"] = check_lossless(pipe, model, prompts, args.new_tokens, args.tie_tol)
            entry["lossless_accepting"] = check_lossless(accepting_pipe(model), model, prompts, args.new_tokens, args.tie_tol)
            entry["syncs"] = count_syncs(pipe, prompts[0], args.new_tokens)
            entry["stages"] = stage_split(pipe, prompts[-1], args.new_tokens)
            entry["latency"] = latency_curve(pipe, args.sizes, args.contexts, args.repeats)
            if args.compile_sizes:
                entry["compiled"] = compiled_check(pipe, model, prompts, args)
            entry["seconds"] = time.perf_counter() - t0
            report["runs"].append(entry)
            print(summary_line(entry), flush=True)
            write_report(report, args.out)  # after every run: a run cut short still leaves its results
            del pipe, model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    return report


def summary_line(e: dict[str, Any]) -> str:
    lo, st, ac = e["lossless"], e["stages"], e["lossless_accepting"]
    syncs = e["syncs"]["per_step"]
    return (
        f"{e['shape']:>5} {e['dtype']:>5}: equal {lo['equal']}/{lo['prompts']}, near-ties {lo['near_tie']}, "
        f"real mismatches {lo['real']}; accepting drafter: equal {ac['equal']}/{ac['prompts']}, near-ties "
        f"{ac['near_tie']}, real {ac['real']}, acceptance {ac['acceptance_length']:.2f}; syncs/step {'n/a' if syncs is None else f'{syncs:.1f}'}; "
        f"latency model median error {100 * e['latency']['median_rel_error']:.1f}% "
        f"(max {100 * e['latency']['max_rel_error']:.0f}%); step {st['ms_per_step']:.1f} ms, "
        + ", ".join(f"{k} {100 * st[k]:.0f}%" for k in STAGES)
        + compiled_summary(e.get("compiled"))
    )


def compiled_summary(c: dict[str, Any] | None) -> str:
    if c is None:
        return ""
    if "error" in c:
        return f"; compiled verify FAILED: {c['error'][:300]}"
    lo = c["lossless"]
    speed = ", ".join(f"n={p['n']}@{p['context']} {p['speedup']:.2f}x" for p in c["points"])
    return (f"; compiled verify ({c['backend']}, {c['mode'] or 'default'}, compile {c['compile_s']:.0f} s): "
            f"equal {lo['equal']}/{lo['prompts']}, near-ties {lo['near_tie']}, real {lo['real']}; eager/compiled {speed}")


def write_report(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out / "device_check.md")


def write_markdown(report: dict[str, Any], path: Path) -> None:
    lines = [f"# device check on {report.get('gpu', report['device'])} (torch {report['torch']})", "",
             "| shape | dtype | equal | near-ties | real mismatches | accepting drafter: equal / near-tie / real "
             "(acceptance) | syncs/step | latency median err | step ms | "
             + " | ".join(STAGES) + " |", "|" + "---|" * (9 + len(STAGES))]
    for e in report["runs"]:
        lo, st, syncs, ac = e["lossless"], e["stages"], e["syncs"]["per_step"], e["lossless_accepting"]
        lines.append(
            f"| {e['shape']} | {e['dtype']} | {lo['equal']}/{lo['prompts']} | {lo['near_tie']} | {lo['real']} | "
            f"{ac['equal']} / {ac['near_tie']} / {ac['real']} ({ac['acceptance_length']:.2f}) | "
            f"{'n/a' if syncs is None else f'{syncs:.1f}'} | {100 * e['latency']['median_rel_error']:.1f}% | "
            f"{st['ms_per_step']:.2f} | " + " | ".join(f"{100 * st[k]:.0f}%" for k in STAGES) + " |"
        )
    compiled = [e for e in report["runs"] if e.get("compiled")]
    if compiled:
        lines += ["", "## compiled verify path (eager / compiled verify seconds; > 1 means compiled is faster)", "",
                  "| shape | dtype | n | context | eager ms | compiled ms | speedup | lossless (equal / near-tie / real) | compile s |",
                  "|" + "---|" * 9]
        for e in compiled:
            c = e["compiled"]
            if "error" in c:
                lines.append(f"| {e['shape']} | {e['dtype']} | failed: {c['error'][:200]} | | | | | | |")
                continue
            lo = c["lossless"]
            for p in c["points"]:
                lines.append(
                    f"| {e['shape']} | {e['dtype']} | {p['n']} | {p['context']} | {1e3 * p['eager_s']:.2f} | "
                    f"{1e3 * p['compiled_s']:.2f} | {p['speedup']:.2f}x | {lo['equal']} / {lo['near_tie']} / {lo['real']} | "
                    f"{c['compile_s']:.0f} |"
                )
    path.write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", nargs="+", default=["1.7b", "8b"], choices=sorted(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    ap.add_argument("--tiny", action="store_true", help="the tiny shape, few prompts and sizes: seconds on a CPU")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 200, 900])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tie-tol", type=float, default=2e-2, help="near-tie: logit gap <= tie_tol x max |logit|")
    ap.add_argument("--compile-sizes", type=int, nargs="*", default=None,
                    help="tree sizes the compiled verify path is measured at, one graph each (default 1 16 64; "
                    "none: skip the compiled check)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; eager, i.e. graph capture only, with --tiny on a CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer prompts, sizes, tokens and compiled sizes")
    ap.add_argument("--out", type=Path, default=Path("device-check"))
    args = ap.parse_args(argv)
    if args.compile_sizes is None:
        args.compile_sizes = [1, 16, 64]
    if args.quick:
        args.prompt_lens, args.new_tokens, args.repeats = [16, 900], 32, 2
        args.sizes, args.compile_sizes = [1, 4, 16, 64, 256], [1, 16] if args.compile_sizes == [1, 16, 64] else args.compile_sizes
    if args.tiny:
        args.shapes, args.prompt_lens, args.new_tokens = ["tiny"], [5, 40], 24
        args.sizes, args.contexts, args.repeats = [1, 4, 16, 64], [32, 256], 2
        if args.compile_sizes == [1, 16, 64]:
            args.compile_sizes = [1, 16]
        if args.dtypes == ["fp32", "bf16"] and not args.device.startswith("cuda"):
            args.dtypes = ["fp32"]
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.tiny and not args.device.startswith("cuda") else "inductor"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu (add --tiny for a quick check)", file=sys.stderr)
        return 2
    report = run(args)
    write_report(report, args.out)
    real = sum(e[k]["real"] for e in report["runs"] for k in ("lossless", "lossless_accepting"))
    real += sum(e["compiled"]["lossless"]["real"] for e in report["runs"] if e.get("compiled") and "lossless" in e["compiled"])
    print(f"wrote {args.out / 'device_check.json'} and device_check.md; real mismatches: {real}")
    return 1 if real else 0


if __name__ == "__main__":
    raise SystemExit(main())
