"""Helpers for testing bastion components (tiny models, contract kit for plugin authors, sampler
statistics in :mod:`bastion.testing.stats`). The contract kit's names (:mod:`bastion.testing.contract`)
are this package's."""

from bastion.testing import contract
from bastion.testing.contract import *  # noqa: F403 - the names listed in contract.__all__

__all__ = list(contract.__all__)
