"""Latency profiles on disk: one JSON file mapping ``"<device>::<model signature>"`` to fitted parameters.

A profile stores the roofline parameters together with the device peaks they were fitted against (the
parameters are multipliers on ``flops / peak`` and ``bytes / bandwidth``, so they only make sense with
the same peaks).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bastion.core.errors import InvalidInputError
from bastion.core.files import write_json_atomic
from bastion.core.folders import cache_dir

__all__ = ["PROFILE_FILE", "default_profile_path", "profile_key", "read_profiles", "load_profile", "save_profile"]

PROFILE_FILE = "latency_profiles.json"
_VERSION = 1


def default_profile_path() -> Path:
    """``<user cache dir>/bastion/latency_profiles.json`` (see :func:`bastion.core.folders.cache_dir`)."""
    return cache_dir() / PROFILE_FILE


def profile_key(device: str, model: str) -> str:
    return f"{device}::{model}"


def read_profiles(path: str | Path) -> dict[str, dict[str, Any]]:
    """All profiles in ``path`` (empty when the file does not exist). A malformed file is an error."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise InvalidInputError(f"latency profile file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict):
        raise InvalidInputError(f"latency profile file {path} lacks a 'profiles' object")
    return data["profiles"]


def load_profile(path: str | Path, device: str, model: str) -> dict[str, Any] | None:
    """The profile for (device, model) in ``path``, or ``None``."""
    return read_profiles(path).get(profile_key(device, model))


def save_profile(path: str | Path, device: str, model: str, entry: dict[str, Any]) -> Path:
    """Insert or replace the (device, model) profile in ``path``, keeping the others; atomic write."""
    path = Path(path)
    profiles = read_profiles(path)
    profiles[profile_key(device, model)] = {**entry, "device": device, "model": model, "saved": time.time()}
    return write_json_atomic(path, {"version": _VERSION, "profiles": profiles})
