"""Example bastion plugin: an n-gram (prompt-lookup) drafter."""

from bastion_example_drafter.drafter import NGramDrafter

__all__ = ["NGramDrafter"]
__version__ = "0.1.0"
