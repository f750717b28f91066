"""Half-precision copies of a trained target (+ tokenizer) and drafter for shipping in the package.

The exported target loads like any hub model; the drafter keeps the DFlash checkpoint format. Both are
stored as float16 safetensors to keep the package small and load as float32 by default.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

__all__ = ["export_pair", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _export_target(src: Path, dst: Path, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.to(dtype).save_pretrained(dst)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    if (src / "train_summary.json").exists():
        shutil.copy2(src / "train_summary.json", dst / "train_summary.json")


def _export_drafter(src: Path, dst: Path, dtype: torch.dtype) -> None:
    from bastion.drafters.dflash import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(src, dtype=torch.float32)
    model.to(dtype).save_pretrained(dst)
    if (src / "train_summary.json").exists():
        shutil.copy2(src / "train_summary.json", dst / "train_summary.json")


def export_pair(target_dir: Path | None, drafter_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float16) -> Path:
    """Write ``out_dir/target`` (unless ``target_dir`` is None: a drafter for a hub target is shipped
    alone) and ``out_dir/drafter`` (replacing earlier exports) and return ``out_dir``."""
    out_dir = Path(out_dir)
    parts = [("drafter", _export_drafter, Path(drafter_dir))]
    if target_dir is not None:
        parts.insert(0, ("target", _export_target, Path(target_dir)))
    for name, fn, src in parts:
        dst = out_dir / name
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        fn(src, dst, dtype)
    manifest = {"target": "target" if target_dir is not None else None, "drafter": "drafter", "dtype": str(dtype).replace("torch.", "")}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out_dir
