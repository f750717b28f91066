"""Decode a whole prompt file with one pipeline per process, resumably, data parallel under torchrun.

One process (``python -m bastion run``) appends each finished batch of rows to ``--output`` in input
order. Under ``torchrun`` every rank decodes its contiguous block of the valid rows and appends them to
its own part file ``<output>.parts/part-RRRRR-of-WWWWW.jsonl``; once all ranks are done, rank 0 gathers
the rows through ``torch.distributed`` (no shared file system needed), writes ``--output`` in input order
in one atomic replace, and the part files are removed. A rerun with the same output skips every id
already decoded in the output or in any part file it can see (each rank repairs only the files it
writes: its own part, and rank 0 the output); error rows are always redone.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import attrs
import torch
from attrs import field, frozen, validators

from bastion.core.checks import positive_int
from bastion.core.errors import BastionError, InvalidInputError, InvalidRowsError
from bastion.distributed import DistContext, barrier, broadcast_object, gather_objects
from bastion.run.encode import EncodedRow, encode_rows
from bastion.run.inputs import RowError, parse_input
from bastion.run.journal import ResultRow, RowWriter, error_row, ok_row, read_rows, row_key, write_rows_atomic

__all__ = ["RunConfig", "RunSummary", "run_prompts", "part_path", "STDIO"]

#: the file name that stands for stdin (``--input``) or stdout (``--output``)
STDIO = "-"

OnError = Literal["stop", "skip"]


@frozen
class RunConfig:
    """What one ``bastion run`` decodes and where the rows go."""

    input: str
    output: str
    batch_size: int = field(default=8, validator=positive_int)
    max_new_tokens: int = field(default=128, validator=positive_int)  # rows without their own max_new_tokens
    temperature: float = field(default=0.0, converter=float, validator=validators.ge(0.0))
    seed: int = 0
    top_p: float = 1.0
    top_k: int = 0
    on_error: OnError = field(default="stop", validator=validators.in_(("stop", "skip")))
    raw: bool = False  # feed ``prompt`` text without the chat template
    progress: bool = True

    @property
    def to_stdout(self) -> bool:
        return self.output == STDIO


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


@frozen
class RunSummary:
    """The pooled result of a run (rank 0)."""

    input_rows: int
    decoded: int
    resumed: int
    errors: int
    new_tokens: int
    steps: int
    committed: int
    budget: int
    decode_s: float  # the slowest rank's decoding time
    wall_s: float
    world_size: int
    output: str

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def acceptance_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def mean_budget(self) -> float:
        return self.budget / self.steps if self.steps else 0.0

    def describe(self) -> str:
        where = "stdout" if self.output == STDIO else self.output
        return (
            f"{self.input_rows} rows: {self.decoded} decoded, {self.resumed} already done, {self.errors} errors"
            f" | {self.new_tokens} new tokens in {self.decode_s:.1f}s ({self.tokens_per_second:.1f} tok/s)"
            f" | acceptance {self.acceptance_length:.2f}, mean budget {self.mean_budget:.1f}"
            f" | {self.world_size} rank{'s' if self.world_size > 1 else ''}, {self.wall_s:.1f}s wall -> {where}"
        )


def part_path(output: str | Path, rank: int, world_size: int) -> Path:
    """The part file rank ``rank`` of a ``world_size``-rank run appends to."""
    out = Path(output)
    return out.with_name(out.name + ".parts") / f"part-{rank:05d}-of-{world_size:05d}.jsonl"


def _parts_dir(output: str) -> Path:
    return part_path(output, 0, 1).parent


# ---------------------------------------------------------------------------------------------- input
def _read_input(path: str) -> str:
    if path == STDIO:
        return sys.stdin.read()
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"input file {path} does not exist")
    return p.read_text(encoding="utf-8")


def _positions(items: list[EncodedRow | RowError]) -> dict[str, int]:
    """Output-row key -> input position, for both keys an item's row may have."""
    pos: dict[str, int] = {}
    for k, item in enumerate(items):
        line = item.line if isinstance(item, RowError) else item.row.line
        pos[f"line:{line}"] = k
        if isinstance(item, EncodedRow):
            pos[f"id:{item.row.key}"] = k
    return pos


