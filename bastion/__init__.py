"""bastion: lossless, budget-aware tree speculative decoding for Hugging Face causal LMs."""

from bastion import contract, core, hf  # noqa: F401 - bastion.core (the contract's older name) and bastion.contract as attributes
from bastion.engine.pipeline import Pipeline
from bastion.contract.registry import registry
from bastion.engine import Engine, GenerationConfig, SamplingParams

__version__ = "0.1.0"

__all__ = ["Engine", "GenerationConfig", "Pipeline", "SamplingParams", "hf", "registry", "__version__"]
