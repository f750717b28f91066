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

from bastion.core.batching import DraftBatch, SoloDraftBatch, SoloTargetBatch, TargetBatch
from bastion.core.blame import plugin_of
from bastion.core.candidates import CandidateTree
from bastion.core.checks import check_built_tree, check_decision, check_greedy_verdict, check_next_tokens, check_verdict
from bastion.core.errors import BastionError, ComponentError, IncompatibleComponentsError, InvalidInputError
from bastion.core.interfaces import BatchStepCosts
from bastion.core.sampling import at_position, sample_tokens
from bastion.core.running import RobustLevel
from bastion.core.sync import device_sync, to_host
from bastion.core.tree import Tree
from bastion.core.types import DraftContext, DraftStep, Marginals, StageTimings, StepFeedback, StepRecord
from bastion.engine.params import GenerationConfig
from bastion.engine.request import Request, StepSummary, StepUpdate


__all__ = ["Engine"]

#: during a run of plain steps, the verify times of steps 1, 2, 4, .. of the run and then one in this
#: many go to the latency model (plain steps all time W = 1; each observation may trigger a refit)
_PLAIN_LATENCY_EVERY = 64

#: what a plain step hands the controller for "the verified tree": the root alone, accepted
_ROOT_SCORES = torch.zeros(1)  # [1] log rho of the root
_ROOT_PATH = torch.zeros(1, dtype=torch.long)  # [1] the accepted path: the root


