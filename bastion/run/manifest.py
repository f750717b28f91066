"""What makes an output file ``bastion run``'s own: its manifest, its lock, and the checks before a write.

``bastion run`` never destroys what it did not write. Beside ``--output OUT`` it keeps:

- ``OUT.manifest.json`` (the *manifest*), written atomically before any row: the input's path and
  SHA-256, the model (``--target``, ``--dtype``), the command line's decode settings, and for every
  valid input row a digest of its request (prompt or messages, endpoint, effective settings). A rerun
  resumes ``OUT`` only when every row already decoded there was decoded from the same request by the
  same model; anything else is refused (:class:`bastion.contract.errors.InvalidInputError` saying what
  changed), as is an existing non-empty ``OUT`` (or part files) without a manifest, unless
  ``--overwrite``. The manifest also names the process writing ``OUT`` while it runs.
- ``OUT.lock``: an exclusive lock (``filelock``) held for the whole run, so a second ``bastion run``
  on the same output fails at once, naming the holder (its pid and host, from the manifest). The file
  stays in place when the run ends (removing a lock file while others may open it is unsafe); deleting
  it while no run is active is harmless.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any, Mapping

import attrs
from attrs import field, frozen

from bastion.contract.errors import FileSystemError, InvalidFileError, InvalidInputError
from bastion.utils.files import write_json_atomic
from bastion.run.inputs import InputRow
from bastion.run.settings import Decode, resolve

__all__ = [
    "FORMAT",
    "Manifest",
    "manifest_path",
    "lock_path",
    "read_manifest",
    "write_manifest",
    "row_digest",
    "input_digest",
    "holder_now",
    "OutputLock",
    "check_paths",
]

#: the manifest's ``format`` field
FORMAT = "bastion-run/1"


def manifest_path(output: str | Path) -> Path:
    """The manifest beside ``output``."""
    out = Path(output)
    return out.with_name(out.name + ".manifest.json")


def lock_path(output: str | Path) -> Path:
    """The lock file beside ``output``."""
    out = Path(output)
    return out.with_name(out.name + ".lock")


@frozen
class Manifest:
    """What wrote an output: input, model, settings, one request digest per valid input row (by output
    key), and the process writing it now (``holder``: pid, host, since; None once the run ended)."""

    input: dict[str, Any] = field(factory=dict)
    model: dict[str, Any] = field(factory=dict)
    settings: dict[str, Any] = field(factory=dict)
    rows: dict[str, str] = field(factory=dict)
    holder: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, **attrs.asdict(self)}

    def describe_holder(self) -> str:
        """The holder in words (``pid 123 on host, since ...``), or a note that none is recorded."""
        h = self.holder or {}
        if not h.get("pid"):
            return "a process that has not recorded itself yet"
        return f"pid {h['pid']} on {h.get('host', '?')}, since {h.get('since', '?')}"


def read_manifest(path: str | Path) -> Manifest | None:
    """The manifest at ``path``, or None when there is none. A file there that is not a manifest raises
    :class:`InvalidFileError` naming it."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FileSystemError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidFileError(f"{path}: not a bastion run manifest ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InvalidFileError(f"{path}: not a bastion run manifest (no \"format\": \"{FORMAT}\")")
    try:
        rows = data["rows"]
        if not isinstance(rows, dict) or not all(isinstance(v, str) for v in rows.values()):
            raise TypeError("rows must map keys to digests")
        return Manifest(input=dict(data["input"]), model=dict(data["model"]), settings=dict(data["settings"]),
                        rows=dict(rows), holder=data.get("holder"))  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidFileError(f"{path}: not a bastion run manifest ({exc})") from None


def write_manifest(path: str | Path, manifest: Manifest) -> None:
    """Write ``manifest`` to ``path`` atomically; failures raise :class:`FileSystemError` naming it."""
    try:
        write_json_atomic(path, manifest.to_json(), indent=None)
    except OSError as exc:
        raise FileSystemError(f"{path}: cannot write it: {exc.strerror or exc}") from None


def input_digest(text: str) -> str:
    """The SHA-256 of an input's text (hex)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def row_digest(row: InputRow, defaults: Decode, raw: bool) -> str | None:
    """A digest of what ``row`` asks: its request and the settings it is decoded with over ``defaults``
    (the command line's; ``raw``: ``--raw``). None when the settings cannot be resolved (the row becomes
    an error row, never a decoded one)."""
    try:
        decode = resolve(row.settings, defaults, row.line)
    except InvalidInputError:
        return None
    what = {**row.request(), "raw": row.raw if row.raw is not None else raw, "settings": decode.as_json()}
    text = json.dumps(what, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def holder_now() -> dict[str, Any]:
    """This process as a lock holder: pid, host and the time it took the lock."""
    since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": since}


class OutputLock:
    """An exclusive, non-blocking lock on an output (``OUT.lock``) for the duration of a run.

    :meth:`acquire` fails at once when another process holds it, with a :class:`FileSystemError` that
    names the holder as its manifest records it."""

    def __init__(self, output: str | Path) -> None:
        from filelock import FileLock

        self.output = Path(output)
        self.path = lock_path(output)
        self._lock = FileLock(str(self.path), timeout=0)

    def acquire(self) -> None:
        from filelock import Timeout

        # the lock file is created here first: filelock reports a folder it cannot create files in
        # (read-only, missing, /proc) as a lock held by someone else
        try:
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644))
        except OSError as exc:
            raise FileSystemError(f"{self.path}: cannot create the lock file beside the output: {exc.strerror or exc}") from None
        try:
            self._lock.acquire()
        except Timeout:
            try:
                holder = (read_manifest(manifest_path(self.output)) or Manifest()).describe_holder()
            except (InvalidFileError, FileSystemError):
                holder = "another process"
            raise FileSystemError(
                f"{self.output} is being written by another bastion run ({holder}; lock {self.path}); "
                "wait for it to finish or choose another --output"
            ) from None
        except OSError as exc:
            raise FileSystemError(f"{self.path}: cannot create the lock file beside the output: {exc.strerror or exc}") from None

    @property
    def held(self) -> bool:
        """Whether this process holds the lock."""
        return bool(self._lock.is_locked)

    def release(self) -> None:
        if self.held:
            self._lock.release()

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.release()


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_paths(input_path: str | None, output: str | Path) -> None:
    """Refuse an output that is the input (also through a symlink, a hard link or another spelling),
    a directory, something other than a regular file, or inside something that is not a folder."""
    out = Path(output)
    if input_path is not None and _same_file(Path(input_path), out):
        raise InvalidInputError(f"--output {output} is the input file {input_path}; write the output to another file")
    if out.is_dir():
        raise FileSystemError(f"--output {output} is a directory; give a file path (for example {out / 'outputs.jsonl'})")
    if out.exists() and not out.is_file():
        raise FileSystemError(f"--output {output} exists and is not a regular file")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise FileSystemError(f"--output {output}: {parent} is not a folder")


def foreign_content(output: str | Path, parts: list[Path]) -> str | None:
    """What at ``output`` would be lost by writing there without a manifest: a description of the
    non-empty output file or the part files, or None when there is nothing (no file, or an empty one)."""
    out = Path(output)
    found = []
    if out.is_file() and out.stat().st_size > 0:
        found.append(f"{out} ({out.stat().st_size} bytes)")
    if parts:
        found.append(f"{len(parts)} part file{'s' if len(parts) > 1 else ''} in {parts[0].parent}")
    return " and ".join(found) or None


def same_model(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two manifests' ``model`` entries name the same model."""
    return dict(a) == dict(b)
