"""Where bastion keeps small cached files (device peaks, latency profiles)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["CACHE_ENV", "cache_dir"]

#: environment variable overriding the cache directory
CACHE_ENV = "BASTION_CACHE_DIR"


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
