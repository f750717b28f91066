"""Reading and writing the files bastion keeps: JSON objects, safetensors headers, confined paths,
atomic replacement and cross-process locks. Every read error is an :class:`InvalidFileError` that names
the file and, where one is at fault, the field."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import threading
from pathlib import Path, PurePosixPath, PureWindowsPath
import warnings
from typing import Any, Callable, Iterator

from bastion.contract.errors import FileSystemError, InvalidFileError, InvalidInputError

__all__ = [
    "read_text_file",
    "decode_utf8",
    "read_json_object",
    "TensorInfo",
    "read_safetensors_header",
    "confined_path",
    "safetensors_files",
    "check_weights_folder",
    "FLOAT_DTYPES",
    "float_weight_error",
    "atomic_path",
    "atomic_write",
    "write_json_atomic",
    "file_lock",
    "CacheWarning",
    "read_json_cache",
    "update_json_cache",
]

#: bytes per element of the safetensors dtypes
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
#: a header larger than this is not a weights file (the format caps it at 100 MB)
_MAX_HEADER = 100_000_000


def read_text_file(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of the file at ``path`` (``what`` names it in errors: ``"--prompt-file"``,
    ``"input file"``...). A missing file raises :class:`InvalidInputError`, a folder or an unreadable
    file :class:`FileSystemError`, bytes that are not UTF-8 :class:`InvalidFileError` giving the first
    bad byte and its offset; every message names the path."""
    p = Path(path)
    if not p.exists():
        raise InvalidInputError(f"{what} {path} does not exist")
    if p.is_dir():
        raise FileSystemError(f"{what} {path} is a directory, not a file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise FileSystemError(f"{what} {path}: cannot read it: {exc.strerror or exc}") from None
    return decode_utf8(data, f"{what} {path}")


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8; other bytes raise :class:`InvalidFileError` naming ``where`` and the
    first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidFileError(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object stored at ``path``; unreadable, non-JSON or non-object content raises
    :class:`InvalidFileError` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidFileError(f"{path}: cannot read it ({exc})") from exc
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InvalidFileError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise InvalidFileError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


class TensorInfo:
    """One tensor entry of a safetensors header: dtype name and shape."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape

    def __repr__(self) -> str:
        return f"TensorInfo({self.dtype}, {self.shape})"


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Tensor names -> :class:`TensorInfo` from the header of the safetensors file at ``path``, reading
    only the header. Checks that the file is complete: every tensor's byte range lies inside the file
    and matches its dtype and shape. A truncated, empty or garbled file raises :class:`InvalidFileError`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise InvalidFileError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            n = int.from_bytes(prefix, "little")
            if n < 2 or n > _MAX_HEADER or 8 + n > size:
                raise InvalidFileError(
                    f"{path}: truncated or garbled safetensors file (header of {n} bytes in a file of {size})"
                )
            raw = f.read(n)
    except OSError as exc:
        raise InvalidFileError(f"{path}: cannot read it ({exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidFileError(f"{path}: garbled safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise InvalidFileError(f"{path}: garbled safetensors header (not an object)")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _tensor_info(path, name, entry, data_len)
    return out


def _tensor_info(path: Path, name: str, entry: Any, data_len: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise InvalidFileError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise InvalidFileError(f"{path}: tensor {name!r} has no dtype")
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise InvalidFileError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise InvalidFileError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    if offsets[1] > data_len:
        raise InvalidFileError(
            f"{path}: truncated: tensor {name!r} ends at byte {offsets[1]} of the data, which holds {data_len}"
        )
    width = _DTYPE_BYTES.get(dtype)
    if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
        raise InvalidFileError(f"{path}: tensor {name!r} ({dtype} {tuple(shape)}) has {offsets[1] - offsets[0]} bytes")
    return TensorInfo(dtype, tuple(shape))


def confined_path(folder: str | Path, name: object, *, source: str | Path, field: str) -> Path:
    """``folder / name`` for a relative file name read from ``source`` (its ``field``); absolute names
    and names that climb out of ``folder`` with ``..`` raise :class:`InvalidFileError`. The check is on
    the name itself, so symlinked files inside the folder (hub snapshots) still work."""
    if not isinstance(name, str) or not name:
        raise InvalidFileError(f"{source}: {field} must hold file names, found {name!r}")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts or ".." in windows.parts:
        raise InvalidFileError(f"{source}: {field} names {name!r}, outside the checkpoint folder; refused")
    return Path(folder) / posix


def safetensors_files(directory: str | Path, *, index_name: str = "model.safetensors.index.json",
                      single_name: str = "model.safetensors") -> list[Path]:
    """The safetensors files of a Hugging Face style weights folder: the shards its index names (each
    confined to the folder and checked to exist), else ``single_name``, else every ``*.safetensors``
    (possibly none). A broken index raises :class:`InvalidFileError` naming the file and field."""
    directory = Path(directory)
    index = directory / index_name
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidFileError(f"{index}: field weight_map is missing or not an object of tensor -> file")
        files = sorted({confined_path(directory, name, source=index, field="weight_map") for name in weight_map.values()})
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise InvalidFileError(f"{index}: weight_map names files that do not exist: {', '.join(absent)}")
        return files
    if (directory / single_name).is_file():
        return [directory / single_name]
    return sorted(directory.glob("*.safetensors"))


def check_weights_folder(directory: str | Path) -> dict[str, tuple[Path, TensorInfo]]:
    """Read ``config.json`` and every safetensors header of a local weights folder: a non-JSON config,
    a broken index or a truncated, empty or garbled weights file raises :class:`InvalidFileError`
    naming it, before a loader gets to it. Returns every tensor name -> (its file, its header entry)."""
    directory = Path(directory)
    if (directory / "config.json").is_file():
        read_json_object(directory / "config.json")
    found: dict[str, tuple[Path, TensorInfo]] = {}
    for path in safetensors_files(directory):
        found.update((name, (path, info)) for name, info in read_safetensors_header(path).items())
    return found


_TORCH_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                "U32": "uint32", "I64": "int64", "U64": "uint64"}

#: safetensors dtypes of floating weights
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})


def float_weight_error(path: Path, name: str, info: TensorInfo) -> InvalidFileError:
    """The error for the floating weight ``name`` of ``path`` stored in a non-floating dtype."""
    torch_name = _TORCH_NAMES.get(info.dtype, info.dtype.lower())
    return InvalidFileError(
        f"{path}: tensor {name!r} is stored as {info.dtype} ({torch_name}) {tuple(info.shape)}; weights must be floating point "
        f"(F32, BF16, F16...): integer or bool weights would be cast into nonsense"
    )


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a uniquely named temporary path in ``path``'s folder; when the block ends without an
    exception it is renamed over ``path`` (readers see the old file or the new one, never a torn one),
    else it is removed. For writers that need a path (``torch.save``, a row writer)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_path`), synced to disk first."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: str | Path, data: Any, *, indent: int | None = 1, sort_keys: bool = True) -> Path:
    """Write ``data`` as JSON (with a final newline) to ``path`` atomically; returns the path."""
    atomic_write(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
    return Path(path)


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` + ``.lock`` for the duration of the block: across processes
    (``fcntl.flock``; on systems without it, threads only) and across threads of this process."""
    lock_path = Path(str(path) + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    key = str(lock_path.resolve())
    with _THREAD_LOCKS_GUARD:
        thread_lock = _THREAD_LOCKS.setdefault(key, threading.Lock())
    with thread_lock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows
            yield
            return
        with open(lock_path, "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class CacheWarning(UserWarning):
    """An optional cache file is unreadable or wrongly typed: it is ignored, and rewritten on the next save."""


def read_json_cache(path: str | Path, what: str) -> dict[str, Any] | None:
    """The JSON object in the optional cache file ``path`` (``what`` names it in messages): None when the
    file does not exist, and also None, with a :class:`CacheWarning`, when it is unreadable, not JSON
    or not an object. A cache never stops a run."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return read_json_object(path)
    except InvalidFileError as exc:
        warn_cache(f"{what}: {exc}")
        return None


def warn_cache(message: str) -> None:
    """Warn that (part of) an optional cache is ignored."""
    warnings.warn(f"{message}; ignoring it (the next save rewrites it)", CacheWarning, stacklevel=3)


def update_json_cache(path: str | Path, what: str, update: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Read-modify-write the cache file ``path`` safely: under :func:`file_lock`, re-read at write time
    (so concurrent writers merge instead of overwriting each other; an unreadable file counts as empty),
    apply ``update`` and replace the file atomically."""
    with file_lock(path):
        write_json_atomic(path, update(read_json_cache(path, what) or {}))
