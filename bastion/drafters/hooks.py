"""Registers bastion's built-in drafters through the public plugin hook."""

from __future__ import annotations

from bastion.core.hookspecs import Register, hookimpl


@hookimpl
def bastion_register_components(register: Register) -> None:
    pass
