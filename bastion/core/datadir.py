"""Where bastion looks for the public data sets (GSM8K, HumanEval, MT-bench, AlpacaEval)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DATA_DIR_ENV", "default_data_dir"]

DATA_DIR_ENV = "BASTION_DATA_DIR"


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
