"""The batched decode loop: many sequences, one target forward and one drafter call per step.

Per step, for the rows still decoding: the drafter proposes marginals for every row in one call (unless
the controller says drafting does not pay right now), each row builds its tree, the controller picks
ONE width W for the whole batch (row i verifies its first ``min(W, n_i)`` nodes), the target verifies
every row's tree in one padded forward, the verifier decides each row's accepted path, and each row
commits its own path. Rows that stop (EOS, ``max_new_tokens``, position limit) leave the batch: the
target and drafter states drop them, so no compute is spent on finished rows.

Each row's output is exactly what the single-sequence loop gives for that prompt alone (greedy), and
every row samples the target's own distribution at T > 0 (the verifier's guarantee holds per row).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import attrs
import torch

from bastion.core.batching import BatchPrefill, DraftBatch, TargetBatch
from bastion.core.checks import check_next_tokens
from bastion.core.interfaces import BatchStepCosts
from bastion.core.pipeline import Pipeline, _checked_size, _validate_built
from bastion.core.sync import device_sync, to_host
from bastion.core.sampling import PositionalStream, at_position, check_seed, sample_rows, sample_tokens
from bastion.core.target import Target
from bastion.core.tree import Tree
from bastion.core.types import DraftContext, DraftStep, GenerationResult, SamplingConfig, StageTimings, StepFeedback, StepRecord


__all__ = ["decode_batch", "decode_plain_batch"]

#: during a run of plain steps, the verify times of steps 1, 2, 4, .. of the run and then one in this
#: many go to the latency model (plain steps all time W = 1; each observation may trigger a refit)
_PLAIN_LATENCY_EVERY = 64

#: what a plain step hands the controller for "the verified tree": the root alone, accepted
_ROOT_SCORES = torch.zeros(1)  # [1] log rho of the root
_ROOT_PATH = torch.zeros(1, dtype=torch.long)  # [1] the accepted path: the root

#: picks each row's next token from a plain step's logits: (roots, logits [B, V], sampling [B], generators [B])
NextTokens = Callable[[Sequence[int], torch.Tensor, Sequence[SamplingConfig], Sequence["torch.Generator | None"]], list[int]]


class _Row:
    """Per-row bookkeeping of one sequence in the batch."""

    __slots__ = ("index", "prompt_len", "out", "steps", "root", "stop", "stream", "generator", "finished_s")

    def __init__(self, index: int, prompt_len: int, stream: PositionalStream | None, generator: torch.Generator | None) -> None:
        self.index = index
        self.prompt_len = prompt_len
        self.out: list[int] = []
        self.steps: list[StepRecord] = []
        self.root = -1
        self.stop: str | None = None  # "eos" | "length" once the row is done
        self.stream = stream  # row's seeded per-position stream (None: greedy)
        self.generator = generator  # for verifiers that draw by themselves
        self.finished_s = 0.0


def decode_batch(
    pipe: Pipeline,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seeds: Sequence[int | None],
    stop_on_eos: bool,
) -> list[GenerationResult] | None:
    """Decode ``prompts`` (each LongTensor [1, L_i], checked) together; ``None`` when the target has no
    batched state (the caller then decodes row by row)."""
    target, drafter = pipe.target, pipe.drafter
    layers = drafter.feature_layers
    eos = target.eos_token_ids if stop_on_eos else frozenset()
    t_start = time.perf_counter()
    opened = _open(target, prompts, layers, sampling, seeds, pipe._generator)
    if opened is None:
        return None
    tb, pre, rows = opened
    pipe.budget_controller.begin_batch(sampling, len(rows))
    drafts = drafter.open_batch(
        [DraftContext(tokens=p[0], features=None if pre.features is None else pre.features[i]) for i, p in enumerate(prompts)]
    )
    pipe._sync()
    prefill_s = time.perf_counter() - t_start
    _start(rows, _first_tokens(pre, sampling, rows), eos, max_new_tokens)
    active = _retire(rows, (tb, drafts), t_start)
    run = _Run(pipe, tb, drafts, max_new_tokens, sampling, eos)
    while active:
        _step(run, active)
        active = _retire(active, (tb, drafts), t_start)
    pipe._sync()
    return _results(rows, max_new_tokens, prefill_s)


def decode_plain_batch(
    target: Target,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    sampling: SamplingConfig,
    seeds: Sequence[int | None],
    stop_on_eos: bool = True,
) -> list[GenerationResult] | None:
    """Plain batched decoding with the target alone (the ``ar`` baseline at batch size > 1): one
    forward per step over every active row's next token, in the same padded cache, finished rows leave.
    ``None`` when the target has no batched state."""
    eos = target.eos_token_ids if stop_on_eos else frozenset()
    t_start = time.perf_counter()
    opened = _open(target, prompts, (), sampling, seeds, lambda _stream: None)
    if opened is None:
        return None
    tb, pre, rows = opened
    device_sync(target.device)
    prefill_s = time.perf_counter() - t_start
    _start(rows, _first_tokens(pre, sampling, rows), eos, max_new_tokens)
    active = _retire(rows, (tb,), t_start)
    while active:
        t0 = time.perf_counter()
        ctxs = tb.context_lens
        tokens, _ = _plain_forward(tb, active, ctxs, sampling, (), _exact_next_tokens)
        _record_plain(active, tokens, ctxs, StageTimings(verify=time.perf_counter() - t0), max_new_tokens, eos, target.max_positions)
        active = _retire(active, (tb,), t_start)
    device_sync(target.device)
    return _results(rows, max_new_tokens, prefill_s)


def _exact_next_tokens(
    roots: Sequence[int], logits: torch.Tensor, sampling: Sequence[SamplingConfig], generators: Sequence[torch.Generator | None]
) -> list[int]:
    """The target's own choice per row (the exact verifier's rule for a one-node tree)."""
    return to_host(sample_rows(logits, sampling, generators), "verify")  # [B], the step's one host read


def _plain_forward(
    tb: TargetBatch, rows: list["_Row"], ctxs: list[int], sampling: SamplingConfig, layers: tuple[int, ...], pick: NextTokens
) -> tuple[list[int], torch.Tensor | None]:
    """One plain batched step in the target: every row's root in one forward, committed, and each
    row's next token picked -> (tokens [B], the roots' features [B, F] or None). No trees, no
    verdicts: O(1) tensor work per step whatever the batch size."""
    roots = [row.root for row in rows]
    out = tb.forward_next(torch.tensor(roots), layers)  # logits [B, 1, V]
    tb.commit_next()
    if sampling.greedy:
        row_sampling = [sampling] * len(rows)
    else:  # row i's token sits at position ctx_i + 1 of its own seeded stream (a one-node tree's uniforms [1])
        row_sampling = [at_position(sampling, row.stream, ctx + 1, rows=1) for row, ctx in zip(rows, ctxs)]
    tokens = pick(roots, out.logits[:, 0], row_sampling, [row.generator for row in rows])
    tokens = check_next_tokens(tokens, len(rows), out.logits.shape[-1], getattr(pick, "__self__", pick))
    return tokens, None if out.features is None else out.features[:, 0]


def _record_plain(
    rows: list["_Row"], tokens: list[int], ctxs: list[int], timings: StageTimings, max_new_tokens: int, eos: frozenset[int], max_positions: int
) -> None:
    """Emit each row's plain-step token and append its step record."""
    b = len(rows)
    for row, tok, ctx in zip(rows, tokens, ctxs):
        emitted = _emit(row, (tok,), ctx + 1, max_new_tokens, eos, max_positions)
        row.steps.append(
            StepRecord(
                budget=1,
                accepted=0,
                emitted=len(emitted),
                context_len=ctx,
                predicted_accept=1.0,
                predicted_speedup=None,
                timings=timings,
                drafted=False,
                batch_size=b,
                width=1,
            )
        )


