"""The bastion plugin namespace: hook markers and hook specifications.

Plugins (and bastion's own built-ins) implement these hooks on a module exposed through an entry point
in the ``bastion`` group::

    # pyproject.toml of a plugin package
    [project.entry-points.bastion]
    my_plugin = "my_plugin.hooks"

    # my_plugin/hooks.py
    from bastion.contract.hookspecs import hookimpl

    @hookimpl
    def bastion_register_components(register):
        register("drafter", "my-drafter", MyDrafter, description="...")
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import pluggy

from bastion.contract.interfaces import KINDS

__all__ = ["KINDS", "NAME", "Register", "bastion_register_components", "hookimpl", "hookspec"]

NAME = "bastion"
#: marker for hook specifications (used by bastion itself)
hookspec = pluggy.HookspecMarker(NAME)
#: marker for hook implementations (used by built-ins and plugins alike)
hookimpl = pluggy.HookimplMarker(NAME)

class Register(Protocol):
    """The callable passed to :func:`bastion_register_components`."""

    def __call__(self, kind: str, name: str, factory: Callable[..., Any] | str, *, description: str = "") -> None:
        """Register ``factory`` (a class or callable taking keyword options, or a lazy
        ``"module:attribute"`` string) as component ``name`` of ``kind`` (one of :data:`KINDS`)."""


@hookspec
def bastion_register_components(register: Register) -> None:
    """Register pipeline components.

    Call ``register(kind, name, factory, description=...)`` once per component. ``kind`` is one of
    :data:`KINDS` (``"drafter"``, ``"tree_builder"``, ``"latency_model"``, ``"budget_controller"``,
    ``"verifier"``); ``factory(**options)`` must return an instance of the matching interface in
    :data:`bastion.contract.interfaces.COMPONENT_INTERFACES`.
    Registering a (kind, name) pair that another source already registered is an error naming both.
    """
