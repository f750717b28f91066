"""Per-step time split of the decode loop at a fixed budget on a tiny target.

Decodes with the noisy-oracle drafter, the best-first builder and the fixed controller, and splits each
step into: draft (drafter forward passes), target forward (the model call alone), mask/position
preparation, tree build, controller, verification walk, KV commit and the remaining bookkeeping.
Everything except the drafter and the target forward counts as pipeline overhead.

    python benchmarks/step_overhead.py --budget 64 --new-tokens 128
"""

from __future__ import annotations

import argparse
import time

import torch

import bastion
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


class TimedTarget(HFTarget):
    """HFTarget that also records the seconds spent inside the model call of each tree forward."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.model_s = 0.0
        self._in_tree = False

    def forward_tree(self, tree, feature_layers=()):
        self._in_tree = True
        try:
            return super().forward_tree(tree, feature_layers)
        finally:
            self._in_tree = False

    def _forward(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = super()._forward(*args, **kwargs)
        if self._in_tree:
            self.model_s += time.perf_counter() - t0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--block", type=int, default=16, help="drafter depth K")
    ap.add_argument("--noise", type=float, default=0.6)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64, help="tiny target hidden size (64 = the test model)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = tiny_model(
        "qwen3", seed=0, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, head_dim=args.hidden // 4, max_position_embeddings=2048,
    )
    target = TimedTarget(model)
    pipe = bastion.Pipeline(
        target,
        NoisyOracleDrafter(model, block_size=args.block, noise=args.noise),
        tree_builder="best-first",
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=args.budget),
        max_nodes=args.budget,
    )
    gen = torch.Generator().manual_seed(0)
    pipe.generate(torch.randint(3, 256, (1, 16), generator=gen), max_new_tokens=16)  # warm-up
    totals = dict(draft=0.0, model=0.0, prep=0.0, tree=0.0, controller=0.0, accept=0.0, commit=0.0, other=0.0)
    steps = budget_sum = 0
    tokens = 0
    for _ in range(args.prompts):
        target.model_s = 0.0
        t0 = time.perf_counter()
        res = pipe.generate(torch.randint(3, 256, (1, 32), generator=gen), max_new_tokens=args.new_tokens, stop_on_eos=False)
        loop_s = time.perf_counter() - t0 - res.prefill_s
        stage_s = sum(s.timings.total for s in res.steps)
        verify_s = sum(s.timings.verify for s in res.steps)
        totals["model"] += target.model_s
        totals["prep"] += verify_s - target.model_s
        for s in res.steps:
            for k in ("draft", "tree", "controller", "accept", "commit", "other"):
                totals[k] += getattr(s.timings, k)
        totals["other"] += loop_s - stage_s  # loop bookkeeping outside the step (emission, EOS scan)
        steps += len(res.steps)
        budget_sum += sum(s.budget for s in res.steps)
        tokens += len(res.tokens)
    step_ms = {k: v / steps * 1e3 for k, v in totals.items()}
    total = sum(step_ms.values())
    overhead = total - step_ms["draft"] - step_ms["model"]
    print(f"target hidden {args.hidden}, {args.layers} layers; budget {args.budget}; {steps} steps, "
          f"mean verified nodes {budget_sum / steps:.1f}, tokens/step {tokens / steps:.2f}")
    print(f"{'stage':<12} {'ms/step':>8} {'share':>7}")
    for k, v in step_ms.items():
        print(f"{k:<12} {v:>8.3f} {v / total:>7.1%}")
    print(f"{'step total':<12} {total:>8.3f}")
    print(f"overhead outside drafter and target forward: {overhead:.3f} ms/step = {overhead / total:.1%} of the step")


if __name__ == "__main__":
    main()
