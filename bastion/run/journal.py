"""Output rows of ``bastion run`` and the append-only JSON Lines files that hold them.

A finished row is written as one line and flushed at once, so a crash loses at most the line being
written. Reading a file back for a resume drops a torn last line (a line cut short by a crash: no
newline at its end, or not valid JSON) by truncating the file there; its row is decoded again. A bad line
anywhere else is not ours to guess about and stops the run with its line number.

Every input line maps to one output row and one key: ``id:<canonical id>`` for a decoded row,
``line:<n>`` for an error row (an input line that could not be decoded, which may have no usable id).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import IO, Any, Iterable

from attrs import frozen

from bastion.core.errors import InvalidInputError
from bastion.core.files import atomic_path
from bastion.core.types import GenerationResult
from bastion.run.inputs import InputRow, RowError, id_key

__all__ = [
    "ResultRow",
    "ReadBack",
    "ok_row",
    "error_row",
    "row_key",
    "item_key",
    "read_rows",
    "RowWriter",
    "write_rows_atomic",
]

#: an output row as written: a JSON object
ResultRow = dict[str, Any]


def ok_row(row: InputRow, result: GenerationResult, text: str) -> ResultRow:
    """The output row of a decoded input row."""
    return {
        "id": row.id,
        "text": text,
        "token_ids": list(result.tokens),
        "new_tokens": len(result.tokens),
        "acceptance_length": round(float(result.acceptance_length), 4),
        "mean_budget": round(float(result.mean_budget), 4),
        "seconds": round(float(result.wall_s), 4),
        "stop_reason": result.stop_reason,
    }


def error_row(error: RowError) -> ResultRow:
    """The output row of an input line that could not be decoded (``--on-error skip``)."""
    return {"id": error.id, "line": error.line, "error": error.message}


def row_key(row: ResultRow) -> str:
    """The key of an output row (see the module docstring)."""
    if "error" in row:
        return f"line:{row['line']}"
    return f"id:{id_key(row['id'])}"


def item_key(item: InputRow | RowError) -> str:
    """The key the output row of an input item will have."""
    return f"line:{item.line}" if isinstance(item, RowError) else f"id:{item.key}"


def _is_row(obj: Any) -> bool:
    if not isinstance(obj, dict) or "id" not in obj:
        return False
    return ("error" in obj and isinstance(obj.get("line"), int)) or "token_ids" in obj


@frozen
class ReadBack:
    """The rows of an output file, and how many bytes of a torn last line were dropped (0: none)."""

    rows: tuple[ResultRow, ...]
    torn_bytes: int = 0


def read_rows(path: str | Path, *, repair: bool = True) -> ReadBack:
    """Rows of an existing output file (none when it does not exist). With ``repair`` a torn last line
    is cut off the file; a malformed line before it raises :class:`InvalidInputError` with its number."""
    path = Path(path)
    if not path.is_file():
        return ReadBack(())
    data = path.read_bytes()
    lines = data.split(b"\n")
    last_line = max((k for k, raw in enumerate(lines, start=1) if raw.strip()), default=0)
    rows: list[ResultRow] = []
    good_end = 0  # byte offset just past the last good line
    offset = 0
    for number, raw in enumerate(lines, start=1):
        complete = number < len(lines)  # every piece but the last ended with a newline
        end = offset + len(raw) + (1 if complete else 0)
        if raw.strip():
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                obj = None
            if obj is None or not _is_row(obj) or not complete:
                if number == last_line:  # a torn last line: redone, never kept
                    break
                raise InvalidInputError(f"{path} line {number}: not a bastion run output row; use a fresh --output")
            rows.append(obj)
        good_end = end
        offset = end
    torn = len(data) - good_end
    if torn and repair:
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
    return ReadBack(tuple(rows), torn)


class RowWriter:
    """Appends rows to a JSON Lines file (or a text stream such as stdout), one flushed line per row."""

    def __init__(self, target: str | Path | IO[str], *, fsync: bool = True) -> None:
        if isinstance(target, (str, Path)):
            path = Path(target)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh: IO[str] = open(path, "a", encoding="utf-8")
            self._owned = True
        else:
            self._fh = target
            self._owned = False
        self._fsync = fsync and self._owned

    def write(self, rows: Iterable[ResultRow]) -> None:
        for row in rows:
            self._fh.write(json.dumps(row, ensure_ascii=False) + "\n")  # one write per line
        self._fh.flush()
        if self._fsync:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._owned:
            self._fh.close()

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


def write_rows_atomic(target: str | Path | None, rows: Iterable[ResultRow]) -> None:
    """Write ``rows`` as the whole content of ``target`` (``None``: stdout): a temporary file next to it,
    synced, then renamed over it, so a crash leaves either the old file or the new one."""
    if target is None:
        RowWriter(sys.stdout, fsync=False).write(rows)
        return
    with atomic_path(target) as tmp, RowWriter(tmp) as writer:
        writer.write(rows)
