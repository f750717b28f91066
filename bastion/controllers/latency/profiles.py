"""Latency profiles on disk: one JSON file mapping ``"<device>::<model signature>"`` to fitted parameters.

A profile stores the roofline parameters together with the device peaks they were fitted against (the
parameters are multipliers on ``flops / peak`` and ``bytes / bandwidth``, so they only make sense with
the same peaks).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bastion.utils.files import read_json_cache, update_json_cache, warn_cache
from bastion.utils.folders import cache_dir

__all__ = ["PROFILE_FILE", "default_profile_path", "profile_key", "read_profiles", "load_profile", "save_profile"]

PROFILE_FILE = "latency_profiles.json"
_VERSION = 1


def default_profile_path() -> Path:
    """``<user cache dir>/bastion/latency_profiles.json`` (see :func:`bastion.utils.folders.cache_dir`)."""
    return cache_dir() / PROFILE_FILE


def profile_key(device: str, model: str) -> str:
    return f"{device}::{model}"


def read_profiles(path: str | Path) -> dict[str, dict[str, Any]]:
    """All well-formed profiles in ``path`` (empty when the file does not exist). The file is an optional
    cache: when it is not valid JSON or not shaped as profiles, or an entry is not an object, that part
    is ignored with a :class:`~bastion.utils.files.CacheWarning`."""
    path = Path(path)
    data = read_json_cache(path, "latency profile file")
    if data is None:
        return {}
    profiles = data.get("profiles")
    if not isinstance(profiles, dict):
        warn_cache(f"latency profile file {path} lacks a 'profiles' object")
        return {}
    good = {k: v for k, v in profiles.items() if isinstance(v, dict)}
    if len(good) != len(profiles):
        warn_cache(f"latency profile file {path}: entries {sorted(set(profiles) - set(good))} are not objects")
    return good


def load_profile(path: str | Path, device: str, model: str) -> dict[str, Any] | None:
    """The profile for (device, model) in ``path``, or ``None``."""
    return read_profiles(path).get(profile_key(device, model))


def save_profile(path: str | Path, device: str, model: str, entry: dict[str, Any]) -> Path:
    """Insert or replace the (device, model) profile in ``path``, keeping the others. Safe with other
    threads and processes saving to the same file: the file is locked, re-read and merged at write time,
    and replaced atomically. An unreadable file is replaced by a fresh one."""
    path = Path(path)
    record = {**entry, "device": device, "model": model, "saved": time.time()}

    def merge(data: dict[str, Any]) -> dict[str, Any]:
        profiles = data.get("profiles") if isinstance(data.get("profiles"), dict) else {}
        profiles = {k: v for k, v in profiles.items() if isinstance(v, dict)}
        profiles[profile_key(device, model)] = record
        return {"version": _VERSION, "profiles": profiles}

    update_json_cache(path, "latency profile file", merge)
    return path
