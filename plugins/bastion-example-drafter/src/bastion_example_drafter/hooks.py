"""The module the ``bastion`` entry point names: it registers the plugin's components."""

from __future__ import annotations

from bastion.core.hookspecs import Register, hookimpl


@hookimpl
def bastion_register_components(register: Register) -> None:
    register(
        "drafter",
        "example-ngram",
        "bastion_example_drafter.drafter:NGramDrafter",  # lazy: imported on first create()
        description="n-gram / prompt-lookup drafter (example plugin, needs no weights)",
    )
