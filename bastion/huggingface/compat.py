"""Differences between transformers 5.x releases that bastion's model calls must bridge, in one place."""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["cache_kwarg", "cache_kwargs"]


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def cache_kwarg(model: Any) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` in recent transformers 5.x
    releases, ``past_key_values`` before the rename. Older releases silently ignore an unknown ``cache``
    keyword (the model then runs with no cache at all), so the name must be right, not merely accepted."""
    return _cache_kwarg_of(type(model))


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{<model's cache keyword>: cache, "use_cache": True}`` for a cached forward of ``model``."""
    return {cache_kwarg(model): cache, "use_cache": True}
