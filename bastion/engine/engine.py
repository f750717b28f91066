"""The engine: one batch-first decode step over the requests running now; requests join and leave
between steps.

Each :meth:`Engine.step` first admits waiting requests (their prompts prefilled together in one
forward, at most ``prefill_tokens`` prompt tokens per step so one long prompt does not stall the rows
already decoding for long, then stacked into the running batch's target and drafter caches), then
decodes one step for every running row:

    draft -> build -> decide -> verify -> commit

The budget controller decides one tree width W for the rows running now (row i verifies its first
``min(W, n_i)`` nodes); W = 1 with no draft is plain decoding, a decision like any other, so the
``plain`` controller (never drafts) is speculation off on the same engine. Rows that finish (end of
sequence, ``max_new_tokens``, a stop string, the position limit) or are cancelled leave the batch
states before the next step, so no compute is spent on them and their cache rows are freed.

Each request owns its state (:class:`~bastion.engine.request.Request`): its output is exactly what it
gives decoded alone (greedy), and at T > 0 its seeded positional stream draws the same samples whatever
the batch, the trees or the timings (in float32; see docs/verification.md for lower precisions). The engine is not thread-safe: one thread owns it (the server's
engine thread, or the caller of ``Pipeline.generate_batch``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import attrs
import torch

from bastion.contract.batch_state import DraftBatch, SoloDraftBatch, SoloTargetBatch, TargetBatch
from bastion.engine.blame import plugin_of
from bastion.contract.candidates import CandidateTree
from bastion.utils.checks import check_built_tree, check_decision, check_greedy_verdict, check_next_tokens, check_verdict
from bastion.contract.errors import BastionError, ComponentError, IncompatibleComponentsError, InvalidInputError
from bastion.contract.interfaces import BatchStepCosts, BudgetDecision
from bastion.contract.sampling import at_position, sample_tokens
from bastion.utils.sync import device_sync, to_host
from bastion.contract.tree import Tree
from bastion.contract.types import DraftContext, DraftStep, Marginals, StepRecord, Verdict
from bastion.engine.params import GenerationConfig
from bastion.engine.observer import StageClock, StepObserver
from bastion.engine.request import Request, StepSummary, StepUpdate


__all__ = ["Engine"]

class Engine:
    """Continuous batched decoding over a :class:`~bastion.Pipeline`'s components (see the module doc);
    ``pipe`` is a pipeline, or any object with the components and checks the engine reads from one
    (:class:`bastion.engine.plain.PlainComponents` for the target alone).

    ``max_running`` bounds the rows decoding at once (None: no bound); ``prefill_tokens`` the prompt
    tokens admitted per step (a longer prompt is admitted alone); ``prefill_chunk`` (None: off) splits a
    prompt longer than it into chunks prefilled one per step beside the running rows' decoding, so a
    long prompt stalls the others by one chunk's forward at a time, not by its whole prefill."""

    def __init__(
        self,
        pipe: Any,
        *,
        max_running: int | None = None,
        prefill_tokens: int = 4096,
        prefill_chunk: int | None = None,
        solo: bool = False,
    ) -> None:
        if max_running is not None and (isinstance(max_running, bool) or not isinstance(max_running, int) or max_running < 1):
            raise InvalidInputError(f"max_running must be an int >= 1 or None, got {max_running!r}")
        if isinstance(prefill_tokens, bool) or not isinstance(prefill_tokens, int) or prefill_tokens < 1:
            raise InvalidInputError(f"prefill_tokens must be an int >= 1, got {prefill_tokens!r}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise InvalidInputError(f"prefill_chunk must be an int >= 1 or None, got {prefill_chunk!r}")
        self.pipe = pipe
        #: one row at a time on the target's and drafter's own single-sequence state (the caller owns it)
        self.solo = bool(solo)
        if self.solo:
            max_running, prefill_chunk = 1, None
        self.max_running = max_running
        self.prefill_tokens = prefill_tokens
        self.prefill_chunk = prefill_chunk
        self._chunked: _Chunked | None = None  # the long prompt being prefilled chunk by chunk
        controller = pipe.budget_controller
        #: whether any step may draft (False for a never-drafting controller: the drafter is not run at all)
        self.drafts = bool(getattr(controller, "drafts", True))
        self._layers: tuple[int, ...] = tuple(pipe.drafter.feature_layers) if self.drafts else ()
        self._waiting: list[Request] = []
        self._rows: list[Request] = []  # running requests, in batch-row order
        self._tb: TargetBatch | None = None
        self._drafts: DraftBatch | None = None
        #: timings -> what the latency model, the controller and the cost models learn, and the records
        self.observer = StepObserver(pipe, self.drafts)
        self.last_step: StepSummary | None = None
        self.steps = 0

    # ---------------------------------------------------------------- requests
    @property
    def running(self) -> tuple[Request, ...]:
        return tuple(self._rows)

    @property
    def waiting(self) -> tuple[Request, ...]:
        return tuple(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._rows and not self._waiting and self._chunked is None

    def add(
        self,
        prompt: Any,
        config: GenerationConfig | None = None,
        *,
        text: bool = False,
        on_step: Callable[[StepRecord], Any] | None = None,
        request_id: Any = None,
    ) -> Request:
        """Queue one request (token ids: a list of ints, a 1-D or [1, L] tensor) -> its
        :class:`Request`; it joins the running batch at a coming :meth:`step`. Checks the prompt and the
        settings now (:class:`InvalidInputError`)."""
        pipe = self.pipe
        config = GenerationConfig() if config is None else config
        if not isinstance(config, GenerationConfig):
            raise InvalidInputError(f"config must be a bastion.GenerationConfig, got {type(config).__name__}")
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            prompt = prompt[None]
        ids = pipe._check_prompt(prompt)  # [1, L] on the target's device
        if not config.sampling.greedy and not pipe.verifier.supports_sampling:
            raise InvalidInputError(f"verifier {type(pipe.verifier).__name__} supports greedy decoding only")
        if (text or config.stop) and pipe.tokenizer is None:
            raise InvalidInputError("stop strings and text output need a tokenizer; this pipeline has none")
        if on_step is not None and not callable(on_step):
            raise InvalidInputError(f"on_step must be callable, got {type(on_step).__name__}")
        request = Request(
            ids[0], config, tokenizer=pipe.tokenizer, text=text, on_step=on_step, request_id=request_id,
            device=pipe.target.device,
        )
        request.bind_eos(pipe.target.eos_token_ids)
        self._waiting.append(request)
        return request

    def cancel(self, request: Request) -> None:
        """End ``request``: a waiting one is dropped now, a running one leaves the batch at the next step
        (its cache rows freed); either way its ``stop_reason`` becomes ``"cancelled"``. Finished
        requests are left as they are."""
        if request.finished:
            return
        if request in self._waiting:
            self._waiting.remove(request)
            request.finish("cancelled")
        elif self._chunked is not None and self._chunked.request is request:
            self._chunked = None
            request.finish("cancelled")
        else:
            request.cancel_requested = True

    def run(self) -> None:
        """Step until every queued and running request has finished."""
        while not self.idle:
            self.step()

    # ---------------------------------------------------------------- the step
    def step(self, on_admitted: Callable[[list[StepUpdate]], Any] | None = None) -> list[StepUpdate]:
        """Admit waiting requests, then decode one step for every running row -> one update per
        request that committed tokens, finished or failed. A component that raises fails the requests
        of that step (``stop_reason`` ``"error"``, the error names the component) and the engine goes on
        with the next requests.

        ``on_admitted``: called, before the step decodes, with the updates admission produced (each
        newcomer's first token, drawn from its prefill, and the rows that left); those updates are then
        not in the returned list. A server hands newcomers their first token this way instead of one
        decode step later."""
        updates: list[StepUpdate] = []
        t0 = time.perf_counter()
        self._leave(updates)
        admitted = self._admit(updates)
        if admitted:
            self._leave(updates)  # a newcomer whose first token ended it (EOS, max_new_tokens 1) leaves now
            if on_admitted is not None and self._rows:
                on_admitted(updates)
                updates = []
        if not self._rows:
            self.last_step = None
            return updates
        self.steps += 1
        stage = _Stage(getattr(self.pipe, "registry", None))
        try:
            summary = self._decode(updates, stage)
        except Exception as exc:  # noqa: BLE001 - a component broke: fail this step's requests only
            error = stage.error(exc)
            for request in self._rows:
                tail = request.finish("error", error)
                updates.append(StepUpdate(request, (), tail, True, error))
            self._rows, self._tb, self._drafts = [], None, None
            self.last_step = None
            return updates
        self.last_step = StepSummary(
            batch_size=summary[0], width=summary[1], drafted=summary[2], emitted=summary[3],
            seconds=time.perf_counter() - t0, admitted=admitted,
        )
        self._leave(updates)
        return updates

    # ---------------------------------------------------------------- joining and leaving
    def _admit(self, updates: list[StepUpdate]) -> int:
        """Prefill the waiting requests that fit and stack them into the running batch -> how many joined.

        Prompts up to ``prefill_chunk`` tokens are prefilled together, at most ``prefill_tokens`` prompt
        tokens per step; a longer prompt is prefilled one chunk per step (one at a time) while the
        running rows keep decoding, and joins when its last chunk is in."""
        if not self._waiting and self._chunked is None:  # nothing to admit (most steps)
            return 0
        if self._rows and not self._can_join():  # the batch states cannot take rows in: wait for a drain
            return 0
        joined = 0
        budget = self.prefill_tokens
        if self._chunked is not None:
            budget -= self.prefill_chunk or 0
            joined += self._advance_chunked(updates)
        if not self._waiting:
            return joined
        busy = len(self._rows) + (0 if self._chunked is None else 1)
        room = len(self._waiting) if self.max_running is None else self.max_running - busy
        batch: list[Request] = []
        tokens = 0
        for request in self._waiting[: max(room, 0)]:
            if self._long(request):
                if batch or self._chunked is not None or budget < (self.prefill_chunk or 0):
                    break
                self._waiting.remove(request)
                self._start_chunked(request, updates)
                return joined
            if (batch or joined or self._chunked is not None) and tokens + request.prompt_len > budget:
                break
            batch.append(request)
            tokens += request.prompt_len
        if not batch:
            return joined
        del self._waiting[: len(batch)]
        stage = _Stage(getattr(self.pipe, "registry", None))
        t0 = time.perf_counter()
        try:
            tb, pre = self._open([r.prompt for r in batch], stage)
            features = None if pre.features is None else list(pre.features)
            self._join(batch, tb, pre.last_logits, features, t0, stage)
        except Exception as exc:  # noqa: BLE001 - the newcomers fail; the running batch is untouched
            error = stage.error(exc)
            for request in batch:
                updates.append(StepUpdate(request, (), request.finish("error", error), True, error))
            return joined
        for request in batch:
            updates.append(StepUpdate(request, tuple(request.tokens), request.pending_chunk, False))
        return joined + len(batch)

    def _long(self, request: Request) -> bool:
        return self.prefill_chunk is not None and request.prompt_len > self.prefill_chunk

    def _open(self, prompts: list[torch.Tensor], stage: "_Stage") -> tuple[TargetBatch, Any]:
        pipe = self.pipe
        if self.solo:
            stage.at("target", pipe.target, "prefill")
            (prompt,) = prompts
            return SoloTargetBatch.open(pipe.target, prompt, self._layers)
        stage.at("target", pipe.target, "open_batch")
        opened = pipe.target.open_batch(prompts, self._layers)
        if opened is None:
            raise IncompatibleComponentsError(
                f"the target {type(pipe.target).__name__} has no batched state (open_batch returned None); the engine needs one"
            )
        return opened

    def _join(
        self,
        batch: list[Request],
        tb: TargetBatch,
        last_logits: torch.Tensor,  # [B, V] after each newcomer's last prompt token
        features: list[torch.Tensor] | None,  # per newcomer [L_i, F], or None
        t0: float,
        stage: "_Stage",
    ) -> None:
        """Sample the newcomers' first tokens, open their draft contexts and stack both into the batch."""
        pipe = self.pipe
        roots = self._first_tokens(last_logits, batch)
        drafts = None
        if self.drafts:
            copy = getattr(pipe, "copy_contexts", False)  # a plugin drafter gets copies of the prompts
            contexts = [
                DraftContext(tokens=r.prompt.clone() if copy else r.prompt, features=None if features is None else features[i])
                for i, r in enumerate(batch)
            ]
            if self.solo and _own_sequence_state(pipe.drafter):
                stage.at("drafter", pipe.drafter, "begin")
                drafts = SoloDraftBatch(pipe.drafter, contexts[0])
            else:
                stage.at("drafter", pipe.drafter, "open_batch")
                drafts = pipe.drafter.open_batch(contexts)
        device_sync(pipe.target.device)
        now = time.perf_counter()
        for request, root in zip(batch, roots):
            request.t_admitted = now
            request.prefill_s = now - t0
            request.pending_chunk = request.emit([root], request.prompt_len, pipe.target.max_positions)[1]
        if self._tb is None:
            self._tb, self._drafts = tb, drafts
        else:
            self._tb.extend(tb)
            if self._drafts is not None and drafts is not None:
                self._drafts.extend(drafts)
        self._rows.extend(batch)
        self.observer.joined = True  # the next draft catches the drafter up on the newcomers' prompts
        self._begin_batch()

    def _start_chunked(self, request: Request, updates: list[StepUpdate]) -> None:
        """Prefill the first chunk of a long prompt into a state of its own."""
        stage = _Stage(getattr(self.pipe, "registry", None))
        chunk = self.prefill_chunk or request.prompt_len
        t0 = time.perf_counter()
        try:
            tb, pre = self._open([request.prompt[:chunk]], stage)
        except Exception as exc:  # noqa: BLE001 - this request fails; the running batch is untouched
            error = stage.error(exc)
            updates.append(StepUpdate(request, (), request.finish("error", error), True, error))
            return
        feats = [] if pre.features is None else [pre.features[0]]
        self._chunked = _Chunked(request, tb, chunk, feats, pre.last_logits, t0)

    def _advance_chunked(self, updates: list[StepUpdate]) -> int:
        """One more chunk of the long prompt being prefilled (a chain through the target); joins it to
        the batch after its last chunk -> 1 when it joined."""
        state = self._chunked
        assert state is not None
        request = state.request
        if request.cancel_requested:
            self._chunked = None
            updates.append(StepUpdate(request, (), request.finish("cancelled"), True))
            return 0
        stage = _Stage(getattr(self.pipe, "registry", None))
        try:
            if state.done < request.prompt_len:
                end = min(state.done + (self.prefill_chunk or request.prompt_len), request.prompt_len)
                piece = request.prompt[state.done : end]  # [k] the next prompt tokens, a chain below the first
                stage.at("target", self.pipe.target, "prefill_more")
                state.last_logits, feats = state.tb.prefill_more(piece, self._layers)  # [1, V], [k, F] or None
                if feats is not None:
                    state.features.append(feats)
                state.done = end
            if state.done < request.prompt_len:
                return 0
            self._chunked = None
            features = [torch.cat(state.features, dim=0)] if state.features else None
            self._join([request], state.tb, state.last_logits, features, state.t0, stage)
        except Exception as exc:  # noqa: BLE001 - this request fails; the running batch is untouched
            self._chunked = None
            error = stage.error(exc)
            updates.append(StepUpdate(request, (), request.finish("error", error), True, error))
            return 0
        updates.append(StepUpdate(request, tuple(request.tokens), request.pending_chunk, False))
        return 1

    def _can_join(self) -> bool:
        tb_ok = self._tb is not None and type(self._tb).extend is not TargetBatch.extend
        drafts_ok = self._drafts is None or type(self._drafts).extend is not DraftBatch.extend
        return tb_ok and drafts_ok

    def _begin_batch(self) -> None:
        """Tell the controller the batch (re)started at its current size (a batch of one: a sequence)."""
        self.pipe.budget_controller.begin_batch(self._rows[0].rule, len(self._rows))

    def _leave(self, updates: list[StepUpdate]) -> None:
        """Finished and cancelled rows leave the batch states."""
        keep = [k for k, r in enumerate(self._rows) if not r.finished and not r.cancel_requested]
        if len(keep) == len(self._rows):
            return
        for request in self._rows:
            if request.cancel_requested and not request.finished:
                updates.append(StepUpdate(request, (), request.finish("cancelled"), True))
            elif request.finished and request.result is None:
                tail = request.finish()
                updates.append(StepUpdate(request, (), tail, True))
        self._rows = [self._rows[k] for k in keep]
        if not self._rows:
            self._tb, self._drafts = None, None
            return
        assert self._tb is not None
        self._tb.keep(keep)
        if self._drafts is not None:
            self._drafts.keep(keep)
        self._begin_batch()  # the controller's state of the batch size running now (a batch of one: a sequence's)

    def _first_tokens(self, last_logits: torch.Tensor, batch: Sequence[Request]) -> list[int]:
        """Each newcomer's first token from its prompt's last logits [B, V] (the draw of position L)."""
        if all(r.stream is None for r in batch):
            return to_host(last_logits.argmax(dim=-1), "prefill")  # [B]
        return [
            int(sample_tokens(last_logits[i], at_position(r.rule, r.stream, r.prompt_len), r.generator))
            for i, r in enumerate(batch)
        ]

    # ---------------------------------------------------------------- one decode step
    def _decode(self, updates: list[StepUpdate], stage: "_Stage") -> tuple[int, int, bool, int]:
        """One step for every running row -> (batch size, width, drafted, tokens committed)."""
        pipe = self.pipe
        assert self._tb is not None
        clock = StageClock(time.perf_counter())
        rows = self._rows
        ctxs = self._tb.context_lens
        limit = pipe.target.max_positions
        depths = [min(limit - ctx - 1, r.config.max_new_tokens - len(r.tokens) - 1) for r, ctx in zip(rows, ctxs)]
        drafted = self.drafts and any(d >= 1 for d in depths) and self._speculate(ctxs, stage)
        clock.mark("controller")
        if drafted:
            width, emitted = self._speculative(rows, ctxs, depths, clock, updates, stage)
        else:
            width, emitted = 1, self._plain(rows, ctxs, clock, updates, stage)
        return len(rows), width, drafted, emitted

    def _speculate(self, ctxs: list[int], stage: "_Stage") -> bool:
        """The controller's answer to "does this step draft?" (a batch of one: a single sequence's)."""
        pipe = self.pipe
        controller = pipe.budget_controller
        b = len(ctxs)
        costs = pipe._batch_costs
        stage.at("budget_controller", controller, "speculate_batch")
        step_costs = BatchStepCosts(costs.other(b), costs.draft(b), costs.plain(b), costs.plain.count(b))
        return bool(controller.speculate_batch(ctxs, pipe.latency_model, step_costs))

    def _plain(self, rows: list[Request], ctxs: list[int], clock: StageClock, updates: list[StepUpdate], stage: "_Stage") -> int:
        """The target alone: one forward over every row's root, each row's next token, and the drafter
        kept current from the features that forward produced; O(1) device work and host reads."""
        pipe = self.pipe
        tb = self._tb
        assert tb is not None
        roots = [r.root for r in rows]
        roots_t = torch.tensor(roots)  # [B] on the host (a batch of one reads it back without a device wait)
        stage.at("target", pipe.target, "forward_next")
        out = tb.forward_next(roots_t, self._layers)  # logits [B, 1, V]
        tb.commit_next()
        tokens = self._next_tokens(rows, ctxs, roots, out.logits[:, 0], stage)
        clock.mark("verify")  # forward, commit and the read of its tokens
        if self._drafts is not None:
            stage.at("drafter", pipe.drafter, "commit_next")
            self._drafts.commit_next(roots_t, None if out.features is None else out.features[:, 0])
        clock.mark("commit")
        records = self.observer.plain(ctxs, clock, stage)
        emitted = sum(
            self._commit_row(request, [tok], ctx + 1, record, updates) for request, tok, ctx, record in zip(rows, tokens, ctxs, records)
        )
        self.observer.plain_done(len(rows), clock)
        return emitted

    def _next_tokens(self, rows: list[Request], ctxs: list[int], roots: list[int], logits: torch.Tensor, stage: "_Stage") -> list[int]:
        """Each row's next token from the target's logits after its root [B, V] (the verifier's plain path;
        with strict verdicts a greedy row's token is checked against the target's argmax)."""
        pipe = self.pipe
        # row i's token sits at position ctx_i + 1 of its own seeded stream (a one-node tree's uniforms [1])
        row_sampling = [r.rule if r.stream is None else at_position(r.rule, r.stream, ctx + 1, rows=1) for r, ctx in zip(rows, ctxs)]
        stage.at("verifier", pipe.verifier, "next_tokens")
        tokens = pipe.verifier.next_tokens(roots, logits, row_sampling, [r.generator for r in rows])
        tokens = check_next_tokens(tokens, len(rows), logits.shape[-1], pipe.verifier)
        if getattr(pipe, "strict_verdicts", False) and any(r.stream is None for r in rows):
            best = to_host(logits.argmax(dim=-1), "strict greedy check")  # [B]
            for r, tok, want in zip(rows, tokens, best):
                if r.stream is None and tok != want:
                    raise ComponentError(f"verifier {type(pipe.verifier).__name__}: next token {tok} is not the target's argmax {want}")
        return tokens

    def _speculative(
        self, rows: list[Request], ctxs: list[int], depths: list[int], clock: StageClock, updates: list[StepUpdate], stage: "_Stage"
    ) -> tuple[int, int]:
        """draft -> build -> decide -> verify -> commit, for every row at once; one width for the batch."""
        tb, drafts = self._tb, self._drafts
        assert tb is not None and drafts is not None
        proposals = self._draft(rows, ctxs, depths, stage)
        clock.mark("draft")
        stage.at("tree_builder", self.pipe.tree_builder, "build")
        trees = [self._row_tree(p, r.root, d) for p, r, d in zip(proposals, rows, depths)]
        clock.mark("tree")
        scores = [t.log_scores_cpu() for t in trees]  # each row's log rho [n_i], from the builder's host copy
        decision, width = self._decide(scores, trees, ctxs, stage)
        trees = [t.truncate(min(width, len(t))) for t in trees]
        clock.mark("controller")
        stage.at("target", self.pipe.target, "forward_trees")
        out = tb.forward_trees(trees, self._layers)  # logits [B, W, V], features [B, W, F] or None
        clock.mark("verify")  # on an asynchronous device the verifier's host read below waits for the forward
        verdicts = self._verify(rows, trees, ctxs, out.logits, stage)
        clock.mark("accept")
        self._commit(trees, verdicts, out.features, stage)
        clock.mark("commit")  # no sync: the next step's first host read absorbs the queued commit work
        records = self.observer.speculative(ctxs, trees, scores, verdicts, decision, clock, stage)
        emitted = sum(
            self._commit_row(request, list(verdict.emitted), ctx + len(verdict.accepted_nodes), record, updates)
            for request, verdict, ctx, record in zip(rows, verdicts, ctxs, records)
        )
        self.observer.speculative_done(len(rows), emitted, clock)
        return max(len(t) for t in trees), emitted

    def _draft(self, rows: list[Request], ctxs: list[int], depths: list[int], stage: "_Stage") -> list[Marginals | CandidateTree]:
        """Every row's proposal from one drafter call."""
        pipe = self.pipe
        controller = pipe.budget_controller
        b = len(rows)
        other_s = pipe._batch_costs.other(b)
        per_token = self.observer.per_token.value or None
        assert self._drafts is not None
        stage.at("drafter", pipe.drafter, "propose")
        return self._drafts.propose(
            [
                DraftStep(
                    root_token=r.root, context_len=ctx, temperature=1.0 if r.stream is None else r.rule.temperature,
                    max_depth=max(d, 1), max_nodes=pipe.max_nodes, seconds_per_token=per_token,
                    # a single sequence's drafter may expand its tree while the controller's objective rises
                    estimate_speedup=controller.speedup_estimator(ctx, pipe.latency_model, other_s) if b == 1 else None,
                )
                for r, ctx, d in zip(rows, ctxs, depths)
            ]
        )

    def _decide(
        self, scores: list[torch.Tensor], trees: list[Tree], ctxs: list[int], stage: "_Stage"
    ) -> tuple[BudgetDecision, int]:
        """The controller's decision and its checked size: a single sequence's tree size, or one width for
        the batch (row i verifies its first ``min(W, n_i)`` nodes)."""
        pipe = self.pipe
        controller = pipe.budget_controller
        costs = pipe._batch_costs
        b = len(trees)
        stage.at("budget_controller", controller, "decide_width")
        decision = controller.decide_width(scores, ctxs, pipe.latency_model, costs.other(b), costs.draft(b))
        return decision, check_decision(controller, decision, max(len(t) for t in trees), method="decide_width", error=ComponentError)

    def _verify(self, rows: list[Request], trees: list[Tree], ctxs: list[int], logits: torch.Tensor, stage: "_Stage") -> list[Verdict]:
        """Every row's checked verdict from the target's logits [B, W, V] (row i's nodes in ``[i, :n_i]``)."""
        pipe = self.pipe
        row_sampling = [
            r.rule if r.stream is None else r.stream.for_tree(r.rule, ctx, tree.depths)  # node i: position ctx + d_i + 1
            for r, tree, ctx in zip(rows, trees, ctxs)
        ]
        stage.at("verifier", pipe.verifier, "verify_batch")
        verdicts = pipe.verifier.verify_batch(trees, logits, row_sampling, [r.generator for r in rows])
        strict = getattr(pipe, "strict_verdicts", False)  # a verifier that is not bastion's own, or asked for
        for i, (verdict, tree, r) in enumerate(zip(verdicts, trees, rows)):
            check_verdict(verdict, tree, pipe.target.vocab_size, pipe.verifier)  # host checks: cheap, always on
            if strict and r.stream is None:
                check_greedy_verdict(verdict, tree, logits[i, : len(tree)], pipe.verifier)
        return verdicts

    def _commit(self, trees: list[Tree], verdicts: list[Verdict], features: torch.Tensor | None, stage: "_Stage") -> None:
        """Keep every row's accepted path in the target's and the drafter's states."""
        tb, drafts = self._tb, self._drafts
        assert tb is not None and drafts is not None
        nodes = [v.accepted_nodes for v in verdicts]
        stage.at("target", self.pipe.target, "commit")
        tb.commit(nodes)
        stage.at("drafter", self.pipe.drafter, "commit")
        drafts.commit(
            [tree.tokens[n.to(tree.device)] for tree, n in zip(trees, nodes)],
            [None if features is None else features[i, n.to(features.device)] for i, n in enumerate(nodes)],
        )

    def _commit_row(self, request: Request, tokens: list[int], committed: int, record: StepRecord, updates: list[StepUpdate]) -> int:
        """Hand one row's step to its request (cuts, stop strings, records, callbacks)."""
        kept, chunk = request.emit(tokens, committed, self.pipe.target.max_positions)
        if len(kept) != record.emitted:
            record = _with_emitted(record, len(kept))
        request.steps.append(record)
        if request.on_step is not None:
            request.on_step(record)
        updates.append(StepUpdate(request, tuple(kept), chunk, False))
        return len(kept)

    def _row_tree(self, proposal: Marginals | CandidateTree, root: int, max_depth: int) -> Tree:
        """A row's best tree under its drafting limit (a root-only tree when it may not draft at all)."""
        pipe = self.pipe
        if max_depth < 1:
            return Tree.root_only(root, pipe.target.device)
        proposal = pipe._fit_proposal(proposal, root, max_depth)
        tree = pipe.tree_builder.build(proposal, root_token=root, max_nodes=pipe.max_nodes)
        if pipe.validate_trees:
            check_built_tree(tree, root, pipe.target.vocab_size, pipe.max_nodes, builder=pipe.tree_builder)
        return tree


def _own_sequence_state(drafter: object) -> bool:
    """Whether a drafter implements the single-sequence methods itself (``begin`` defined at least as
    near in its MRO as ``open_batch``): a batch of one then runs on its own state, no fork; a
    batch-first drafter opens a batch of one instead."""
    mro = type(drafter).__mro__
    begin = next(i for i, k in enumerate(mro) if "begin" in vars(k))
    return begin <= next(i for i, k in enumerate(mro) if "open_batch" in vars(k))


class _Chunked:
    """A long prompt being prefilled one chunk per step, in a target state of its own."""

    def __init__(self, request: Request, tb: TargetBatch, done: int, features: list[torch.Tensor], last_logits: torch.Tensor, t0: float) -> None:
        self.request, self.tb, self.done, self.features, self.last_logits, self.t0 = request, tb, done, features, last_logits, t0


class _Stage:
    """Which component the step is calling, so an exception can name it."""

    def __init__(self, registry: Any = None) -> None:
        self.kind = ""
        self.name = ""
        self.method = ""
        self.component: object = None
        self.registry = registry

    def at(self, kind: str, component: object, method: str) -> None:
        self.kind, self.name, self.method, self.component = kind, type(component).__name__, method, component

    def error(self, exc: BaseException) -> BastionError:
        """``exc`` as the error the failed requests report: bastion's own errors as they are, anything
        else as a :class:`ComponentError` naming the component and the call that raised."""
        if isinstance(exc, BastionError):
            return exc
        where = f"{self.kind} {self.name}.{self.method}" if self.kind else "the engine"
        if self.component is not None:
            where += f" (plugin {plugin_of(self.component, self.registry)})"
        err = ComponentError(f"{where} raised {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err


def _with_emitted(record: StepRecord, emitted: int) -> StepRecord:
    return attrs.evolve(record, emitted=emitted)