class Engine:
    """Continuous batched decoding over a :class:`~bastion.Pipeline`'s components (see the module doc);
    ``pipe`` is a pipeline, or any object with the components and checks the engine reads from one
    (:class:`bastion.core.batch.PlainComponents` for the target alone).

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
        self._plain_steps = 0  # consecutive plain steps so far
        self._per_token = RobustLevel()  # seconds per committed token of a row in a speculative step
        self._sampling_key: object = None
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
    def step(self) -> list[StepUpdate]:
        """Admit waiting requests, then decode one step for every running row -> one update per
        request that committed tokens, finished or failed. A component that raises fails the requests
        of that step (``stop_reason`` ``"error"``, the error names the component) and the engine goes on
        with the next requests."""
        updates: list[StepUpdate] = []
        t0 = time.perf_counter()
        self._leave(updates)
        admitted = self._admit(updates)
        if admitted:
            self._leave(updates)  # a newcomer whose first token ended it (EOS, max_new_tokens 1) leaves now
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
            if self.solo:
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
        rule = self._rows[0].rule
        if len(self._rows) == 1:
            self.pipe.budget_controller.begin(rule)
        else:
            self.pipe.budget_controller.begin_batch(rule, len(self._rows))

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
        t0 = time.perf_counter()
        rows = self._rows
        ctxs = self._tb.context_lens
        limit = pipe.target.max_positions
        depths = [min(limit - ctx - 1, r.config.max_new_tokens - len(r.tokens) - 1) for r, ctx in zip(rows, ctxs)]
        b = len(rows)
        drafted = False
        if self.drafts and any(d >= 1 for d in depths):
            costs = pipe._batch_costs
            controller = pipe.budget_controller
            if b == 1:  # a batch of one is a single sequence: the controller's single-sequence question
                stage.at("budget_controller", controller, "speculate")
                drafted = bool(controller.speculate())
            else:
                stage.at("budget_controller", controller, "speculate_batch")
                drafted = bool(
                    controller.speculate_batch(ctxs, pipe.latency_model, BatchStepCosts(costs.other(b), costs.draft(b), costs.plain(b)))
                )
        if drafted:
            width, emitted = self._speculative(rows, ctxs, depths, t0, updates, stage)
        else:
            width, emitted = 1, self._plain(rows, ctxs, t0, updates, stage)
        return b, width, drafted, emitted

    def _plain(self, rows: list[Request], ctxs: list[int], t0: float, updates: list[StepUpdate], stage: "_Stage") -> int:
        """The target alone: one forward over every row's root, each row's next token, and the drafter
        kept current from the features that forward produced; O(1) device work and host reads."""
        pipe = self.pipe
        tb = self._tb
        assert tb is not None
        t1 = time.perf_counter()
        roots = [r.root for r in rows]
        stage.at("target", pipe.target, "forward_next")
        out = tb.forward_next(torch.tensor(roots), self._layers)  # logits [B, 1, V]
        tb.commit_next()
        # row i's token sits at position ctx_i + 1 of its own seeded stream (a one-node tree's uniforms [1])
        row_sampling = [r.rule if r.stream is None else at_position(r.rule, r.stream, ctx + 1, rows=1) for r, ctx in zip(rows, ctxs)]
        stage.at("verifier", pipe.verifier, "next_tokens")
        tokens = pipe.verifier.next_tokens(roots, out.logits[:, 0], row_sampling, [r.generator for r in rows])
        tokens = check_next_tokens(tokens, len(rows), out.logits.shape[-1], pipe.verifier)
        if getattr(pipe, "strict_verdicts", False) and any(r.stream is None for r in rows):
            best = to_host(out.logits[:, 0].argmax(dim=-1), "strict greedy check")  # [B]
            for r, tok, want in zip(rows, tokens, best):
                if r.stream is None and tok != want:
                    raise ComponentError(f"verifier {type(pipe.verifier).__name__}: next token {tok} is not the target's argmax {want}")
        t2 = time.perf_counter()  # forward, commit and the read of its tokens
        if self._drafts is not None:
            stage.at("drafter", pipe.drafter, "commit_next")
            self._drafts.commit_next(torch.tensor(roots), None if out.features is None else out.features[:, 0])
        t3 = time.perf_counter()
        b = len(rows)
        self._plain_steps += 1
        if _observe_plain(self._plain_steps):
            stage.at("latency_model", pipe.latency_model, "observe_batch")
            pipe.latency_model.observe_batch(1, ctxs, t2 - t1)
        overhead = (t1 - t0) + (t3 - t2)
        if self.drafts:
            stage.at("budget_controller", pipe.budget_controller, "observe")
            pipe.budget_controller.observe(
                StepFeedback(
                    drafted=False, log_scores=_ROOT_SCORES, accepted_nodes=_ROOT_PATH, context_len=max(ctxs), verify_s=t2 - t1,
                    overhead_s=overhead, batch_size=b,
                )
            )
        timings = StageTimings(controller=t1 - t0, verify=t2 - t1, commit=t3 - t2)
        emitted = 0
        for request, tok, ctx in zip(rows, tokens, ctxs):
            record = StepRecord(
                budget=1, accepted=0, emitted=1, context_len=ctx, predicted_accept=1.0, predicted_speedup=None,
                timings=timings, drafted=False, batch_size=b, width=1 if b > 1 else None,
            )
            emitted += self._commit_row(request, [tok], ctx + 1, record, updates)
        pipe._batch_costs.plain.observe(b, overhead + (time.perf_counter() - t3))  # records included
        return emitted

    def _speculative(
        self, rows: list[Request], ctxs: list[int], depths: list[int], t0: float, updates: list[StepUpdate], stage: "_Stage"
    ) -> tuple[int, int]:
        """Draft every row, build each row's tree, one width for the batch, verify, accept, commit."""
        pipe = self.pipe
        tb, drafts = self._tb, self._drafts
        assert tb is not None and drafts is not None
        controller = pipe.budget_controller
        costs = pipe._batch_costs
        b = len(rows)
        t_draft = time.perf_counter()
        other_s = costs.other(b)
        per_token = self._per_token.value or None
        stage.at("drafter", pipe.drafter, "propose")
        proposals = drafts.propose(
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
        t1 = time.perf_counter()
        stage.at("tree_builder", pipe.tree_builder, "build")
        trees = [self._row_tree(p, r.root, d) for p, r, d in zip(proposals, rows, depths)]
        t2 = time.perf_counter()
        scores = [t.log_scores_cpu() for t in trees]  # each row's log rho [n_i], from the builder's host copy
        if b == 1:  # a single sequence: the tree size that maximizes its own speedup
            stage.at("budget_controller", controller, "decide")
            decision = controller.decide(scores[0], ctxs[0], pipe.latency_model, other_s + costs.draft(b))
            width = check_decision(controller, decision, len(trees[0]), error=ComponentError)
        else:  # one width for the batch
            stage.at("budget_controller", controller, "decide_width")
            decision = controller.decide_width(scores, ctxs, pipe.latency_model, other_s, costs.draft(b))
            width = check_decision(controller, decision, max(len(t) for t in trees), method="decide_width", error=ComponentError)
        trees = [t.truncate(min(width, len(t))) for t in trees]
        t3 = time.perf_counter()
        stage.at("target", pipe.target, "forward_trees")
        out = tb.forward_trees(trees, self._layers)
        t4 = time.perf_counter()  # on an asynchronous device the verifier's host read below waits for the forward
        row_sampling = [
            r.rule if r.stream is None else r.stream.for_tree(r.rule, ctx, tree.depths)  # node i: position ctx + d_i + 1
            for r, tree, ctx in zip(rows, trees, ctxs)
        ]
        if b == 1:  # a single sequence's verdict
            stage.at("verifier", pipe.verifier, "verify")
            verdicts = [pipe.verifier.verify(trees[0], out.logits[0, : len(trees[0])], row_sampling[0], rows[0].generator)]
        else:
            stage.at("verifier", pipe.verifier, "verify_batch")
            verdicts = pipe.verifier.verify_batch(trees, out.logits, row_sampling, [r.generator for r in rows])
        strict = getattr(pipe, "strict_verdicts", False)  # a verifier that is not bastion's own, or asked for
        for i, (verdict, tree, r) in enumerate(zip(verdicts, trees, rows)):
            check_verdict(verdict, tree, pipe.target.vocab_size, pipe.verifier)  # host checks: cheap, always on
            if strict and r.stream is None:
                check_greedy_verdict(verdict, tree, out.logits[i, : len(tree)], pipe.verifier)
        t5 = time.perf_counter()
        nodes = [v.accepted_nodes for v in verdicts]
        stage.at("target", pipe.target, "commit")
        tb.commit(nodes)
        feats = out.features
        stage.at("drafter", pipe.drafter, "commit")
        drafts.commit(
            [tree.tokens[n.to(tree.device)] for tree, n in zip(trees, nodes)],
            [None if feats is None else feats[i, n.to(feats.device)] for i, n in enumerate(nodes)],
        )
        t6 = time.perf_counter()  # no sync: the next step's first host read absorbs the queued commit work
        width = max(len(t) for t in trees)
        self._plain_steps = 0
        stage.at("latency_model", pipe.latency_model, "observe_batch")
        pipe.latency_model.observe_batch(width, ctxs, t5 - t3)  # the forward and the read of its verdicts
        non_verify = (t3 - t0) + (t6 - t5)
        stage.at("budget_controller", controller, "observe")
        for tree, row_scores, n, ctx in zip(trees, scores, nodes, ctxs):
            controller.observe(
                StepFeedback(
                    drafted=True, log_scores=row_scores[:len(tree)], accepted_nodes=n, context_len=ctx, verify_s=t5 - t3,
                    overhead_s=non_verify, batch_size=b,
                )
            )
        timings = StageTimings(draft=t1 - t0, tree=t2 - t1, controller=t3 - t2, verify=t4 - t3, accept=t5 - t4, commit=t6 - t5)
        emitted = 0
        for request, tree, verdict, ctx in zip(rows, trees, verdicts, ctxs):
            record = StepRecord(
                budget=len(tree), accepted=verdict.num_accepted, emitted=verdict.num_accepted + 1, context_len=ctx,
                predicted_accept=tree.accept_score(), predicted_speedup=decision.predicted_speedup, timings=timings,
                calibrated_accept=decision.calibrated_accept, drafted=True, batch_size=b, width=width if b > 1 else None,
            )
            emitted += self._commit_row(request, list(verdict.emitted), ctx + len(verdict.accepted_nodes), record, updates)
        costs.draft.observe(b, t2 - t_draft)
        t7 = time.perf_counter()
        costs.other.observe(b, (t_draft - t0) + (t3 - t2) + (t7 - t5))  # records included
        self._per_token.observe((t7 - t0) * b / max(emitted, 1))
        return width, emitted

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
            check_built_tree(tree, root, pipe.target.vocab_size, pipe.max_nodes)
        return tree


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


def _observe_plain(k: int) -> bool:
    """Whether the ``k``-th plain step of a run (from 1) times the latency model."""
    return k & (k - 1) == 0 or k % _PLAIN_LATENCY_EVERY == 0


def _with_emitted(record: StepRecord, emitted: int) -> StepRecord:
    return attrs.evolve(record, emitted=emitted)

