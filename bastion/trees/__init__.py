"""Built-in tree builders: best-first (BASTION), chain, static topologies and an EAGLE-2 style beam."""

from bastion.trees.beam import BeamBuilder
from bastion.trees.best_first import BestFirstBuilder, expand_best_first
from bastion.trees.chain import ChainBuilder
from bastion.trees.static import DEFAULT_CHOICES, StaticBuilder, choices_from_branching

__all__ = [
    "BeamBuilder",
    "BestFirstBuilder",
    "ChainBuilder",
    "DEFAULT_CHOICES",
    "StaticBuilder",
    "choices_from_branching",
    "expand_best_first",
]
