"""Where bastion keeps things on disk: the cache folder (device peaks, latency profiles) and the data
folder (the public data sets GSM8K, HumanEval, MT-bench, AlpacaEval)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["CACHE_ENV", "DATA_DIR_ENV", "cache_dir", "default_data_dir"]

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


def default_data_dir() -> Path:
    """``$BASTION_DATA_DIR`` if set, else the first of ``./data`` and ``../shared/data`` (relative to the
    working directory) holding a ``gsm8k`` folder, else ``./data``. Training and benchmarks share it."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    for cand in (Path("data"), Path("..") / "shared" / "data"):
        if (cand / "gsm8k").is_dir():
            return cand
    return Path("data")
