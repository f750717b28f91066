"""The contract plugins import: core types, trees and candidate trees, the five stage interfaces, the
target interface and the errors. The registry lives in :mod:`bastion.core.registry` (``bastion.registry``
is the process-wide one), the hook specification in :mod:`bastion.core.hookspecs`, the pipeline in
:mod:`bastion.core.pipeline` (``bastion.Pipeline``) and the engine in :mod:`bastion.engine`."""

from bastion.core.candidates import PROPOSAL_KINDS, CandidateTree, proposal_kind
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
from bastion.core.interfaces import BatchStepCosts, BudgetController, BudgetDecision, Drafter, LatencyModel, TreeBuilder, Verifier
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
    "BatchStepCosts",
    "BudgetDecision",
    "CandidateTree",
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
    "PROPOSAL_KINDS",
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
    "proposal_kind",
]
