"""The contract plugins import: core types, trees and candidate trees, the five stage interfaces, the
target and batch-state interfaces, the errors, the hook specification (:mod:`bastion.contract.hookspecs`)
and the registry (:mod:`bastion.contract.registry`; ``bastion.registry`` is the process-wide one).

The package's rooms: this contract; the engine (:mod:`bastion.engine`: the ``Pipeline`` facade, the
step, request state, costs); the Hugging Face adapter (:mod:`bastion.huggingface`: the causal-LM
target, its batched forward, the KV slab, compiled verify); utilities (:mod:`bastion.utils`: files,
folders, the dtype parser, checks, logs, syncs). ``bastion.core`` is the contract's older name and
keeps working (``from bastion.core import Tree``; ``bastion.core.hf_target`` and the other moved
modules resolve to their new homes)."""

from bastion.contract.batch_state import DraftBatch
from bastion.contract.candidates import PROPOSAL_KINDS, CandidateTree, proposal_kind
from bastion.contract.errors import (
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
from bastion.contract.interfaces import BatchStepCosts, BudgetController, BudgetDecision, Drafter, LatencyModel, TreeBuilder, Verifier
from bastion.contract.target import Target
from bastion.contract.tree import Tree
from bastion.contract.types import (
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
    "DraftBatch",
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
