"""Decode a whole prompt file with one pipeline per process, resumably, data parallel under torchrun.

One process (``python -m bastion run``) appends each finished batch of rows to ``--output`` in input
order. Under ``torchrun`` every rank decodes its contiguous block of the valid rows and appends them to
its own part file ``<output>.parts/part-RRRRR-of-WWWWW.jsonl``; once all ranks are done, rank 0 gathers
the rows through ``torch.distributed`` (no shared file system needed), writes ``--output`` in input order
in one atomic replace, and the part files are removed. A rerun with the same output skips every id
already decoded in the output or in any part file it can see (each rank repairs only the files it
writes: its own part, and rank 0 the output); error rows are always redone.

Before anything is written, rank 0 locks the output and checks that it is ours to write
(:mod:`bastion.run.resume`, :mod:`bastion.run.manifest`), and every rank checks the rows it found
against the manifest. The model is loaded only when some row is left to decode.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar

from attrs import field, frozen

from bastion.utils.checks import positive_int
from bastion.utils.files import decode_utf8, read_text_file
from bastion.contract.errors import BastionError, InvalidInputError, InvalidRowsError
from bastion.engine.params import check_setting
from bastion.distributed import DistContext, barrier, broadcast_object, gather_objects
from bastion.run.decode import Progress, RankStats, decode_work
from bastion.run.encode import EncodedRow, encode_rows
from bastion.run.inputs import InputRow, RowError
from bastion.run.parse import parse_input
from bastion.run.journal import ResultRow, RowWriter, item_key, read_rows, row_key, write_rows_atomic
from bastion.run.manifest import Manifest, OutputLock, check_paths, holder_now, input_digest, manifest_path, read_manifest, row_digest, write_manifest
from bastion.run.resume import claim_output, journal_files, load_done, part_path, parts_dir, remove_parts
from bastion.run.settings import Decode

__all__ = ["RunConfig", "RunSummary", "run_prompts", "run_file", "part_path", "STDIO"]

#: the file name that stands for stdin (``--input``) or stdout (``--output``)
STDIO = "-"

OnError = Literal["stop", "skip"]
T = TypeVar("T")


def _setting(name: str) -> Callable[[object], Any]:
    """attrs converter: the command line's ``--NAME`` checked by the rule every path applies
    (:func:`bastion.engine.params.check_setting`), the error naming the option."""

    def convert(value: object) -> Any:
        try:
            return check_setting(name, value)
        except InvalidInputError as exc:
            raise InvalidInputError(f"--{name.replace('_', '-')}: {exc}") from None

    return convert


def _on_error(_inst: object, _attr: object, value: object) -> None:
    if value not in ("stop", "skip"):
        raise InvalidInputError(f"--on-error must be 'stop' or 'skip', got {value!r}")


@frozen
class RunConfig:
    """What one ``bastion run`` decodes and where the rows go. ``max_new_tokens``, ``temperature``,
    ``top_p``, ``top_k`` and ``seed`` apply to the rows that do not set their own; they are checked
    here, before any model loads. ``model``: what names the model in the output's manifest (a resume
    with another model is refused); ``overwrite``: replace an existing output instead of resuming it."""

    input: str
    output: str
    batch_size: int = field(default=8, validator=positive_int)
    max_new_tokens: int = field(default=128, converter=_setting("max_new_tokens"))  # rows without their own max_new_tokens
    temperature: float = field(default=0.0, converter=_setting("temperature"))
    seed: int = field(default=0, converter=_setting("seed"))
    top_p: float = field(default=1.0, converter=_setting("top_p"))
    top_k: int = field(default=0, converter=_setting("top_k"))
    on_error: OnError = field(default="stop", validator=_on_error)
    raw: bool = False  # feed ``prompt`` text without the chat template
    progress: bool = True
    overwrite: bool = False
    model: dict[str, Any] = field(factory=dict)

    @property
    def to_stdout(self) -> bool:
        return self.output == STDIO

    @property
    def defaults(self) -> Decode:
        """The settings of a row that sets none (its seed: ``seed`` plus its line, added per row)."""
        return Decode(self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.seed)

    @property
    def settings(self) -> dict[str, Any]:
        """The command line's decode settings as the manifest records them."""
        return {**self.defaults.as_json(), "seed": self.seed if self.temperature > 0 else None, "raw": self.raw}

    @property
    def model_name(self) -> str:
        """The model's name in OpenAI-shaped output rows (a request's own ``model`` wins)."""
        return str(self.model.get("target") or "bastion")


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
        if self.decoded == 0 and self.errors == 0 and self.resumed == self.input_rows:
            return f"nothing to do: all {self.input_rows} rows are in {where} ({self.wall_s:.1f}s wall)"
        return (
            f"{self.input_rows} rows: {self.decoded} decoded, {self.resumed} already done, {self.errors} errors"
            f" | {self.new_tokens} new tokens in {self.decode_s:.1f}s ({self.tokens_per_second:.1f} tok/s)"
            f" | acceptance {self.acceptance_length:.2f}, mean budget {self.mean_budget:.1f}"
            f" | {self.world_size} rank{'s' if self.world_size > 1 else ''}, {self.wall_s:.1f}s wall -> {where}"
        )


