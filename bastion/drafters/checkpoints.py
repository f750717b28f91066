"""Locating a drafter checkpoint (a local folder or a hub id) and loading one of its safetensors files.

The built-in drafters (DFlash, EAGLE-3) keep their checkpoints in the same shape: a folder with a
``config.json`` and safetensors weights (one file, or shards named by an index). The checks that are
particular to a format stay with it; these are the steps they share.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bastion.contract.errors import InvalidFileError, InvalidInputError
from bastion.utils.files import read_safetensors_header

__all__ = ["resolve_checkpoint_folder", "load_safetensors_file"]


def resolve_checkpoint_folder(
    path: str | Path,
    kind: str,
    *,
    config_name: str = "config.json",
    index_name: str = "model.safetensors.index.json",
    config_only: bool = False,
) -> Path:
    """A local checkpoint folder for ``path``: itself when it is a directory holding ``config_name``,
    else a hub snapshot of the id ``owner/name`` (its config alone with ``config_only``, else the config,
    the safetensors files and the index). ``kind`` names the format in the errors (``"DFlash"``); a
    folder without the config, a path that is neither a folder nor a hub id, or a failed download raise
    :class:`InvalidInputError`."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / config_name).is_file():
            article = "an" if kind[:1] in "AEIOU" else "a"
            raise InvalidInputError(f"{local} is not {article} {kind} checkpoint: it has no {config_name}")
        return local
    if local.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        raise InvalidInputError(f"{kind} checkpoint {path} is neither a local directory nor a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:  # pragma: no cover - transformers depends on huggingface_hub
        raise InvalidInputError(f"loading {path} from the hub needs huggingface_hub") from exc
    patterns = [config_name] if config_only else [config_name, "*.safetensors", index_name]
    try:
        return Path(snapshot_download(str(path), allow_patterns=patterns))
    except Exception as exc:
        raise InvalidInputError(f"could not fetch {kind} checkpoint {path!r} from the hub: {exc}") from exc


def load_safetensors_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file. Its header is read first, so a truncated or garbled file
    raises :class:`InvalidFileError` naming it; so does any error of the loader itself."""
    from safetensors.torch import load_file

    read_safetensors_header(path)  # names the file when it is truncated or garbled
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types
        raise InvalidFileError(f"{path}: cannot load the weights ({exc})") from exc
