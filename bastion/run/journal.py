"""Output rows of ``bastion run`` and the append-only JSON Lines files that hold them.

A finished row is written as one line and flushed at once, so a crash loses at most the line being
written. Reading a file back for a resume drops a torn last line (a line cut short by a crash: no
newline at its end, and not a complete JSON value other than a row) by truncating the file there; its
row is decoded again. A bad line anywhere else is not ours to guess about and stops the run with its
line number. File-system failures (a read-only folder, a full disk) raise
:class:`~bastion.contract.errors.FileSystemError` naming the file.

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

from bastion.contract.errors import FileSystemError, InvalidInputError
from bastion.utils.files import atomic_path
from bastion.contract.types import GenerationResult
from bastion.run.inputs import InputRow, RowError, id_key
from bastion.run.openai import error_response, is_response_row, ok_response, response_key_parts

__all__ = [
    "ResultRow",
    "ReadBack",
    "ok_row",
    "error_row",
    "row_key",
    "is_error_row",
    "item_key",
    "read_rows",
    "RowWriter",
    "write_rows_atomic",
]

#: an output row as written: a JSON object
ResultRow = dict[str, Any]


def ok_row(row: InputRow, result: GenerationResult, text: str, *, prompt_tokens: int = 0, model: str = "") -> ResultRow:
    """The output row of a decoded input row (an OpenAI batch response for an OpenAI request)."""
    own = {
        "text": text,
        "token_ids": list(result.tokens),
        "new_tokens": len(result.tokens),
        "acceptance_length": round(float(result.acceptance_length), 4),
        "mean_budget": round(float(result.mean_budget), 4),
        "seconds": round(float(result.wall_s), 4),
        "stop_reason": result.stop_reason,
    }
    if row.openai is not None:
        del own["text"]
        return ok_response(row, result, text, prompt_tokens=prompt_tokens, model=model, extra=own)
    return {"id": row.id, **own}


def error_row(error: RowError) -> ResultRow:
    """The output row of an input line that could not be decoded (``--on-error skip``)."""
    if error.openai:
        return error_response(error)
    return {"id": error.id, "line": error.line, "error": error.message}


def row_key(row: ResultRow) -> str:
    """The key of an output row (see the module docstring)."""
    if is_response_row(row):
        decoded, value = response_key_parts(row)
        return f"id:{id_key(value)}" if decoded else f"line:{value}"
    if "error" in row:
        return f"line:{row['line']}"
    return f"id:{id_key(row['id'])}"


def is_error_row(row: ResultRow) -> bool:
    """Whether an output row stands for an input line that could not be decoded."""
    return row.get("error") is not None


def item_key(item: InputRow | RowError) -> str:
    """The key the output row of an input item will have."""
    return f"line:{item.line}" if isinstance(item, RowError) else f"id:{item.key}"


def _is_row(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    if is_response_row(obj):
        return True
    if "id" not in obj:
        return False
    return ("error" in obj and isinstance(obj.get("line"), int)) or "token_ids" in obj


@frozen
class ReadBack:
    """The rows of an output file, and how many bytes of a torn last line were dropped (0: none)."""

    rows: tuple[ResultRow, ...]
    torn_bytes: int = 0


def _fs_error(path: str | Path, doing: str, exc: OSError) -> FileSystemError:
    cause = exc.strerror or str(exc)
    return FileSystemError(f"{path}: cannot {doing} it: {cause}")


def _torn(raw: bytes) -> bool:
    """Whether an unterminated last line is what a crash mid-write leaves: a cut-off row (not JSON) or a
    whole row whose newline was not written yet. A complete JSON value that is not a row is not ours."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return True
    return _is_row(obj)


def read_rows(path: str | Path, *, repair: bool = True) -> ReadBack:
    """Rows of an existing output file (none when it does not exist). A torn last line (no newline at
    its end, cut short or not yet ended by a crash) is left out, and with ``repair`` cut off the file;
    any other line that is not an output row raises :class:`InvalidInputError` naming the file and line."""
    path = Path(path)
    if not path.exists():
        return ReadBack(())
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _fs_error(path, "read", exc) from None
    lines = data.split(b"\n")
    rows: list[ResultRow] = []
    good_end = 0  # byte offset just past the last good line
    offset = 0
    for number, raw in enumerate(lines, start=1):
        complete = number < len(lines)  # every piece but the last ended with a newline
        end = offset + len(raw) + (1 if complete else 0)
        if raw.strip():
            if not complete and _torn(raw):  # a torn last line: redone, never kept
                break
            try:
                obj = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                obj = None
            if obj is None or not _is_row(obj):
                raise InvalidInputError(f"{path} line {number}: not a bastion run output row; use a fresh --output")
            rows.append(obj)
        good_end = end
        offset = end
    torn = len(data) - good_end
    if torn and repair:
        try:
            with open(path, "r+b") as fh:
                fh.truncate(good_end)
        except OSError as exc:
            raise _fs_error(path, "repair", exc) from None
    return ReadBack(tuple(rows), torn)


class RowWriter:
    """Appends rows to a JSON Lines file (or a text stream such as stdout), one flushed line per row.
    A file that cannot be written (a read-only folder, a full disk) raises :class:`FileSystemError`
    naming it."""

    def __init__(self, target: str | Path | IO[str], *, fsync: bool = True) -> None:
        self._path: Path | None = None
        if isinstance(target, (str, Path)):
            path = self._path = Path(target)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._fh: IO[str] = open(path, "a", encoding="utf-8")
            except OSError as exc:
                raise _fs_error(path, "write", exc) from None
            self._owned = True
        else:
            self._fh = target
            self._owned = False
        self._fsync = fsync and self._owned

    def write(self, rows: Iterable[ResultRow]) -> None:
        try:
            for row in rows:
                self._fh.write(json.dumps(row, ensure_ascii=False) + "\n")  # one write per line
            self._fh.flush()
            if self._fsync:
                os.fsync(self._fh.fileno())
        except OSError as exc:
            if self._path is None:
                raise
            raise _fs_error(self._path, "write", exc) from None

    def close(self) -> None:
        if self._owned:
            try:
                self._fh.close()
            except OSError as exc:  # the buffered tail of a full disk
                raise _fs_error(self._path or "output", "write", exc) from None

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


def write_rows_atomic(target: str | Path | None, rows: Iterable[ResultRow]) -> None:
    """Write ``rows`` as the whole content of ``target`` (``None``: stdout): a temporary file next to it,
    synced, then renamed over it, so a crash leaves either the old file or the new one. A failure to
    write raises :class:`FileSystemError` naming ``target``."""
    if target is None:
        RowWriter(sys.stdout, fsync=False).write(rows)
        return
    try:
        with atomic_path(target) as tmp, open(tmp, "w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise _fs_error(target, "write", exc) from None
