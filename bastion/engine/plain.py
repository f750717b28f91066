"""Plain batched decoding with the target alone, on the engine: the ``ar`` baseline at batch size > 1.

:func:`decode_plain_batch` runs :class:`bastion.engine.Engine` over a target and the components plain
decoding needs (the ``exact`` verifier's next-token rule, the ``plain`` controller, no drafter, no
latency model), so the baseline steps exactly as a speculative batch's plain steps do: one forward per
step over every active row's next token, in the same padded cache, finished rows leave.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from bastion.engine.costs import BatchCosts
from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import LatencyModel
from bastion.contract.target import Target
from bastion.contract.types import GenerationResult, SamplingConfig
from bastion.engine.engine import Engine
from bastion.engine.params import GenerationConfig, SamplingParams

__all__ = ["decode_plain_batch"]


class _NoLatency(LatencyModel):
    """Plain decoding predicts nothing: measured verify times are dropped."""

    def predict(self, n_tokens: int, context_len: int) -> float:
        return 0.0

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        return None


class PlainComponents:
    """The components the engine reads to decode with ``target`` alone (no drafter, no tokenizer)."""

    def __init__(self, target: Target) -> None:
        from bastion.contract.registry import registry

        self.target = target
        self.tokenizer: Any = None
        self.drafter: Any = None
        self.verifier = registry.create("verifier", "exact")
        self.budget_controller = registry.create("budget_controller", "plain")
        self.latency_model = _NoLatency()
        self._batch_costs = BatchCosts()

    def _check_prompt(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise InvalidInputError(f"a prompt must be a non-empty LongTensor [1, L], got {getattr(ids, 'shape', type(ids).__name__)}")
        return ids.to(self.target.device, torch.long)


def decode_plain_batch(
    target: Target,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seeds: Sequence[int | None],
    stop_on_eos: bool = True,
) -> list[GenerationResult] | None:
    """Decode ``prompts`` (each LongTensor [1, L_i]) with the target alone in one engine batch; row i
    seeded with ``seeds[i]``. ``None`` when the target has no batched state."""
    if type(target).open_batch is Target.open_batch:
        return None
    engine = Engine(PlainComponents(target), prefill_tokens=max(int(p.shape[-1]) for p in prompts) * len(prompts))  # type: ignore[arg-type]
    requests = [
        engine.add(
            p,
            GenerationConfig(
                max_new_tokens=max_new_tokens,
                sampling=SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=seed),
                stop_on_eos=stop_on_eos,
            ),
        )
        for p, seed in zip(prompts, seeds)
    ]
    engine.run()
    out = []
    for r in requests:
        if r.error is not None:
            raise r.error
        out.append(r.result)
    return out