# ---------------------------------------------------------------------------------------------- ranks
def _on_main(ctx: DistContext, fn: Callable[[], T]) -> T:
    """``fn()`` run on rank 0, its value on every rank; a :class:`BastionError` it raises is raised on
    every rank (rank 0 its own, the others one saying rank 0 stopped), so no rank waits forever."""
    outcome: Any = None
    error: BastionError | None = None
    if ctx.is_main:
        try:
            outcome = ("ok", fn())
        except BastionError as exc:
            error, outcome = exc, ("error", str(exc))
    outcome = broadcast_object(outcome, ctx)
    if outcome[0] == "error":
        barrier(ctx)  # every rank has the news before any leaves the group
        if error is not None:
            raise error
        raise InvalidInputError(f"rank 0 stopped the run: {outcome[1]}")
    return outcome[1]  # type: ignore[no-any-return]


def _on_every(ctx: DistContext, fn: Callable[[], T]) -> T:
    """``fn()`` on every rank; when any rank raises a :class:`BastionError` every rank raises (its own,
    or one naming the first failing rank)."""
    value: Any = None
    error: BastionError | None = None
    try:
        value = fn()
    except BastionError as exc:
        error = exc
    if ctx.distributed:
        reports = gather_objects(None if error is None else str(error), ctx)
        first = broadcast_object(next(((r, m) for r, m in enumerate(reports or []) if m is not None), None), ctx)
        if first is not None:
            barrier(ctx)  # every rank has the news before any leaves the group
        if error is None and first is not None:
            raise InvalidInputError(f"rank {first[0]} stopped the run: {first[1]}")
    if error is not None:
        raise error
    return value  # type: ignore[no-any-return]


def _total(count: int, ctx: DistContext) -> int:
    """The sum of ``count`` over the ranks, on every rank."""
    counts = gather_objects(count, ctx)
    return broadcast_object(sum(counts) if counts is not None else 0, ctx)


# ---------------------------------------------------------------------------------------------- input
def _rows_error(errors: list[RowError]) -> InvalidRowsError:
    """The error of a run stopped by bad input lines: its first line names the first bad line and why
    (one bad line: that is all), the lines below list every one."""
    first = errors[0].describe()
    if len(errors) == 1:
        return InvalidRowsError(f"{first} (--on-error skip writes it as an error row and goes on)", [])
    return InvalidRowsError(
        f"{len(errors)} input lines cannot be decoded (--on-error skip writes them as error rows and goes on); the first: {first}",
        [e.describe() for e in errors],
    )


def _read_input(path: str) -> str:
    """The input's text; a missing, unreadable or non-UTF-8 file raises an error naming it."""
    if path == STDIO:
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8")
        return decode_utf8(data, "stdin")
    return read_text_file(path, "input file")


