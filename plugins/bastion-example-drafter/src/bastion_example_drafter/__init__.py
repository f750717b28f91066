"""Example bastion plugin: an n-gram (prompt-lookup) drafter, a fan tree builder and a threshold
budget controller."""

from bastion_example_drafter.controllers import ThresholdController
from bastion_example_drafter.drafter import NGramDrafter
from bastion_example_drafter.trees import FanBuilder

__all__ = ["FanBuilder", "NGramDrafter", "ThresholdController"]
__version__ = "0.1.0"
