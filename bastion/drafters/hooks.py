"""Registers bastion's built-in drafters through the public plugin hook."""

from __future__ import annotations

from bastion.contract.hookspecs import Register, hookimpl


@hookimpl
def bastion_register_components(register: Register) -> None:
    register(
        "drafter",
        "dflash",
        "bastion.drafters.dflash:DFlashDrafter",
        description="DFlash block-diffusion drafter (checkpoint=<dir or hub id>, device=, dtype=, block_size=)",
    )
    register(
        "drafter",
        "model",
        "bastion.drafters.model:ModelDrafter",
        description="autoregressive drafter: any causal LM with the target's vocabulary, candidate trees "
        "(checkpoint=<dir, hub id or model>, depth=, width=, top_k=, early_stop=, depth_cost_s=, device=, dtype=)",
    )
    register(
        "drafter",
        "eagle3",
        "bastion.drafters.eagle3:Eagle3Drafter",
        description="EAGLE-3 drafter: SafeAILab / SpecForge / vLLM checkpoints, candidate trees "
        "(checkpoint=<dir or hub id>, total_token=, depth=, top_k=, device=, dtype=)",
    )
