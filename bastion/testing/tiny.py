"""Tiny random Hugging Face models for tests and examples (no download needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

__all__ = ["tiny_config", "tiny_model", "save_tiny_target"]

Arch = Literal["qwen3", "llama"]


def tiny_config(arch: Arch = "qwen3", **overrides: Any) -> Any:
    """A small config (hidden 64, 2 layers, vocab 256) of the given architecture."""
    from transformers import LlamaConfig, Qwen3Config

    base: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    base.update(overrides)
    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    return cls(**base)


def tiny_model(arch: Arch = "qwen3", seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialised tiny causal LM in fp32, eval mode. Weights are scaled up a little so the
    next-token distributions are peaked enough for speculative decoding to accept tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        head = model.get_output_embeddings()
        if head is not None and not cfg.tie_word_embeddings:
            head.weight.mul_(8.0)
    return model.eval()


def save_tiny_target(path: str | Path, arch: Arch = "qwen3", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random model with ``save_pretrained`` to ``path`` and return the path."""
    path = Path(path)
    tiny_model(arch, seed=seed, **overrides).save_pretrained(path)
    return path
