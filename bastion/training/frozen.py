"""The frozen target a drafter is trained for: any Hugging Face causal LM, loaded in its own dtype.

``load_frozen_target`` takes a local directory or a hub id (no remote code), keeps the checkpoint's own
dtype unless told otherwise (a float16 checkpoint trained on a CPU computes in float32, see
:func:`bastion.utils.dtypes.auto_dtype`), moves it to the training device and freezes it. ``resolve_mask_token``
picks the drafter's mask token: an explicit id, else the tokenizer's mask token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bastion.utils.dtypes import CLI_DTYPES
from bastion.utils.dtypes import parse_dtype as parse_core_dtype
from bastion.contract.errors import InvalidInputError

__all__ = ["DTYPES", "parse_dtype", "load_frozen_target", "load_target_tokenizer", "resolve_mask_token", "freeze"]

#: dtype names accepted on the command line ("auto": the checkpoint's own dtype)
DTYPES: tuple[str, ...] = ("auto", *CLI_DTYPES)


def parse_dtype(name: str) -> torch.dtype | str:
    """``"auto"`` stays a string (Hugging Face reads the checkpoint's dtype); other names become dtypes."""
    if name not in DTYPES:
        raise InvalidInputError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return "auto" if name == "auto" else parse_core_dtype(name)


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Eval mode, no gradients: the target only provides features, embeddings and the lm head."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_frozen_target(name: str | Path, device: torch.device | str = "cpu", dtype: str = "auto") -> Any:
    """The target model (local directory or hub id) in ``dtype`` (default ``auto``: its own, but float32
    for a float16 checkpoint on a CPU, logged on ``bastion.dtype``), on ``device``, frozen."""
    from transformers import AutoModelForCausalLM

    from bastion.huggingface.causal_lm import compute_in_auto_dtype

    load_dtype = parse_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(name), dtype=load_dtype)
    except OSError as exc:
        raise InvalidInputError(f"could not load the target {name!r}: {exc}") from exc
    model = model.to(device)
    if load_dtype == "auto":
        model = compute_in_auto_dtype(model, device, f"frozen target {str(name)!r}")
    return freeze(model)


def load_target_tokenizer(name: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name))
    except OSError as exc:
        raise InvalidInputError(f"could not load the tokenizer of {name!r}: {exc}") from exc


def resolve_mask_token(tokenizer: Any, explicit: int | None, vocab_size: int) -> int:
    """The drafter's mask token id: ``explicit`` if given, else the tokenizer's mask token."""
    mask = explicit if explicit is not None else getattr(tokenizer, "mask_token_id", None)
    if mask is None:
        raise InvalidInputError(
            "the tokenizer has no mask token; pass --mask-token-id (any id of the target's vocabulary the "
            "prompts do not use, e.g. a reserved special token)"
        )
    if not 0 <= int(mask) < vocab_size:
        raise InvalidInputError(f"mask token id {mask} lies outside the target vocabulary [0, {vocab_size})")
    return int(mask)
