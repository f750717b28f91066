"""Core types, the five stage interfaces, hooks, registry and the pipeline."""

from bastion.core.errors import (
    BastionError,
    ComponentError,
    DuplicateComponentError,
    IncompatibleComponentsError,
    InvalidFileError,
    InvalidInputError,
    PluginLoadError,
    TreeValidationError,
    UnknownComponentError,
)
from bastion.core.interfaces import BudgetController, BudgetDecision, Drafter, LatencyModel, TreeBuilder, Verifier
from bastion.core.target import Target
from bastion.core.tree import Tree
from bastion.core.types import (
    DraftContext,
    DraftStep,
    GenerationResult,
    Marginals,
    SamplingConfig,
    StageTimings,
    StepFeedback,
    StepOutcome,
    StepRecord,
    TargetOutput,
    Verdict,
)

__all__ = [
    "BastionError",
    "ComponentError",
    "BudgetController",
    "BudgetDecision",
    "DraftContext",
    "DraftStep",
    "Drafter",
    "DuplicateComponentError",
    "GenerationResult",
    "IncompatibleComponentsError",
    "InvalidFileError",
    "InvalidInputError",
    "LatencyModel",
    "Marginals",
    "PluginLoadError",
    "SamplingConfig",
    "StageTimings",
    "StepFeedback",
    "StepOutcome",
    "StepRecord",
    "Target",
    "TargetOutput",
    "Tree",
    "TreeBuilder",
    "TreeValidationError",
    "UnknownComponentError",
    "Verdict",
    "Verifier",
]
