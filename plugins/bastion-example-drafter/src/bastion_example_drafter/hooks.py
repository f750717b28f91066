"""The module the ``bastion`` entry point names: it registers the plugin's components."""

from __future__ import annotations

from bastion.contract.hookspecs import Register, hookimpl


@hookimpl
def bastion_register_components(register: Register) -> None:
    register(
        "drafter",
        "example-ngram",
        "bastion_example_drafter.drafter:NGramDrafter",  # lazy: imported on first create()
        description="n-gram / prompt-lookup drafter (example plugin, needs no weights)",
    )
    register(
        "tree_builder",
        "example-fan",
        "bastion_example_drafter.trees:FanBuilder",
        description="the top-`width` first tokens, each followed by its greedy chain (example plugin)",
    )
    register(
        "budget_controller",
        "example-threshold",
        "bastion_example_drafter.controllers:ThresholdController",
        description="verify the nodes whose path probability is at least `threshold` (example plugin)",
    )