def _open(
    target: Target,
    prompts: Sequence[torch.Tensor],
    layers: tuple[int, ...],
    sampling: SamplingConfig,
    seeds: Sequence[int | None],
    make_generator: Callable[[PositionalStream | None], torch.Generator | None],
) -> tuple[TargetBatch, BatchPrefill, list[_Row]] | None:
    opened = target.open_batch([p[0] for p in prompts], layers)
    if opened is None:
        return None
    rows = []
    for i, (p, seed) in enumerate(zip(prompts, seeds)):
        stream = None if sampling.greedy else PositionalStream.from_seed(None if seed is None else check_seed(seed))
        rows.append(_Row(i, int(p.shape[1]), stream, make_generator(stream)))
    return opened[0], opened[1], rows


def _start(rows: list[_Row], roots: list[int], eos: frozenset[int], max_new_tokens: int) -> None:
    for row, root in zip(rows, roots):
        row.root = root
        row.out.append(root)
        if root in eos:
            row.stop = "eos"
        elif max_new_tokens <= 1:
            row.stop = "length"


def _emit(row: _Row, tokens: Sequence[int], committed: int, max_new_tokens: int, eos: frozenset[int], max_positions: int) -> list[int]:
    """Append a step's tokens (cut at the token limit and at EOS) to the row; the last token becomes
    the next root, at position ``committed``. Returns the tokens emitted."""
    emitted = list(tokens)[: max_new_tokens - len(row.out)]
    for k, tok in enumerate(emitted):
        if tok in eos:
            emitted = emitted[: k + 1]
            row.stop = "eos"
            break
    row.out.extend(emitted)
    row.root = tokens[-1]
    if row.stop is None and (len(row.out) >= max_new_tokens or committed > max_positions - 1):
        row.stop = "length"
    return emitted


