"""Registers bastion's built-in verifiers through the public plugin hook."""

from __future__ import annotations

from bastion.contract.hookspecs import Register, hookimpl


@hookimpl
def bastion_register_components(register: Register) -> None:
    register(
        "verifier",
        "exact",
        "bastion.verifiers.exact:ExactVerifier",
        description="lossless tree verification: greedy match (T = 0) or sample-and-match (T > 0)",
    )