def _block(items: list[Any], ctx: DistContext) -> list[Any]:
    """This rank's contiguous block of ``items`` (sizes differ by one at most): consecutive rows keep
    consecutive seeds in one ``generate_batch`` call (see :func:`_seed_runs`)."""
    n = len(items)
    return items[n * ctx.rank // ctx.world_size : n * (ctx.rank + 1) // ctx.world_size]


def _key(item: EncodedRow | RowError) -> str:
    return f"line:{item.line}" if isinstance(item, RowError) else f"id:{item.row.key}"


# ---------------------------------------------------------------------------------------------- resume
def _journal_files(config: RunConfig, ctx: DistContext) -> tuple[list[Path], Path | None]:
    """(files to read done rows from, the one file this rank repairs and appends to or None)."""
    if config.to_stdout:
        return [], None
    output = Path(config.output)
    parts = sorted(_parts_dir(config.output).glob("part-*-of-*.jsonl"))
    mine = output if not ctx.distributed else part_path(output, ctx.rank, ctx.world_size)
    files = [output, *parts]
    return files, mine


def _load_done(files: list[Path], mine: Path | None, positions: dict[str, int], log: Callable[[str], None]) -> dict[str, ResultRow]:
    """Decoded rows already on disk, by key. Error rows are not kept (they are redone); a decoded row
    whose id is not in the input stops the run (a different input, or a different output file)."""
    done: dict[str, ResultRow] = {}
    for path in files:
        back = read_rows(path, repair=path == mine)
        if back.torn_bytes and path == mine:
            log(f"{path}: dropped a torn last line ({back.torn_bytes} bytes); its row is decoded again")
        for row in back.rows:
            key = row_key(row)
            if "error" in row:
                continue
            if key not in positions:
                raise InvalidInputError(f"{path} holds id {row['id']!r}, which is not in the input; use a fresh --output")
            done.setdefault(key, row)
    return done


# ---------------------------------------------------------------------------------------------- decode
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


def _seed_runs(idx: list[int], rows: list[EncodedRow], sampled: bool) -> list[list[int]]:
    """Split ``idx`` into runs of rows on consecutive input lines when sampling: ``generate_batch`` seeds
    its row k with ``seed + k``, so a run seeded with ``seed + first line`` gives every row the seed
    ``seed + its line``, whatever the batch size, the rank count or the resume history."""
    if not sampled:
        return [idx]
    runs: list[list[int]] = []
    for k in idx:
        if runs and rows[k].row.line == rows[runs[-1][-1]].row.line + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def _generate(pipe: Any, rows: list[EncodedRow], config: RunConfig) -> list[Any]:
    """One :class:`GenerationResult` per row, in order; rows asking for different ``max_new_tokens``
    go to ``generate_batch`` as separate groups, and at temperature > 0 every row is seeded with
    ``--seed`` plus its input line."""
    results: list[Any] = [None] * len(rows)
    groups: dict[int, list[int]] = {}
    for k, row in enumerate(rows):
        groups.setdefault(row.max_new_tokens, []).append(k)
    for max_new, idx in groups.items():
        for run in _seed_runs(idx, rows, config.temperature > 0):
            out = pipe.generate_batch(
                [list(rows[k].ids) for k in run],
                max_new_tokens=max_new,
                temperature=config.temperature,
                seed=config.seed + rows[run[0]].row.line,
                top_p=config.top_p,
                top_k=config.top_k,
            )
            for k, res in zip(run, out):
                results[k] = res
    return results


def _decode_rows(pipe: Any, rows: list[EncodedRow], config: RunConfig) -> list[tuple[EncodedRow, Any]]:
    """(row, GenerationResult or RowError) per row. With ``--on-error skip`` a batch that fails is
    decoded row by row and a failing row becomes an error; otherwise the error propagates."""
    try:
        return list(zip(rows, _generate(pipe, rows, config)))
    except BastionError as exc:
        if config.on_error != "skip":
            raise
        if len(rows) == 1:
            return [(rows[0], RowError(rows[0].row.line, f"decoding failed: {exc}", rows[0].row.id))]
    return [pair for row in rows for pair in _decode_rows(pipe, [row], config)]


def _text(tokenizer: Any, tokens: list[int]) -> str:
    return str(tokenizer.decode(tokens, skip_special_tokens=True)) if tokenizer is not None else ""


class _Progress:
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


def _add(stats: RankStats, result: Any) -> RankStats:
    return attrs.evolve(
        stats,
        decoded=stats.decoded + 1,
        new_tokens=stats.new_tokens + len(result.tokens),
        steps=stats.steps + len(result.steps),
        committed=stats.committed + sum(s.accepted + 1 for s in result.steps),
        budget=stats.budget + sum(s.budget for s in result.steps),
    )


def _decode_work(
    pipe: Any, work: list[EncodedRow | RowError], writer: RowWriter | None, config: RunConfig, stats: RankStats, bar: _Progress
) -> tuple[dict[str, ResultRow], RankStats]:
    new: dict[str, ResultRow] = {}
    for batch in _batches(work, config.batch_size):
        rows = [i for i in batch if isinstance(i, EncodedRow)]
        t0 = time.perf_counter()
        with torch.inference_mode():
            decoded = dict((id(r), res) for r, res in _decode_rows(pipe, rows, config)) if rows else {}
        seconds = time.perf_counter() - t0
        out: list[ResultRow] = []
        for item in batch:
            res = decoded.get(id(item), item)
            if isinstance(res, RowError):
                row = error_row(res)
            else:
                row = ok_row(item.row, res, _text(pipe.tokenizer, res.tokens))  # type: ignore[union-attr]
                stats = _add(stats, res)
            out.append(row)
            new[_key(item)] = row
        stats = attrs.evolve(stats, decode_s=stats.decode_s + seconds)
        if writer is not None:
            writer.write(out)
        bar.update(len(rows), stats)
    return new, stats


# ---------------------------------------------------------------------------------------------- merge
def _ordered(rows: dict[str, ResultRow], positions: dict[str, int], n_items: int) -> list[ResultRow]:
    """One row per input position, in input order (a newer row for a position replaces an older one)."""
    by_pos: dict[int, ResultRow] = {}
    for key, row in rows.items():
        by_pos[positions[key]] = row
    missing = [k for k in range(n_items) if k not in by_pos]
    if missing:
        raise InvalidInputError(f"{len(missing)} rows are missing after the merge (first at input position {missing[0]})")
    return [by_pos[k] for k in range(n_items)]


def _file_keys(path: Path) -> list[str]:
    return [row_key(r) for r in read_rows(path, repair=False).rows]


# ---------------------------------------------------------------------------------------------- run
def run_prompts(
    config: RunConfig,
    pipe: Any,
    ctx: DistContext | None = None,
    *,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> RunSummary | None:
    """Decode ``config.input`` with ``pipe`` (this rank's pipeline); return the pooled summary on rank 0
    and ``None`` on the other ranks. Input errors raise :class:`InvalidRowsError` (every bad line, in
    order) unless ``config.on_error == "skip"``."""
    ctx = ctx or DistContext()
    t_start = time.perf_counter()
    text = broadcast_object(_read_input(config.input) if ctx.is_main else None, ctx)
    items = encode_rows(
        parse_input(text).items,
        pipe.tokenizer,
        max_positions=pipe.target.max_positions,
        default_max_new_tokens=config.max_new_tokens,
        raw=config.raw,
    )
    if not items:
        raise InvalidInputError(f"input {config.input} holds no rows (one JSON object per line)")
    errors = [i for i in items if isinstance(i, RowError)]
    if errors and config.on_error == "stop":
        raise InvalidRowsError(
            f"{len(errors)} input line{'s' if len(errors) > 1 else ''} cannot be decoded "
            "(--on-error skip writes them as error rows and goes on):",
            [e.describe() for e in errors],
        )
    positions = _positions(items)
    files, mine = _journal_files(config, ctx)
    done = _load_done(files, mine, positions, log)

    valid = [i for i in items if isinstance(i, EncodedRow)]
    owned = _block(valid, ctx) + (errors if ctx.is_main else [])  # the positions this rank answers for
    owned.sort(key=lambda i: positions[_key(i)])
    work = [i for i in owned if isinstance(i, RowError) or _key(i) not in done]
    stats = RankStats(resumed=sum(1 for i in owned if isinstance(i, EncodedRow) and _key(i) in done))

    if config.to_stdout:
        writer = None if ctx.distributed else RowWriter(sys.stdout, fsync=False)
    else:
        writer = RowWriter(mine) if mine is not None else None
    desc = "run" if not ctx.distributed else f"run (rank 0 of {ctx.world_size})"
    bar = _Progress(sum(1 for i in work if isinstance(i, EncodedRow)), config.progress and ctx.is_main, desc)
    try:
        new, stats = _decode_work(pipe, work, writer, config, stats, bar)
    finally:
        bar.close()
        if writer is not None and not config.to_stdout:
            writer.close()

    answered = {**{_key(i): done[_key(i)] for i in owned if _key(i) in done}, **new}
    merged = _merge(config, ctx, files, answered, done, positions, len(items))
    all_stats = gather_objects(stats, ctx)
    if not ctx.is_main:
        return None
    assert all_stats is not None
    return RunSummary(
        input_rows=len(items),
        decoded=sum(s.decoded for s in all_stats),
        resumed=sum(s.resumed for s in all_stats),
        errors=sum(1 for r in merged if "error" in r) if merged is not None else len(errors),
        new_tokens=sum(s.new_tokens for s in all_stats),
        steps=sum(s.steps for s in all_stats),
        committed=sum(s.committed for s in all_stats),
        budget=sum(s.budget for s in all_stats),
        decode_s=max(s.decode_s for s in all_stats),
        wall_s=time.perf_counter() - t_start,
        world_size=ctx.world_size,
        output=config.output,
    )


def _merge(
    config: RunConfig,
    ctx: DistContext,
    files: list[Path],
    answered: dict[str, ResultRow],
    done: dict[str, ResultRow],
    positions: dict[str, int],
    n_items: int,
) -> list[ResultRow] | None:
    """Write the final output in input order where the rows are not already there; remove the parts.
    Returns the final rows on rank 0 when it wrote them (None when the output needed no rewrite)."""
    if not ctx.distributed:
        if config.to_stdout:
            return None
        output = Path(config.output)
        parts = [f for f in files if f != output]
        final = _ordered({**done, **answered}, positions, n_items)
        if parts or _file_keys(output) != [row_key(r) for r in final]:
            write_rows_atomic(output, final)
        _remove(parts, _parts_dir(config.output))
        return final
    gathered = gather_objects(answered, ctx)
    final = None
    if ctx.is_main:
        assert gathered is not None
        pooled: dict[str, ResultRow] = dict(done)
        for rows in gathered:
            pooled.update(rows)
        final = _ordered(pooled, positions, n_items)
        write_rows_atomic(None if config.to_stdout else config.output, final)
    barrier(ctx)  # the output is complete before any part file goes
    if not config.to_stdout:
        own = part_path(config.output, ctx.rank, ctx.world_size)
        stray = [f for f in files if f != Path(config.output) and f != own] if ctx.is_main else []
        _remove([own, *stray], None)
        barrier(ctx)  # every rank has removed its part: rank 0 removes the folder
        if ctx.is_main:
            _remove([], _parts_dir(config.output))
    return final


def _remove(files: list[Path], folder: Path | None) -> None:
    for f in files:
        f.unlink(missing_ok=True)
    if folder is not None and folder.is_dir() and not any(folder.iterdir()):
        try:
            folder.rmdir()
        except OSError:  # another rank's part appeared meanwhile: leave the folder
            pass
