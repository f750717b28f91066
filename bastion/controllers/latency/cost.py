"""FLOPs and bytes moved by one target forward over ``n`` tree tokens after ``c`` committed tokens.

The counts cover dense decoder-only transformers of the Llama / Qwen3 family (grouped-query attention,
gated MLP, untied or tied lm head). Each count is a polynomial in ``n`` and ``m = c + n`` (the keys each
new token attends to)::

    flops(n, c) = f_n * n + f_nm * n * m
    bytes(n, c) = g_0 + g_n * n + g_m * m + g_nm * n * m

so a whole vector of candidate sizes is evaluated with a handful of array operations.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch
from attrs import field, frozen

from bastion.utils.checks import positive_int
from bastion.utils.dtypes import dtype_bytes
from bastion.huggingface.configs import DecoderShape

__all__ = ["ModelCost", "dtype_bytes"]

@frozen
class ModelCost:
    """Shape of a dense decoder-only model and the operation counts derived from it."""

    num_layers: int = field(validator=positive_int)
    hidden_size: int = field(validator=positive_int)
    num_heads: int = field(validator=positive_int)
    num_kv_heads: int = field(validator=positive_int)
    head_dim: int = field(validator=positive_int)
    intermediate_size: int = field(validator=positive_int)
    vocab_size: int = field(validator=positive_int)
    bytes_per_param: int = field(default=2, validator=positive_int)
    model_type: str = "decoder"

    @classmethod
    def from_config(cls, config: Any, dtype: Any = None) -> "ModelCost":
        """Read the shape from a Hugging Face config (object or dict). ``dtype`` overrides the config's
        ``dtype`` / ``torch_dtype``; float32 when neither says."""
        shape = attrs.asdict(DecoderShape.from_config(config, purpose="the roofline cost model"))
        config_dtype = shape.pop("dtype")  # the shape's fields are ModelCost's, bar the dtype
        return cls(**shape, bytes_per_param=dtype_bytes(dtype if dtype is not None else config_dtype or torch.float32))

    # ------------------------------------------------------------------ parameter counts
    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer: q, k, v, o projections and the gated MLP."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def matmul_params(self) -> int:
        """Weights every new token multiplies through: all layers plus the lm head."""
        return self.num_layers * self.layer_params + self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one forward streams from memory (norms included, embedding rows ignored)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return (self.matmul_params + norms) * self.bytes_per_param

    @property
    def signature(self) -> str:
        """A short key naming the model shape and dtype (used to key saved latency profiles)."""
        return (
            f"{self.model_type}-L{self.num_layers}-h{self.hidden_size}-H{self.num_heads}-kv{self.num_kv_heads}"
            f"-d{self.head_dim}-I{self.intermediate_size}-V{self.vocab_size}-b{self.bytes_per_param}"
        )

    # ------------------------------------------------------------------ polynomial coefficients
    @property
    def flops_coeffs(self) -> tuple[float, float]:
        """(f_n, f_nm): 2 FLOPs per weight per token; QK^T and PV cost 4 * heads * head_dim per key."""
        return (2.0 * self.matmul_params, 4.0 * self.num_layers * self.num_heads * self.head_dim)

    @property
    def bytes_coeffs(self) -> tuple[float, float, float, float]:
        """(g_0, g_n, g_m, g_nm): weights; per-token KV writes, activations and fp32 logits; per-key KV
        reads; the n x m attention mask every layer reads."""
        b, L = self.bytes_per_param, self.num_layers
        kv_row = 2 * self.num_kv_heads * self.head_dim * b  # K and V of one token in one layer
        act = (4 * self.hidden_size + 3 * self.intermediate_size) * b  # per token per layer
        g_n = L * (kv_row + act) + 4 * self.vocab_size
        g_m = L * kv_row
        g_nm = L * b
        return (float(self.weight_bytes), float(g_n), float(g_m), float(g_nm))

    # ------------------------------------------------------------------ evaluation
    def flops(self, n_tokens: np.ndarray | int, context_len: int) -> np.ndarray:
        """FLOPs of one forward over ``n_tokens`` (array [N] or int) new tokens after ``context_len``."""
        n = np.asarray(n_tokens, dtype=np.float64)
        f_n, f_nm = self.flops_coeffs
        return n * (f_n + f_nm * (context_len + n))

    def bytes(self, n_tokens: np.ndarray | int, context_len: int) -> np.ndarray:
        """Bytes moved by one forward over ``n_tokens`` (array [N] or int) after ``context_len``."""
        n = np.asarray(n_tokens, dtype=np.float64)
        g0, g_n, g_m, g_nm = self.bytes_coeffs
        m = context_len + n
        return g0 + g_n * n + m * (g_m + g_nm * n)
