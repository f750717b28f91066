"""Decoding the rows of one rank in ``bastion run``: batches, one ``generate_batch`` call per group of
rows sharing their settings, seeds, stop strings, the progress bar and the rank's counters."""

from __future__ import annotations

import sys
import time
from typing import Any, Iterator

import attrs
import torch
from attrs import frozen

from bastion.contract.errors import BastionError
from bastion.contract.types import GenerationResult
from bastion.engine.params import derived_seed
from bastion.run.encode import EncodedRow
from bastion.run.inputs import RowError
from bastion.run.journal import ResultRow, RowWriter, error_row, item_key, ok_row

__all__ = ["RankStats", "Progress", "decode_work", "generate_rows", "seed_runs"]


@frozen
class RankStats:
    """What one rank decoded in this run."""

    decoded: int = 0
    resumed: int = 0
    new_tokens: int = 0
    steps: int = 0
    committed: int = 0  # tokens committed by decode steps (sum of accepted + 1)
    budget: int = 0  # tree nodes verified, summed over steps
    decode_s: float = 0.0


def _batches(work: list[EncodedRow | RowError], size: int) -> Iterator[list[EncodedRow | RowError]]:
    """Runs of items holding at most ``size`` rows to decode (error items ride along in place)."""
    batch: list[EncodedRow | RowError] = []
    count = 0
    for item in work:
        batch.append(item)
        if isinstance(item, EncodedRow):
            count += 1
            if count == size:
                yield batch
                batch, count = [], 0
    if batch:
        yield batch


def seed_runs(idx: list[int], rows: list[EncodedRow]) -> list[list[int]]:
    """Split ``idx`` (rows of one settings group) into runs whose seeds follow each other when they
    sample: ``generate_batch`` seeds its row k with ``seed + k``, so a run started at its first row's
    seed gives every row its own seed (``--seed`` plus its input line, or the row's ``seed``), whatever
    the batch size, the rank count or the resume history. Greedy rows form one run."""
    if not rows[idx[0]].decode.sampled:
        return [idx]
    runs: list[list[int]] = []
    for k in idx:
        if runs and rows[k].decode.seed == derived_seed(rows[runs[-1][-1]].decode.seed, 1):  # as generate_batch derives them
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def generate_rows(pipe: Any, rows: list[EncodedRow]) -> list[GenerationResult]:
    """One :class:`GenerationResult` per row, in order. Rows asking for different settings go to
    ``generate_batch`` as separate groups; sampled rows are split into runs of consecutive seeds
    (:func:`seed_runs`); stop strings end each row where they first appear, as ``generate`` does."""
    results: list[Any] = [None] * len(rows)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for k, row in enumerate(rows):
        groups.setdefault(row.decode.group(), []).append(k)
    for idx in groups.values():
        first = rows[idx[0]].decode
        for run in seed_runs(idx, rows):
            out = pipe.generate_batch(
                [list(rows[k].ids) for k in run],
                max_new_tokens=first.max_new_tokens,
                temperature=first.temperature,
                seed=rows[run[0]].decode.seed,
                top_p=first.top_p,
                top_k=first.top_k,
                stop=first.stop or None,  # a row ends at its stop string: no tokens decoded past it
            )
            for k, res in zip(run, out):
                results[k] = res
    return results


def _decode_rows(pipe: Any, rows: list[EncodedRow], skip: bool) -> list[tuple[EncodedRow, Any]]:
    """(row, GenerationResult or RowError) per row. With ``skip`` a batch that fails is decoded row by
    row and a failing row becomes an error; otherwise the error propagates."""
    try:
        return list(zip(rows, generate_rows(pipe, rows)))
    except BastionError as exc:
        if not skip:
            raise
        if len(rows) == 1:
            row = rows[0].row
            return [(rows[0], RowError(row.line, f"decoding failed: {exc}", row.id, row.openai is not None))]
    return [pair for row in rows for pair in _decode_rows(pipe, [row], skip)]


def _text(tokenizer: Any, result: GenerationResult) -> str:
    if result.stop_reason == "stop" and result.text is not None:
        return result.text  # ends right before the stop string
    return str(tokenizer.decode(result.tokens, skip_special_tokens=True)) if tokenizer is not None else ""


class Progress:
    """The rank's progress bar: rows, tokens/s, acceptance (rank 0 only; silent elsewhere)."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self._bar: Any = None
        if enabled and total:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="row", dynamic_ncols=True, file=sys.stderr)

    def update(self, rows: int, stats: RankStats) -> None:
        if self._bar is None:
            return
        tps = stats.new_tokens / stats.decode_s if stats.decode_s > 0 else 0.0
        acc = stats.committed / stats.steps if stats.steps else 0.0
        self._bar.set_postfix_str(f"{tps:.1f} tok/s, acceptance {acc:.2f}", refresh=False)
        self._bar.update(rows)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _add(stats: RankStats, result: GenerationResult) -> RankStats:
    return attrs.evolve(
        stats,
        decoded=stats.decoded + 1,
        new_tokens=stats.new_tokens + len(result.tokens),
        steps=stats.steps + len(result.steps),
        committed=stats.committed + sum(s.accepted + 1 for s in result.steps),
        budget=stats.budget + sum(s.budget for s in result.steps),
    )


def decode_work(
    pipe: Any,
    work: list[EncodedRow | RowError],
    writer: RowWriter | None,
    *,
    batch_size: int,
    skip: bool,
    model: str,
    stats: RankStats,
    bar: Progress,
) -> tuple[dict[str, ResultRow], RankStats]:
    """Decode ``work`` in batches of ``batch_size`` rows, appending each batch's output rows (error
    items in place) to ``writer``. Returns the new rows by key and the updated counters."""
    new: dict[str, ResultRow] = {}
    for batch in _batches(work, batch_size):
        rows = [i for i in batch if isinstance(i, EncodedRow)]
        t0 = time.perf_counter()
        with torch.inference_mode():
            decoded = dict((id(r), res) for r, res in _decode_rows(pipe, rows, skip)) if rows else {}
        seconds = time.perf_counter() - t0
        out: list[ResultRow] = []
        for item in batch:
            res = decoded.get(id(item), item)
            if isinstance(res, RowError):
                row = error_row(res)
            else:
                assert isinstance(item, EncodedRow)
                row = ok_row(item.row, res, _text(pipe.tokenizer, res), prompt_tokens=len(item.ids), model=model)
                stats = _add(stats, res)
            out.append(row)
            new[item_key(item if isinstance(item, RowError) else item.row)] = row
        stats = attrs.evolve(stats, decode_s=stats.decode_s + seconds)
        if writer is not None:
            writer.write(out)
        bar.update(len(rows), stats)
    return new, stats
