"""The state one request owns while it decodes in the engine.

A :class:`Request` holds everything that belongs to one generation and nothing that belongs to the
pipeline: its prompt, its :class:`~bastion.engine.params.GenerationConfig`, its seeded random stream,
the tokens and text committed so far, its stop tracking, its step records and its timestamps. The
engine keeps the request's rows of the target and drafter caches in its batch states, aligned with the
order of its running requests; a request that finishes or is cancelled leaves them at the next step.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Literal

import attrs
import torch
from attrs import field, frozen

from bastion.contract.sampling import PositionalStream, seeded_generator
from bastion.utils.text import TextTracker
from bastion.contract.types import GenerationResult, SamplingConfig, StepRecord
from bastion.engine.params import GenerationConfig

__all__ = ["Request", "StepSummary", "StepUpdate", "StopReason"]

#: why a request ended ("cancelled" and "error" only happen in the engine: a caller cancelled it, or a
#: component raised during one of its steps)
StopReason = Literal["eos", "length", "stop", "position-limit", "cancelled", "error"]

_ids = itertools.count(1)


class Request:
    """One generation in the engine: its settings and everything it has produced so far."""

    def __init__(
        self,
        prompt: torch.Tensor,  # [L] long, checked, on the target's device
        config: GenerationConfig,
        *,
        tokenizer: Any = None,
        text: bool = False,
        on_step: Callable[[StepRecord], Any] | None = None,
        request_id: Any = None,
        device: torch.device | None = None,
    ) -> None:
        self.id: Any = next(_ids) if request_id is None else request_id
        self.prompt = prompt
        self.prompt_len = int(prompt.shape[0])
        self.config = config
        self.on_step = on_step
        sampling = config.sampling
        self.rule: SamplingConfig = sampling.rule
        #: the request's seeded per-position stream (None: greedy); its draws do not depend on the batch
        self.stream: PositionalStream | None = None if sampling.greedy else PositionalStream.from_seed(sampling.seed)
        #: for verifiers that draw by themselves instead of through the stream's uniforms
        self.generator: torch.Generator | None = (
            None if self.stream is None else seeded_generator(self.stream.seed, device or prompt.device)
        )
        self.tracker: TextTracker | None = TextTracker(tokenizer, config.stop) if (text or config.stop) else None
        self.emit_text = bool(text)
        self.tokens: list[int] = []
        self.steps: list[StepRecord] = []
        self.root = -1  # the last committed token, not yet in the target's cache (the next step's root)
        self.stop_reason: StopReason | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.cancel_requested = False
        self.pending_chunk = ""  # text released by the first token, reported with the join
        self.prefill_s = 0.0
        self.t_queued = time.perf_counter()
        self.t_admitted: float | None = None
        self.t_first_token: float | None = None
        self.t_finished: float | None = None

    # ---------------------------------------------------------------- views
    @property
    def text(self) -> str:
        """The text released so far (needs a tokenizer; empty without one)."""
        return "" if self.tracker is None else self.tracker.text

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    @property
    def eos(self) -> frozenset[int]:
        return self._eos

    def bind_eos(self, eos: frozenset[int]) -> None:
        self._eos = eos if self.config.stop_on_eos else frozenset()

    def __repr__(self) -> str:
        state = self.stop_reason or ("running" if self.t_admitted is not None else "waiting")
        return f"Request(id={self.id!r}, prompt_len={self.prompt_len}, tokens={len(self.tokens)}, {state})"

    # ---------------------------------------------------------------- commits
    def emit(self, tokens: list[int], committed: int, max_positions: int) -> tuple[list[int], str]:
        """Append one step's tokens, cut at ``max_new_tokens``, at an end-of-sequence token and at a
        stop string -> (the tokens kept, the text released). ``committed`` is the position of the next
        root (the target's committed length after this step): at ``max_positions`` no position is left."""
        limit = self.config.max_new_tokens
        kept = list(tokens)[: limit - len(self.tokens)]
        for k, tok in enumerate(kept):
            if tok in self._eos:
                kept = kept[: k + 1]
                self.stop_reason = "eos"
                break
        chunk = ""
        if self.tracker is not None:
            before = len(self.tracker.tokens)
            chunk = self.tracker.push(kept)
            if self.tracker.stopped:  # keep the tokens up to the one that completed the stop string
                kept = kept[: int(self.tracker.stop_tokens or 0) - before]
                self.stop_reason = "stop"
        self.tokens.extend(kept)
        self.root = tokens[-1] if tokens else self.root
        if self.stop_reason is None:
            if len(self.tokens) >= limit:
                self.stop_reason = "length"
            elif committed >= max_positions:
                self.stop_reason = "position-limit"
        if self.t_first_token is None and kept:
            self.t_first_token = time.perf_counter()
        return kept, chunk if self.emit_text else ""

    def stop_after(self, n: int) -> None:
        """End the request keeping its first ``n`` tokens (a caller's own stop, e.g. the ``send(k)`` of
        :meth:`bastion.Pipeline.decode_steps`); the last step's record counts only what it kept. It
        leaves the engine's batch at the next step, with ``stop_reason`` ``"stop"``."""
        cut = len(self.tokens) - n
        if cut > 0:
            del self.tokens[n:]
            if self.steps:
                last = self.steps[-1]
                self.steps[-1] = attrs.evolve(last, emitted=max(last.emitted - cut, 0))
        self.stop_reason = "stop"

    def finish(self, reason: StopReason | None = None, error: BaseException | None = None) -> str:
        """Close the request (``reason`` overrides a stop found earlier) -> the text still held back."""
        if reason is not None:
            self.stop_reason = reason
        self.error = error
        self.t_finished = time.perf_counter()
        tail = ""
        if self.tracker is not None:
            tail = self.tracker.finish()
        # from the start of its prefill (a queue wait excluded), as a generation's wall time counts it
        start = self.t_queued if self.t_admitted is None else self.t_admitted - self.prefill_s
        self.result = GenerationResult(
            tokens=list(self.tokens),
            steps=tuple(self.steps),
            prompt_len=self.prompt_len,
            prefill_s=self.prefill_s,
            wall_s=self.t_finished - start,
            stop_reason=self.stop_reason or "length",  # type: ignore[arg-type]
            text=None if self.tracker is None else self.tracker.text,
        )
        return tail if self.emit_text else ""


@frozen
class StepUpdate:
    """What one engine step did for one request: the tokens it committed, the text they released
    (empty unless the request asked for text), whether the request ended, and why it failed if it did."""

    request: Request = field(eq=False)
    tokens: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    error: BaseException | None = field(default=None, eq=False)


@frozen
class StepSummary:
    """One engine step as a whole (for metrics): rows decoded, tree nodes verified per row (1 = plain
    decoding), whether it drafted, tokens committed over all rows, wall seconds."""

    batch_size: int
    width: int
    drafted: bool
    emitted: int
    seconds: float
    admitted: int = 0
