"""The decoding engine: per-request state, one batch-first step, requests joining and leaving between
steps, and the one set of generation settings every decoding path takes."""

from bastion.engine.engine import Engine
from bastion.engine.params import GenerationConfig, SamplingParams, generation_config
from bastion.engine.request import Request, StepSummary, StepUpdate

__all__ = ["Engine", "GenerationConfig", "Request", "SamplingParams", "StepSummary", "StepUpdate", "generation_config"]
