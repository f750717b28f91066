"""Registers bastion's built-in latency model and budget controllers through the public plugin hook."""

from __future__ import annotations

from bastion.contract.hookspecs import Register, hookimpl


@hookimpl
def bastion_register_components(register: Register) -> None:
    register(
        "latency_model",
        "roofline",
        "bastion.controllers.latency.roofline:RooflineLatency",
        description="roofline verify time from the target config and device peaks, calibrated online",
    )
    register(
        "budget_controller",
        "bastion",
        "bastion.controllers.budget:BastionController",
        description="tree size maximizing predicted speedup A_hat(T_n) * L_AR / C(n)",
    )
    register(
        "budget_controller",
        "full",
        "bastion.controllers.full:FullTreeController",
        description="verify every node the tree builder produced (chain / static baselines)",
    )
    register(
        "budget_controller",
        "fixed",
        "bastion.controllers.budget:FixedController",
        description="always verify `budget` nodes",
    )
    register(
        "budget_controller",
        "plain",
        "bastion.controllers.plain:PlainController",
        description="never draft: plain decoding by the target alone (speculation off, same engine)",
    )
