"""What the built-in draft networks (DFlash, EAGLE-3) share: the RMS norm, the rotary frequencies of a
config's rope settings, where a network lives (its ``fc`` projection of the target features), and
loading one from a checkpoint or an instance in the dtype a drafter asks for, and binding it to a target.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from bastion.utils.checks import check_device
from bastion.utils.dtypes import auto_dtype, parse_dtype
from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError

if TYPE_CHECKING:
    from bastion.contract.target import Target

__all__ = ["rms_norm", "RMSNorm", "RopeShape", "rope_inv_freq", "DraftNetwork", "load_draft_network", "bind_network"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm of ``x`` [..., D] over its last axis, computed in float32 and scaled by
    ``weight`` (broadcast against [..., D]) in ``x``'s dtype (the Qwen3 / Llama convention)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight in the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RopeShape(Protocol):
    """The config fields the rotary frequencies depend on (both draft configs have them)."""

    @property
    def rope_parameters(self) -> Mapping[str, Any]: ...  # {"rope_type": ..., "rope_theta": ..., ...}
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...


def rope_inv_freq(config: RopeShape, drafter: str) -> tuple[torch.Tensor, float]:
    """Inverse rotary frequencies [D / 2] (float32, on the CPU whatever the default device) and the
    attention scaling of ``config``'s rope settings: the plain ``rope_theta`` law, or any other
    ``rope_type`` through transformers' own initialisation. Dynamic scaling (which changes with the
    sequence length) and unknown types raise :class:`InvalidInputError` naming the ``drafter``."""
    rope = dict(config.rope_parameters)
    kind = rope.get("rope_type", "default")
    dim = config.head_dim
    with torch.device("cpu"):  # a network built on the meta device still needs real frequencies
        if kind == "default":
            return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
        if kind == "dynamic":
            raise InvalidInputError(f"dynamic rope scaling is not supported by the {drafter} drafter")
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if kind not in ROPE_INIT_FUNCTIONS:
            raise InvalidInputError(f"unknown rope_type {kind!r} in the {drafter} config")
        hf: Any = LlamaConfig(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=rope,
        )
        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](hf, None)
    return inv_freq.float(), float(scale)


N = TypeVar("N", bound="DraftNetwork")


class DraftNetwork(nn.Module):
    """A draft network that projects target features with ``fc``: it lives on ``fc``'s device and
    computes in ``fc``'s dtype."""

    fc: nn.Linear

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @classmethod
    def from_pretrained(cls: type[N], path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype | None = None) -> N:
        """The network of the checkpoint at ``path`` (local folder or hub id) on ``device``, in ``dtype``
        (None: the stored one)."""
        raise NotImplementedError


def load_draft_network(
    checkpoint: str | Path | N,
    network: type[N],
    *,
    device: str | torch.device,
    dtype: torch.dtype | str | None,
    drafter: str,
) -> N:
    """The ``network`` a drafter runs: ``checkpoint`` itself (an instance) moved to ``device`` and
    ``dtype`` (None or ``"auto"``: its own), or the checkpoint at a path or hub id loaded there. A loaded
    checkpoint in the auto dtype keeps its stored dtype, except float16 on a CPU, which computes in
    float32 (:func:`bastion.utils.dtypes.auto_dtype`; the choice is logged under ``drafter``). A device
    this process cannot use, an unknown dtype or any other ``checkpoint`` raise :class:`InvalidInputError`."""
    device = check_device(device)  # a CUDA device on a build without one: bastion's error, not torch's
    named = parse_dtype(dtype, allow_auto=True)
    if isinstance(checkpoint, network):
        return checkpoint.to(device=device, dtype=named or checkpoint.dtype)
    if not isinstance(checkpoint, (str, Path)):
        article = "an" if network.__name__[:1] in "AEIOU" else "a"
        raise InvalidInputError(
            f"checkpoint must be a directory, a hub id or {article} {network.__name__}, got {type(checkpoint).__name__}"
        )
    model = network.from_pretrained(checkpoint, device=device, dtype=named)
    if named is None:  # auto: the stored dtype, but float32 for a float16 checkpoint on a CPU
        choice = auto_dtype(model.dtype, device)
        if choice.dtype is not None:
            model = model.to(dtype=choice.dtype)
            choice.log(f"{drafter} drafter {str(checkpoint)!r}")
    return model


def bind_network(network: N, target: "Target", layers: Sequence[int], problems: Sequence[str], drafter: str) -> N:
    """``network`` placed where ``target`` puts the features of ``layers`` (it runs where they end up),
    once the drafter's checks against the target found nothing: ``problems`` (one sentence each) raise
    :class:`IncompatibleComponentsError` naming the ``drafter`` and listing them all."""
    if problems:
        raise IncompatibleComponentsError(f"{drafter} drafter and target are incompatible: " + "; ".join(problems))
    home = target.feature_device(tuple(layers))
    return network if network.device == home else network.to(home)
