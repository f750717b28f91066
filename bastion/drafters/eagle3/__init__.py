"""The ``eagle3`` drafter: EAGLE-3 checkpoints (SafeAILab / SpecForge and vLLM layouts) drafting candidate trees."""

from bastion.drafters.eagle3.checkpoint import Eagle3Checkpoint, is_eagle3_checkpoint, load_eagle3_checkpoint
from bastion.drafters.eagle3.config import Eagle3Config, default_feature_layers
from bastion.drafters.eagle3.drafter import Eagle3Drafter
from bastion.drafters.eagle3.model import Eagle3DraftModel, Eagle3KV

__all__ = [
    "Eagle3Checkpoint",
    "Eagle3Config",
    "Eagle3DraftModel",
    "Eagle3Drafter",
    "Eagle3KV",
    "default_feature_layers",
    "is_eagle3_checkpoint",
    "load_eagle3_checkpoint",
]
