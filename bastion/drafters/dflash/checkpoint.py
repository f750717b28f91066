"""Locating DFlash checkpoints (local directory or hub id) and reading their safetensors weights."""

from __future__ import annotations

from pathlib import Path

import torch

from bastion.contract.errors import InvalidInputError
from bastion.utils.files import FLOAT_DTYPES, float_weight_error, read_json_object, read_safetensors_header, safetensors_files
from bastion.drafters.checkpoints import load_safetensors_file, resolve_checkpoint_folder

#: the file names of a DFlash checkpoint folder
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

__all__ = [
    "is_dflash_checkpoint",
    "resolve_checkpoint_dir",
    "weight_files",
    "read_weight_shapes",
    "load_dflash_state_dict",
]


def resolve_checkpoint_dir(path: str | Path, *, config_only: bool = False) -> Path:
    """A local checkpoint directory for ``path``: itself when it exists, else a hub snapshot (see
    :func:`bastion.drafters.checkpoints.resolve_checkpoint_folder`)."""
    return resolve_checkpoint_folder(
        path, "DFlash", config_name=CONFIG_NAME, index_name=WEIGHTS_INDEX_NAME, config_only=config_only
    )


def is_dflash_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` (local directory or hub id) holds a DFlash checkpoint: a ``config.json`` with a
    ``dflash_config`` section and a ``block_size``. Never raises."""
    try:
        data = read_json_object(resolve_checkpoint_dir(path, config_only=True) / CONFIG_NAME)
    except InvalidInputError:
        return False
    return isinstance(data, dict) and isinstance(data.get("dflash_config"), dict) and "block_size" in data


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (see :func:`bastion.utils.files.safetensors_files`)."""
    files = safetensors_files(directory)
    if not files:
        raise InvalidInputError(f"DFlash checkpoint {directory} has no .safetensors weights")
    return files


def read_weight_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names -> shapes of a checkpoint's weights, read from the safetensors headers only (no
    tensor data is loaded); rotary buffers left out. Broken files, and weights stored in a dtype that is
    not floating point (integers, bools), raise :class:`InvalidFileError` naming the file and tensor."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(directory):
        for name, info in read_safetensors_header(path).items():
            if info.dtype not in FLOAT_DTYPES and not name.endswith("rotary_emb.inv_freq"):
                raise float_weight_error(path, name, info)  # would be cast silently into nonsense
            shapes[name] = info.shape
    return {k: v for k, v in shapes.items() if not k.endswith("rotary_emb.inv_freq")}


def load_dflash_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or shards), rotary buffers left out."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        state.update(load_safetensors_file(path))
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
