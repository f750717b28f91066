"""The DFlash block-diffusion drafter: config, network, checkpoint I/O and the :class:`Drafter`."""

from bastion.drafters.dflash.checkpoint import load_dflash_state_dict, resolve_checkpoint_dir
from bastion.drafters.dflash.config import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DFlashConfig,
    default_target_layer_ids,
)
from bastion.drafters.dflash.drafter import DFlashDrafter
from bastion.drafters.dflash.model import ContextKV, DFlashDraftModel

__all__ = [
    "DFlashDrafter",
    "DFlashConfig",
    "DFlashDraftModel",
    "ContextKV",
    "default_target_layer_ids",
    "load_dflash_state_dict",
    "resolve_checkpoint_dir",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
]