def _positions(items: tuple[InputRow | RowError, ...]) -> dict[str, int]:
    """Output-row key -> input position, for both keys an item's row may have."""
    pos: dict[str, int] = {}
    for k, item in enumerate(items):
        pos[f"line:{item.line}"] = k
        if isinstance(item, InputRow):
            pos[f"id:{item.key}"] = k
    return pos


def _block(items: list[Any], ctx: DistContext) -> list[Any]:
    """This rank's contiguous block of ``items`` (sizes differ by one at most): consecutive rows keep
    consecutive seeds in one ``generate_batch`` call (see :func:`bastion.run.decode.seed_runs`)."""
    n = len(items)
    return items[n * ctx.rank // ctx.world_size : n * (ctx.rank + 1) // ctx.world_size]


# ---------------------------------------------------------------------------------------------- run
def run_prompts(
    config: RunConfig,
    pipe: Any,
    ctx: DistContext | None = None,
    *,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> RunSummary | None:
    """Decode ``config.input`` with ``pipe`` (this rank's pipeline): :func:`run_file` with a pipeline
    already built."""
    return run_file(config, lambda: pipe, ctx, log=log)


def run_file(
    config: RunConfig,
    load_pipe: Callable[[], Any],
    ctx: DistContext | None = None,
    *,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> RunSummary | None:
    """Decode ``config.input``; return the pooled summary on rank 0 and ``None`` on the other ranks.
    ``load_pipe()`` builds this rank's pipeline, called only when some row is left to decode. Input
    errors raise :class:`InvalidRowsError` (every bad line, in order) unless ``config.on_error ==
    "skip"``; an output that is not ours, or was decoded from other requests, raises
    :class:`InvalidInputError` before anything is written (see :mod:`bastion.run.resume`)."""
    ctx = ctx or DistContext()
    t_start = time.perf_counter()
    text = _on_main(ctx, lambda: _read_input(config.input))
    parsed = parse_input(text).items
    if not parsed:
        raise InvalidInputError(f"input {config.input} holds no rows (one JSON object per line)")
    lock = OutputLock(config.output) if ctx.is_main and not config.to_stdout else None
    try:
        return _run(config, load_pipe, ctx, text, parsed, lock, log, t_start)
    finally:
        if lock is not None:
            _release(lock, config)


def _release(lock: OutputLock, config: RunConfig) -> None:
    """Clear the holder from the manifest (where this run wrote one) and release the lock."""
    if not lock.held:
        return
    try:
        mpath = manifest_path(config.output)
        manifest = read_manifest(mpath)
        if manifest is not None and manifest.holder:
            write_manifest(mpath, Manifest(manifest.input, manifest.model, manifest.settings, manifest.rows, None))
    except BastionError:
        pass  # the holder note is advice; a stale one is never read while nobody holds the lock
    finally:
        lock.release()


def _run(
    config: RunConfig,
    load_pipe: Callable[[], Any],
    ctx: DistContext,
    text: str,
    parsed: tuple[InputRow | RowError, ...],
    lock: OutputLock | None,
    log: Callable[[str], None],
    t_start: float,
) -> RunSummary | None:
    positions = _positions(parsed)
    valid = [i for i in parsed if isinstance(i, InputRow)]
    by_key = {f"id:{r.key}": r for r in valid}
    digests = {k: d for k, r in by_key.items() if (d := row_digest(r, config.defaults, config.raw)) is not None}
    files: list[Path] = []
    mine: Path | None = None
    done: dict[str, ResultRow] = {}
    if not config.to_stdout:

        def claim() -> Manifest | None:
            assert lock is not None
            input_path = None if config.input == STDIO else config.input
            check_paths(input_path, config.output)  # before the lock file is created beside the output
            lock.acquire()
            return claim_output(input_path, config.output, overwrite=config.overwrite, log=log)

        previous = _on_main(ctx, claim)
        if config.overwrite and not ctx.is_main:
            remove_parts(config.output)  # the part files rank 0 cannot see (no shared file system)
        files, mine = journal_files(config.output, ctx.rank, ctx.world_size)
        done = _on_every(ctx, lambda: load_done(
            files, mine, by_key, digests, previous, output=config.output, model=config.model, settings=config.settings, log=log,
        ))  # fmt: skip
        manifest = Manifest(
            input={"path": config.input, "sha256": input_digest(text)}, model=dict(config.model), settings=config.settings,
            rows=digests, holder=holder_now(),
        )  # fmt: skip
        _on_main(ctx, lambda: write_manifest(manifest_path(config.output), manifest))

    parse_errors = [i for i in parsed if isinstance(i, RowError)]
    owned: list[InputRow | RowError] = _block(valid, ctx) + (parse_errors if ctx.is_main else [])  # this rank's positions
    owned.sort(key=lambda i: positions[item_key(i)])
    todo = [i for i in owned if isinstance(i, RowError) or item_key(i) not in done]
    stats = RankStats(resumed=sum(1 for i in owned if isinstance(i, InputRow) and item_key(i) in done))
    answered = {item_key(i): done[item_key(i)] for i in owned if item_key(i) in done}
    if _total(len(todo), ctx):
        new, stats = _decode(config, load_pipe(), ctx, parsed, positions, todo, mine, stats)
        answered.update(new)
    merged = _merge(config, ctx, files, answered, done, positions, len(parsed))
    all_stats = gather_objects(stats, ctx)
    if not ctx.is_main:
        return None
    assert all_stats is not None
    return RunSummary(
        input_rows=len(parsed),
        decoded=sum(s.decoded for s in all_stats),
        resumed=sum(s.resumed for s in all_stats),
        errors=sum(1 for r in merged if r.get("error") is not None) if merged is not None else len(parse_errors),
        new_tokens=sum(s.new_tokens for s in all_stats),
        steps=sum(s.steps for s in all_stats),
        committed=sum(s.committed for s in all_stats),
        budget=sum(s.budget for s in all_stats),
        decode_s=max(s.decode_s for s in all_stats),
        wall_s=time.perf_counter() - t_start,
        world_size=ctx.world_size,
        output=config.output,
    )


def _decode(
    config: RunConfig,
    pipe: Any,
    ctx: DistContext,
    parsed: tuple[InputRow | RowError, ...],
    positions: dict[str, int],
    todo: list[InputRow | RowError],
    mine: Path | None,
    stats: RankStats,
) -> tuple[dict[str, ResultRow], RankStats]:
    """Encode every row (every rank checks every line), stop on bad lines unless ``--on-error skip``,
    and decode this rank's ``todo`` rows, appending them to ``mine`` (or stdout)."""
    items = encode_rows(parsed, pipe.tokenizer, max_positions=pipe.target.max_positions, defaults=config.defaults, raw=config.raw)
    errors = [i for i in items if isinstance(i, RowError)]
    if errors and config.on_error == "stop":
        raise _rows_error(errors)
    work: list[EncodedRow | RowError] = [items[positions[item_key(i)]] for i in todo]
    if config.to_stdout:
        writer = None if ctx.distributed else RowWriter(sys.stdout, fsync=False)
    else:
        writer = RowWriter(mine) if mine is not None else None
    desc = "run" if not ctx.distributed else f"run (rank 0 of {ctx.world_size})"
    bar = Progress(sum(1 for i in work if isinstance(i, EncodedRow)), config.progress and ctx.is_main, desc)
    try:
        return decode_work(pipe, work, writer, batch_size=config.batch_size, skip=config.on_error == "skip",
                           model=config.model_name, stats=stats, bar=bar)  # fmt: skip
    finally:
        bar.close()
        if writer is not None and not config.to_stdout:
            writer.close()


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
        _remove(parts, parts_dir(config.output))
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
            _remove([], parts_dir(config.output))
    return final


def _remove(files: list[Path], folder: Path | None) -> None:
    for f in files:
        f.unlink(missing_ok=True)
    if folder is not None and folder.is_dir() and not any(folder.iterdir()):
        try:
            folder.rmdir()
        except OSError:  # another rank's part appeared meanwhile: leave the folder
            pass
