"""The embedded demo pair: a small Qwen3 target (with its tokenizer) and a DFlash drafter trained for it
with ``bastion train`` (see ``docs/demo-model.md``), plus a small autoregressive drafter for the same
target (``bastion train ar-drafter``) and an EAGLE-3 drafter (``bastion train eagle3``). All ship inside
the package as float16 safetensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from bastion.utils.dtypes import fast_bfloat16
from bastion.contract.errors import InvalidInputError

__all__ = ["DemoPaths", "demo_paths", "demo_drafter", "demo_drafter_options", "ASSETS_DIR", "DEMO_DRAFTERS"]

#: drafter families shipped with the demo target -> their folder under the assets
DEMO_DRAFTERS: dict[str, str] = {"dflash": "drafter", "model": "ar-drafter", "eagle3": "eagle3-drafter"}

ASSETS_DIR = Path(__file__).resolve().parent / "assets"


@attrs.frozen
class DemoPaths:
    """Local directories of the demo target (loads with ``from_pretrained``, tokenizer included) and
    drafter (DFlash checkpoint format)."""

    target: Path
    drafter: Path


def demo_paths(root: Path | None = None) -> DemoPaths:
    """Paths of the shipped demo pair (``root`` overrides the assets folder, e.g. a fresh export)."""
    base = Path(root) if root is not None else ASSETS_DIR
    paths = DemoPaths(target=base / "target", drafter=base / "drafter")
    for name, p in (("target", paths.target), ("drafter", paths.drafter)):
        if not (p / "config.json").is_file():
            raise InvalidInputError(f"demo {name} not found at {p}; reinstall bastion or run `bastion train all`")
    return paths


def demo_drafter(family: str = "dflash", root: Path | None = None) -> Path:
    """The shipped demo drafter of ``family`` (``"dflash"``: the block drafter, ``"model"``: the
    autoregressive one, ``"eagle3"``: the EAGLE-3 one); ``root`` overrides the assets folder."""
    if family not in DEMO_DRAFTERS:
        raise InvalidInputError(f"unknown demo drafter {family!r}; the demo ships {', '.join(DEMO_DRAFTERS)}")
    base = Path(root) if root is not None else ASSETS_DIR
    path = base / DEMO_DRAFTERS[family]
    if not (path / "config.json").is_file():
        hint = {"model": "bastion train ar-drafter", "eagle3": "bastion train eagle3"}.get(family, "bastion train all")
        raise InvalidInputError(f"demo drafter {family!r} not found at {path}; reinstall bastion or run `{hint}`")
    return path


def demo_drafter_options(family: str, device: str | torch.device) -> dict[str, Any]:
    """Default options of the demo drafter ``family`` on ``device``: on a CPU with native bfloat16
    arithmetic the DFlash drafter runs in bfloat16 beside the float32 target (a draft costs about half
    as much, its proposals are the same up to rounding, and the tokens never depend on them: the target
    verifies every one). Anywhere else the drafter keeps the target's dtype."""
    if family == "dflash" and torch.device(device).type == "cpu" and fast_bfloat16("cpu"):
        return {"dtype": torch.bfloat16}
    return {}