def _results(rows: list[_Row], max_new_tokens: int, prefill_s: float) -> list[GenerationResult]:
    return [
        GenerationResult(
            tokens=row.out[:max_new_tokens],
            steps=tuple(row.steps),
            prompt_len=row.prompt_len,
            prefill_s=prefill_s,
            wall_s=row.finished_s,
            stop_reason=row.stop or "length",  # type: ignore[arg-type]
        )
        for row in rows
    ]


def _first_tokens(pre: BatchPrefill, sampling: SamplingConfig, rows: list[_Row]) -> list[int]:
    if sampling.greedy:
        return pre.last_logits.argmax(dim=-1).tolist()  # [B]
    return [
        int(sample_tokens(pre.last_logits[i], at_position(sampling, row.stream, row.prompt_len), row.generator))
        for i, row in enumerate(rows)
    ]


def _retire(rows: list[_Row], states: Sequence[TargetBatch | DraftBatch], t_start: float) -> list[_Row]:
    """Drop finished rows from the batch states; returns the rows still decoding."""
    keep = [k for k, row in enumerate(rows) if row.stop is None]
    if len(keep) < len(rows):
        now = time.perf_counter() - t_start
        for row in rows:
            if row.stop is not None and not row.finished_s:
                row.finished_s = now
        if keep:
            for state in states:
                state.keep(keep)
    return [rows[k] for k in keep]


@attrs.frozen
class _Run:
    """What every step of one batched decode shares."""

    pipe: Pipeline
    tb: TargetBatch
    drafts: DraftBatch
    max_new_tokens: int
    sampling: SamplingConfig
    eos: frozenset[int]


def _step(run: _Run, rows: list[_Row]) -> None:
    """One batched step: speculative when the controller says drafting pays (and some row has room to
    draft), else plain."""
    pipe = run.pipe
    t0 = time.perf_counter()
    ctxs = run.tb.context_lens
    limit = pipe.target.max_positions
    may_draft = any(limit - ctx - 1 >= 1 and run.max_new_tokens - len(row.out) - 1 >= 1 for row, ctx in zip(rows, ctxs))
    costs, b = pipe._batch_costs, len(rows)
    step_costs = BatchStepCosts(costs.other(b), costs.draft(b), costs.plain(b))
    if may_draft and pipe.budget_controller.speculate_batch(ctxs, pipe.latency_model, step_costs):
        _speculative_step(run, rows, t0, ctxs)
    else:
        _plain_step(run, rows, t0, ctxs)


def _plain_step(run: _Run, rows: list[_Row], t0: float, ctxs: list[int]) -> None:
    """The target alone: one forward over every row's root, each row's next token, and the drafter
    kept current from the features that forward produced; O(1) device work and host reads per step."""
    pipe = run.pipe
    t1 = time.perf_counter()
    tokens, feats = _plain_forward(run.tb, rows, ctxs, run.sampling, pipe.drafter.feature_layers, pipe.verifier.next_tokens)
    t2 = time.perf_counter()  # forward, commit and the read of its tokens
    run.drafts.commit_next(torch.tensor([row.root for row in rows]), feats)
    t3 = time.perf_counter()
    b = len(rows)
    pipe._plain_steps += 1
    if _observe_plain(pipe._plain_steps):
        pipe.latency_model.observe_batch(1, ctxs, t2 - t1)
    overhead = (t1 - t0) + (t3 - t2)
    pipe.budget_controller.observe(
        StepFeedback(
            drafted=False, log_scores=_ROOT_SCORES, accepted_nodes=_ROOT_PATH, context_len=max(ctxs), verify_s=t2 - t1,
            overhead_s=overhead, batch_size=b,
        )
    )
    timings = StageTimings(controller=t1 - t0, verify=t2 - t1, commit=t3 - t2)
    _record_plain(rows, tokens, ctxs, timings, run.max_new_tokens, run.eos, pipe.target.max_positions)
    pipe._batch_costs.plain.observe(b, overhead + (time.perf_counter() - t3))  # records included


