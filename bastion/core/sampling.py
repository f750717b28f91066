"""The target's next-token rule, shared by the pipeline (first token) and verifiers (every node)."""

from __future__ import annotations

import torch

from bastion.core.types import SamplingConfig

__all__ = ["processed_log_probs", "sample_tokens"]


def processed_log_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probabilities ``[..., V]`` of the target's sampling distribution: temperature, then top-k,
    then top-p (nucleus) filtering, the order Hugging Face ``generate`` applies them.
    Requires ``sampling.temperature > 0``."""
    x = logits.float() / sampling.temperature
    vocab = x.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)  # ascending, like HF TopPLogitsWarper
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - sampling.top_p)
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row of ``logits`` [..., V] -> LongTensor[...]: argmax when greedy, else a draw from
    :func:`processed_log_probs`."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = processed_log_probs(logits, sampling).exp()
    flat = probs.reshape(-1, probs.shape[-1])
    draws = torch.multinomial(flat, 1, generator=generator).squeeze(-1)
    return draws.reshape(probs.shape[:-1])
