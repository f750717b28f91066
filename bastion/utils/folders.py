"""Where bastion keeps things on disk: the cache folder (device peaks, latency profiles) and the data
folder (the public data sets GSM8K, HumanEval, MT-bench, Spec-Bench, AlpacaEval), with the copies
bundled in the package (:func:`bundled_data_dir`) as the last resort."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["CACHE_ENV", "DATA_DIR_ENV", "cache_dir", "default_data_dir", "bundled_data_dir", "is_bundled", "data_file"]

#: environment variable overriding the cache directory
CACHE_ENV = "BASTION_CACHE_DIR"
#: environment variable naming the data folder
DATA_DIR_ENV = "BASTION_DATA_DIR"


def cache_dir() -> Path:
    """``$BASTION_CACHE_DIR`` if set, else the platform's user cache directory plus ``bastion``."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "bastion"


def bundled_data_dir() -> Path:
    """The data folder inside the installed package: the benchmark prompt sets and a small slice of the
    training sets (for ``bastion train --smoke``), each with its licence (see its ``README.md``)."""
    return Path(__file__).resolve().parent.parent / "data"


def is_bundled(path: str | Path) -> bool:
    """Whether ``path`` is the package's bundled data folder."""
    return Path(path).resolve() == bundled_data_dir()


def default_data_dir() -> Path:
    """``$BASTION_DATA_DIR`` if set, else the first of ``./data`` and ``../shared/data`` (relative to the
    working directory) holding a ``gsm8k`` folder, else the bundled copies (:func:`bundled_data_dir`).
    Training and benchmarks share it."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    for cand in (Path("data"), Path("..") / "shared" / "data"):
        if (cand / "gsm8k").is_dir():
            return cand
    return bundled_data_dir()


def data_file(data_dir: str | Path, relpath: str) -> Path:
    """``data_dir / relpath``, or its gzipped copy ``relpath + ".gz"`` when only that exists (the bundled
    sets are gzipped); the plain path when neither exists, for the caller's not-found error."""
    plain = Path(data_dir) / relpath
    packed = plain.with_name(plain.name + ".gz")
    return packed if not plain.exists() and packed.exists() else plain