def _observe_plain(k: int) -> bool:
    """Whether the ``k``-th plain step of a run (from 1) times the latency model."""
    return k & (k - 1) == 0 or k % _PLAIN_LATENCY_EVERY == 0


def _speculative_step(run: _Run, rows: list[_Row], t0: float, ctxs: list[int]) -> None:
    """Draft every row, build each row's tree, one width for the batch, verify, accept, commit."""
    pipe, tb, drafts, sampling, max_new_tokens = run.pipe, run.tb, run.drafts, run.sampling, run.max_new_tokens
    target, controller = pipe.target, pipe.budget_controller
    layers = pipe.drafter.feature_layers
    draft_temperature = 1.0 if sampling.greedy else sampling.temperature
    costs = pipe._batch_costs
    b = len(rows)
    depths = [min(target.max_positions - ctx - 1, max_new_tokens - len(row.out) - 1) for row, ctx in zip(rows, ctxs)]
    t_draft = time.perf_counter()
    marginals = drafts.propose(
        [DraftStep(root_token=row.root, context_len=ctx, temperature=draft_temperature) for row, ctx in zip(rows, ctxs)]
    )
    t1 = time.perf_counter()
    trees = [_row_tree(pipe, m, row.root, d) for m, row, d in zip(marginals, rows, depths)]
    t2 = time.perf_counter()
    decision = controller.decide_width([t.log_scores for t in trees], ctxs, pipe.latency_model, costs.other(b), costs.draft(b))
    width = _checked_size(controller, decision, max(len(t) for t in trees))
    trees = [t.truncate(min(width, len(t))) for t in trees]
    t3 = time.perf_counter()
    out = tb.forward_trees(trees, layers)
    pipe._sync()
    t4 = time.perf_counter()
    row_sampling = [
        sampling if row.stream is None else row.stream.for_tree(sampling, ctx, tree.depths)  # node i: position ctx + d_i + 1
        for row, tree, ctx in zip(rows, trees, ctxs)
    ]
    verdicts = pipe.verifier.verify_batch(trees, out.logits, row_sampling, [row.generator for row in rows])
    t5 = time.perf_counter()
    nodes = [v.accepted_nodes for v in verdicts]
    tb.commit(nodes)
    feats = out.features
    drafts.commit(
        [tree.tokens[n.to(tree.device)] for tree, n in zip(trees, nodes)],
        [None if feats is None else feats[i, n.to(feats.device)] for i, n in enumerate(nodes)],
    )
    pipe._sync()
    t6 = time.perf_counter()
    width = max(len(t) for t in trees)
    pipe._plain_steps = 0
    pipe.latency_model.observe_batch(width, ctxs, t4 - t3)
    non_verify = (t3 - t0) + (t6 - t4)
    for tree, n, ctx in zip(trees, nodes, ctxs):
        controller.observe(
            StepFeedback(
                drafted=True, log_scores=tree.log_scores, accepted_nodes=n, context_len=ctx, verify_s=t4 - t3, overhead_s=non_verify,
                batch_size=b,
            )
        )
    timings = StageTimings(draft=t1 - t0, tree=t2 - t1, controller=t3 - t2, verify=t4 - t3, accept=t5 - t4, commit=t6 - t5)
    for row, tree, verdict, ctx in zip(rows, trees, verdicts, ctxs):
        committed = ctx + len(verdict.accepted_nodes)  # the next root sits at this position
        emitted = _emit(row, verdict.emitted, committed, max_new_tokens, run.eos, target.max_positions)
        row.steps.append(
            StepRecord(
                budget=len(tree),
                accepted=verdict.num_accepted,
                emitted=len(emitted),
                context_len=ctx,
                predicted_accept=tree.accept_score(),
                predicted_speedup=decision.predicted_speedup,
                timings=timings,
                calibrated_accept=decision.calibrated_accept,
                drafted=True,
                batch_size=b,
                width=width,
            )
        )
    costs.draft.observe(b, t2 - t_draft)
    costs.other.observe(b, (t_draft - t0) + (t3 - t2) + (time.perf_counter() - t4))  # records included


def _row_tree(pipe: Pipeline, proposal: Any, root: int, max_depth: int) -> Tree:
    """Row's best tree under its drafting limit (a root-only tree when it may not draft at all). The
    proposal is marginals or a candidate tree, checked and cut like a single sequence's."""
    if max_depth < 1:
        return pipe._root_tree(root)
    proposal = pipe._fit_proposal(proposal, root, max_depth)
    tree = pipe.tree_builder.build(proposal, root_token=root, max_nodes=pipe.max_nodes)
    if pipe.validate_trees:
        _validate_built(tree, root, pipe.target.vocab_size)
    return tree
