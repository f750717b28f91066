"""Resuming ``bastion run``: which files hold rows, whether the output is ours to write, which rows are
done already, and whether they were decoded from the requests this run would decode.

The files: the output, and under torchrun one part file per rank (``OUT.parts/part-RRRRR-of-WWWWW.jsonl``).
Before anything is written rank 0 claims the output (:func:`claim_output`): the paths make sense, and
the output is either new, empty, ours (a manifest, :mod:`bastion.run.manifest`) or replaced on
``--overwrite``. Every rank then reads the rows it can see (:func:`load_done`), each checked against the
manifest: a decoded row whose request or model changed since is refused, never silently kept.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping

from bastion.contract.errors import FileSystemError, InvalidInputError
from bastion.run.inputs import InputRow
from bastion.run.journal import ResultRow, is_error_row, read_rows, row_key
from bastion.run.manifest import Manifest, check_paths, foreign_content, manifest_path, read_manifest

__all__ = ["part_path", "parts_dir", "part_files", "journal_files", "claim_output", "remove_parts", "load_done"]

_FRESH_HINT = "pass --overwrite to decode everything again, or choose another --output"


def part_path(output: str | Path, rank: int, world_size: int) -> Path:
    """The part file rank ``rank`` of a ``world_size``-rank run appends to."""
    out = Path(output)
    return out.with_name(out.name + ".parts") / f"part-{rank:05d}-of-{world_size:05d}.jsonl"


def parts_dir(output: str | Path) -> Path:
    """The folder of the part files of ``output``."""
    return part_path(output, 0, 1).parent


def part_files(output: str | Path) -> list[Path]:
    """The part files of ``output`` this process can see, in name order."""
    folder = parts_dir(output)
    if folder.exists() and not folder.is_dir():
        raise FileSystemError(f"{folder} is not a folder; bastion run keeps the part files of {output} there")
    return sorted(folder.glob("part-*-of-*.jsonl")) if folder.is_dir() else []


def journal_files(output: str, rank: int, world_size: int) -> tuple[list[Path], Path]:
    """(files to read done rows from, the one file this rank repairs and appends to)."""
    out = Path(output)
    mine = out if world_size == 1 else part_path(out, rank, world_size)
    return [out, *part_files(output)], mine


def remove_parts(output: str | Path) -> None:
    """Delete the part files of ``output`` this process can see."""
    for f in part_files(output):
        f.unlink(missing_ok=True)


def claim_output(input_path: str | None, output: str, *, overwrite: bool, log: Callable[[str], None]) -> Manifest | None:
    """Check that ``output`` may be written (rank 0, with the output's lock held) and return the manifest
    of the run that wrote it, or None when it starts fresh. ``overwrite`` deletes the output, its part
    files and its manifest first. An existing output or part files without a manifest raise
    :class:`InvalidInputError` (they are not ours to append to or cut)."""
    check_paths(input_path, output)
    parts = part_files(output)
    mpath = manifest_path(output)
    if overwrite:
        out = Path(output)
        existed = out.is_file() and out.stat().st_size > 0 or bool(parts)
        for f in (out, *parts, mpath):
            try:
                f.unlink(missing_ok=True)
            except OSError as exc:
                raise FileSystemError(f"{f}: cannot delete it for --overwrite: {exc.strerror or exc}") from None
        if existed:
            log(f"{output}: --overwrite: the earlier rows are deleted; every row is decoded again")
        return None
    manifest = read_manifest(mpath)
    if manifest is None:
        found = foreign_content(output, parts)
        if found:
            raise InvalidInputError(
                f"{found} exists, but no manifest {mpath} says bastion run wrote it for this input; bastion run "
                f"never overwrites or cuts files it did not write: {_FRESH_HINT}"
            )
    return manifest


def _changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    return ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


def _check_done(
    done: dict[str, tuple[Path, ResultRow]],
    rows: Mapping[str, InputRow],
    digests: Mapping[str, str],
    previous: Manifest | None,
    *,
    output: str,
    model: Mapping[str, Any],
    settings: Mapping[str, Any],
) -> None:
    if not done:
        return
    if previous is None:
        path = next(iter(done.values()))[0]
        raise InvalidInputError(f"{path} holds rows, but no manifest {manifest_path(output)} says bastion run wrote them; {_FRESH_HINT}")
    if dict(previous.model) != dict(model):
        raise InvalidInputError(
            f"{output} was decoded by another model ({_changes(previous.model, model)}); {_FRESH_HINT}"
        )
    changed = [k for k in done if previous.rows.get(k) is None or previous.rows.get(k) != digests.get(k)]
    if not changed:
        return
    if dict(previous.settings) != dict(settings):
        raise InvalidInputError(
            f"{output} was decoded with other settings ({_changes(previous.settings, settings)}); "
            f"rerun with the earlier settings to resume, or {_FRESH_HINT}"
        )
    first = min((rows[k] for k in changed), key=lambda r: r.line)
    raise InvalidInputError(
        f"input line {first.line} (id {first.id!r}) is not the request {output} decoded for that id "
        f"({len(changed)} changed row{'s' if len(changed) > 1 else ''}: the input changed since); {_FRESH_HINT}"
    )


def load_done(
    files: list[Path],
    mine: Path | None,
    rows: Mapping[str, InputRow],
    digests: Mapping[str, str],
    previous: Manifest | None,
    *,
    output: str,
    model: Mapping[str, Any],
    settings: Mapping[str, Any],
    log: Callable[[str], None],
) -> dict[str, ResultRow]:
    """Decoded rows already on disk, by key (``rows``: the valid input rows by key). Error rows are not
    kept (they are redone). Only ``mine`` is repaired (a torn last line cut off). A decoded row whose id
    is not in the input, or whose request, settings or model differ from the ones it was decoded with
    (``previous``, the output's manifest), raises :class:`InvalidInputError`."""
    done: dict[str, tuple[Path, ResultRow]] = {}
    for path in files:
        back = read_rows(path, repair=path == mine)
        if back.torn_bytes and path == mine:
            log(f"{path}: dropped a torn last line ({back.torn_bytes} bytes); its row is decoded again")
        for row in back.rows:
            if is_error_row(row):
                continue
            key = row_key(row)
            if key not in rows:
                shown = json.loads(key.split(":", 1)[1])
                raise InvalidInputError(f"{path} holds id {shown!r}, which is not in the input; {_FRESH_HINT}")
            done.setdefault(key, (path, row))
    _check_done(done, rows, digests, previous, output=output, model=model, settings=settings)
    return {k: row for k, (_, row) in done.items()}
