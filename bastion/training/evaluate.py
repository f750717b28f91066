"""Held-out acceptance evaluation during drafter training, through the code path of ``bastion bench``.

Training accuracy is not what decides speed; acceptance length is. So the recipe measures, on held-out
prompts, the figures ``bastion bench`` reports: the mean tokens committed per step of the drafter's
top-1 ``chain`` and of ``best-first@N`` trees, decoded losslessly against the frozen target. It calls
:func:`bastion.bench.runner.run_bench` on the model being trained, so a logged figure equals what
``bastion bench --methods ar,chain,best-first@N`` measures on the saved checkpoint for the same prompts.
"""

from __future__ import annotations

from typing import Any

import attrs
from attrs import field, frozen

from bastion.contract.errors import InvalidInputError

__all__ = ["AcceptanceEvalConfig", "acceptance_eval"]


def _budgets(value: Any) -> tuple[int, ...]:
    out = tuple(int(v) for v in value)
    if any(b < 1 for b in out):
        raise InvalidInputError(f"best-first budgets must be >= 1, got {list(out)}")
    return out


@frozen
class AcceptanceEvalConfig:
    """Which held-out prompts (``bastion bench`` dataset specs) and which methods to measure."""

    datasets: tuple[str, ...] = field(default=("gsm8k", "humaneval", "mt_bench"), converter=tuple)
    limit: int = field(default=10, validator=attrs.validators.ge(1))  # prompts per dataset
    max_new_tokens: int = field(default=64, validator=attrs.validators.ge(1))
    budgets: tuple[int, ...] = field(default=(16, 64), converter=_budgets)  # best-first@N
    data_dir: str | None = None

    @property
    def methods(self) -> tuple[str, ...]:
        """The bench methods measured (``ar`` is the reference every bench run needs)."""
        return ("ar", "chain", *(f"best-first@{b}" for b in self.budgets))

    def bench_config(self) -> Any:
        from bastion.bench.runner import BenchConfig

        return BenchConfig(
            datasets=self.datasets,
            methods=self.methods,
            limit=self.limit,
            max_new_tokens=self.max_new_tokens,
            warmup_tokens=0,
            repeats=1,
            data_dir=None if self.data_dir is None else str(self.data_dir),
        )


def acceptance_eval(target_model: Any, draft_model: Any, tokenizer: Any, config: AcceptanceEvalConfig) -> dict[str, Any]:
    """``{"chain": A, "best-first@N": A, ..., "lossless": bool}``: pooled acceptance lengths (tokens per
    step, bonus included) of ``draft_model`` (a :class:`DFlashDraftModel`) with ``target_model`` (an HF
    causal LM) on the held-out prompts. ``lossless`` says every method's output equalled the target's
    own greedy decoding. The draft model is left in train mode afterwards."""
    from bastion.bench.metrics import ALL_DATASETS
    from bastion.bench.runner import run_bench
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.drafters.dflash import DFlashDrafter

    was_training = draft_model.training
    try:
        target = HFTarget(target_model)
        drafter = DFlashDrafter(draft_model, device=target.device, dtype=None)
        run = run_bench(config.bench_config(), target, drafter, tokenizer, progress=False)
    finally:
        draft_model.train(was_training)
    pooled = [s for s in run.stats if s.dataset == ALL_DATASETS] or list(run.stats)  # one dataset: no "all" rows
    out: dict[str, Any] = {}
    lossless = True
    for s in pooled:
        if s.method == "ar":
            continue
        out[s.method] = round(s.acceptance_length, 4)
        lossless = lossless and s.equal_to_ref == s.prompts
    out["lossless"] = lossless
    return out
