"""Locating DFlash checkpoints (local directory or hub id) and reading their safetensors weights."""

from __future__ import annotations

from pathlib import Path

import torch

from bastion.core.errors import InvalidFileError, InvalidInputError
from bastion.core.files import FLOAT_DTYPES, float_weight_error, read_json_object, read_safetensors_header, safetensors_files

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
    """A local checkpoint directory for ``path``: itself when it exists, else a hub snapshot."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / CONFIG_NAME).is_file():
            raise InvalidInputError(f"{local} is not a DFlash checkpoint: it has no {CONFIG_NAME}")
        return local
    if local.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        raise InvalidInputError(f"DFlash checkpoint {path} is neither a local directory nor a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on huggingface_hub
        raise InvalidInputError(f"loading {path} from the hub needs huggingface_hub") from exc
    patterns = [CONFIG_NAME] if config_only else [CONFIG_NAME, "*.safetensors", WEIGHTS_INDEX_NAME]
    try:
        return Path(snapshot_download(str(path), allow_patterns=patterns))
    except Exception as exc:
        raise InvalidInputError(f"could not fetch DFlash checkpoint {path!r} from the hub: {exc}") from exc


def is_dflash_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` (local directory or hub id) holds a DFlash checkpoint: a ``config.json`` with a
    ``dflash_config`` section and a ``block_size``. Never raises."""
    try:
        data = read_json_object(resolve_checkpoint_dir(path, config_only=True) / CONFIG_NAME)
    except InvalidInputError:
        return False
    return isinstance(data, dict) and isinstance(data.get("dflash_config"), dict) and "block_size" in data


def weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (see :func:`bastion.core.files.safetensors_files`)."""
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
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in weight_files(directory):
        read_safetensors_header(path)  # names the file when it is truncated or garbled
        try:
            state.update(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error types
            raise InvalidFileError(f"{path}: cannot load the weights ({exc})") from exc
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
