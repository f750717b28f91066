"""Registers bastion's built-in tree builders through the public plugin hook."""

from __future__ import annotations

from bastion.contract.hookspecs import Register, hookimpl


@hookimpl
def bastion_register_components(register: Register) -> None:
    register(
        "tree_builder",
        "best-first",
        "bastion.trees.best_first:BestFirstBuilder",
        description="BASTION best-first tree: optimal A_hat at every size (options: max_depth, top_k)",
    )
    register(
        "tree_builder",
        "chain",
        "bastion.trees.chain:ChainBuilder",
        description="top-1 path of the drafter (option: max_depth)",
    )
    register(
        "tree_builder",
        "static",
        "bastion.trees.static:StaticBuilder",
        description="fixed EAGLE/Medusa-style topology (options: choices or branching)",
    )
    register(
        "tree_builder",
        "beam",
        "bastion.trees.beam:BeamBuilder",
        description="EAGLE-2 style beam expansion + rerank (options: top_k, beam_width, max_depth)",
    )
