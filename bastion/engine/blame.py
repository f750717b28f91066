"""Name the component behind an exception raised while decoding.

A plugin component that raises (an ``IndexError`` in a tree builder, a ``RuntimeError`` in a
controller) should reach the caller as a bastion error that says which component broke, from which
plugin, in which stage, so ``BastionError`` is the one thing a caller catches. :func:`blame` reads the
traceback: the deepest frame running code of one of the pipeline's components names it.
"""

from __future__ import annotations

import traceback
from typing import Any, Mapping

from bastion.contract.errors import BastionError, ComponentError

__all__ = ["blame", "plugin_of"]


def plugin_of(component: object, registry: Any) -> str:
    """The plugin that registered ``component``'s class (``"builtin"`` for bastion's own), or
    ``"runtime"`` when no registered factory names it (an instance built by hand)."""
    cls = type(component)
    dotted = f"{cls.__module__}:{cls.__qualname__}"
    try:
        infos = registry.components()
    except Exception:  # noqa: BLE001 - naming must never fail
        return "runtime"
    for info in infos:
        if info.factory is cls or info.factory == dotted:
            return f"{info.plugin} ({info.source})"
    return "builtin" if cls.__module__.startswith("bastion.") else "runtime"


def blame(exc: BaseException, components: Mapping[str, object], registry: Any) -> BaseException:
    """``exc`` as the error a caller sees: bastion's own errors (and non-``Exception`` signals) as they
    are; anything else as a :class:`ComponentError` naming the component whose code raised it (its
    kind, class, method and plugin), chained to the original."""
    if isinstance(exc, BastionError) or not isinstance(exc, Exception):
        return exc
    modules = {type(c).__module__: kind for kind, c in components.items() if c is not None}
    found: tuple[str, str] | None = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        kind = modules.get(frame.f_globals.get("__name__", ""))
        if kind is not None:
            found = (kind, frame.f_code.co_name)  # the deepest frame of a component wins
    if found is None:
        return exc
    kind, method = found
    component = components[kind]
    err = ComponentError(
        f"{kind} {type(component).__name__}.{method} (plugin {plugin_of(component, registry)}) raised "
        f"{type(exc).__name__}: {exc}"
    )
    err.__cause__ = exc
    return err
