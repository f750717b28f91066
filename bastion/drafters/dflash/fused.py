"""Linear layers that read the same input, run as one matrix product at inference.

A draft forward of a small drafter is a few dozen small products, and on a CPU each bfloat16 product of
a 16-row block pays a fixed cost of 10-20 us whatever its width: the query, key and value projections
of one layer (and the MLP's gate and up projections) cost about as much apart as their sum would
together. :class:`FusedLinears` keeps the concatenation of their weights and answers all of them with
one product, split back into each layer's output: the same numbers (each output column is the same dot
product), fewer calls.

It is an inference path only: with autograd recording (training) the layers run one by one, so
gradients reach each layer's own parameters, and the concatenation never holds parameters of its own.
The concatenated copy is rebuilt whenever a source weight changes (another device or dtype, new
storage, or an in-place update such as an optimizer step or ``load_state_dict``), and layers whose
concatenated weight would exceed ``max_elements`` run one by one (no extra memory for large drafters,
where a product's fixed cost is a negligible share).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FusedLinears", "tensor_version"]

#: the largest concatenated weight kept (elements): 4M is 8 MB in bfloat16
MAX_FUSED_ELEMENTS = 4 * 1024 * 1024


def tensor_version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter; -1 for an inference tensor, which keeps none (its storage
    identifies it)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _state(t: torch.Tensor | None) -> tuple[object, ...]:
    if t is None:
        return ()
    return (id(t), t.data_ptr(), tensor_version(t), t.dtype, t.device)


class FusedLinears:
    """``linears`` (same input width) answered by one product at inference; see the module doc."""

    def __init__(self, *linears: nn.Linear, max_elements: int = MAX_FUSED_ELEMENTS) -> None:
        if not linears or len({lin.in_features for lin in linears}) != 1:
            raise ValueError("FusedLinears needs linear layers of one input width")
        self.linears = linears
        self._widths = [lin.out_features for lin in linears]
        self._fits = sum(self._widths) * linears[0].in_features <= max_elements
        self._key: tuple[object, ...] | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's output for ``x`` [..., in_features], in the layers' order."""
        if torch.is_grad_enabled() or not self._fits:
            return tuple(lin(x) for lin in self.linears)
        return tuple(self.joint(x).split(self._widths, dim=-1))

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """The layers' outputs for ``x`` side by side, ``[..., sum out]`` (one product where it fits)."""
        packed = None if torch.is_grad_enabled() else self.pack()
        if packed is None:
            return torch.cat([lin(x) for lin in self.linears], dim=-1)
        return F.linear(x, *packed)  # [..., sum out]

    def pack(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The concatenated weight [sum out, in] and bias [sum out] (or None), rebuilt when a source
        changed; None when the concatenation would exceed ``max_elements``."""
        if not self._fits:
            return None
        linears = self.linears
        key = tuple(s for lin in linears for s in (*_state(lin.weight), *_state(lin.bias)))
        if key != self._key:
            with torch.no_grad():
                self._weight = torch.cat([lin.weight for lin in linears])  # [sum out, in]
                biases = [lin.bias for lin in linears]
                self._bias = None
                if any(b is not None for b in biases):
                    self._bias = torch.cat([b if b is not None else lin.weight.new_zeros(lin.out_features) for b, lin in zip(biases, linears)])
            self._key = key
        return self._weight, self._bias
