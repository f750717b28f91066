"""Shared training-loop pieces: seeding, learning-rate schedule, resumable checkpoints, progress."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import torch

from bastion.contract.errors import InvalidFileError
from bastion.utils.files import atomic_path

__all__ = ["seed_everything", "lr_at", "save_checkpoint", "load_checkpoint", "resume", "set_threads"]


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators; ``seed`` follows the rule of every seed (an int in
    [0, 2**64), :func:`bastion.utils.checks.check_seed`)."""
    from bastion.utils.checks import check_seed

    seed = check_seed(seed, name="--seed")
    random.seed(seed)
    torch.manual_seed(seed)


def set_threads(threads: int | None) -> None:
    """torch's CPU threads (``--threads``); None leaves torch's choice. Not an int >= 1 raises
    :class:`~bastion.contract.errors.InvalidInputError` naming ``--threads``."""
    from bastion.utils.checks import check_int

    if threads is not None:
        torch.set_num_threads(check_int("--threads", threads))


def lr_at(step: int, *, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``floor * peak`` at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (the schedule's value for this step)."""
    for group in opt.param_groups:
        group["lr"] = lr


def clipped_step(opt: torch.optim.Optimizer, params: Any, max_norm: float = 1.0) -> None:
    """Clip the gradients of ``params`` to ``max_norm`` (global L2 norm), then take the optimizer step."""
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()


def save_checkpoint(path: Path, **state: Any) -> None:
    """Atomically write a training checkpoint (``torch.save`` of ``state``)."""
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The state saved by :func:`save_checkpoint` at ``path``, or None when there is none.

    Loading is ``weights_only``: tensors, numbers, strings and containers only, so a crafted file cannot
    run code; anything else (or a truncated file) raises :class:`InvalidFileError` naming the file."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError, EOFError, RuntimeError from a torn zip...
        raise InvalidFileError(f"{path}: not a bastion training checkpoint (or unsafe to load): {exc}") from exc
    if not isinstance(state, dict):
        raise InvalidFileError(f"{path}: a training checkpoint holds a dict, found {type(state).__name__}")
    return state


def resume(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, *, log: Any = print) -> tuple[int, float]:
    """Restore ``model`` and ``opt`` from the checkpoint at ``path`` if there is one.
    Returns (step, elapsed seconds) to continue from; (0, 0.0) for a fresh run."""
    state = load_checkpoint(path)
    if state is None:
        return 0, 0.0
    missing = [k for k in ("model", "optimizer", "step", "elapsed") if k not in state]
    if missing:
        raise InvalidFileError(f"{path}: a training checkpoint holds model, optimizer, step and elapsed; it lacks {', '.join(missing)}")
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed = int(state["step"]), float(state["elapsed"])
    except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as exc:  # shapes, names, types of another model
        first = str(exc).strip().splitlines()
        raise InvalidFileError(
            f"{path}: does not fit this run's model (another architecture or size?): {' '.join(l.strip() for l in first)[:400]}"
        ) from exc
    log(f"resumed from step {step}")
    return step, elapsed
