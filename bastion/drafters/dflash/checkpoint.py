"""Locating DFlash checkpoints (local directory or hub id) and reading their safetensors weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bastion.core.errors import InvalidInputError
from bastion.drafters.dflash.config import CONFIG_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

__all__ = ["is_dflash_checkpoint", "resolve_checkpoint_dir", "load_dflash_state_dict"]


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
        data = json.loads((resolve_checkpoint_dir(path, config_only=True) / CONFIG_NAME).read_text())
    except (InvalidInputError, OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("dflash_config"), dict) and "block_size" in data


def load_dflash_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or shards), rotary buffers left out."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / WEIGHTS_INDEX_NAME
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / WEIGHTS_NAME).is_file():
        files = [WEIGHTS_NAME]
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise InvalidInputError(f"DFlash checkpoint {directory} has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    return {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
