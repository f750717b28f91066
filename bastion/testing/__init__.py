"""Helpers for testing bastion components (tiny models, contract kit for plugin authors, sampler
statistics in :mod:`bastion.testing.stats`)."""

from bastion.testing.contract import (
    FixedLatencyModel,
    check_budget_controller,
    check_component,
    check_drafter,
    check_latency_model,
    check_tree_builder,
    check_verifier,
    random_candidate_tree,
)

__all__ = [
    "FixedLatencyModel",
    "check_budget_controller",
    "check_component",
    "check_drafter",
    "check_latency_model",
    "check_tree_builder",
    "check_verifier",
    "random_candidate_tree",
]
