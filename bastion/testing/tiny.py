"""Tiny random Hugging Face models for tests and examples (no download needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Literal

import attrs
import torch

__all__ = ["tiny_config", "tiny_model", "save_tiny_target", "TinyPair", "save_tiny_pair", "mutated_copy"]

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


@attrs.frozen
class TinyPair:
    """Directories of a tiny target (with the demo pair's tokenizer) and a random DFlash drafter for it."""

    target: Path
    drafter: Path


def save_tiny_pair(path: str | Path, *, seed: int = 0, block_size: int = 4, max_positions: int = 256) -> TinyPair:
    """Write a tiny random Qwen3 target that loads with its tokenizer (the demo pair's: chat template,
    ``<|endoftext|>`` as EOS) and a random 1-layer DFlash drafter for it; command-line runs take them as
    ``--target`` / ``--drafter``."""
    import shutil

    from bastion.demo import demo_paths
    from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel

    root = Path(path)
    demo = demo_paths().target
    vocab = int(json.loads((demo / "config.json").read_text())["vocab_size"])
    target_dir = save_tiny_target(
        root / "target", "qwen3", seed=seed, vocab_size=vocab, eos_token_id=1, bos_token_id=1, max_position_embeddings=max_positions
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo / name).is_file():
            shutil.copy(demo / name, target_dir / name)
    from transformers import AutoConfig

    torch.manual_seed(seed + 1)
    cfg = DFlashConfig.for_target(AutoConfig.from_pretrained(str(target_dir)), num_layers=1, block_size=block_size, mask_token_id=4)
    drafter_dir = DFlashDraftModel(cfg).save_pretrained(root / "drafter")
    return TinyPair(target=target_dir, drafter=Path(drafter_dir))



def mutated_copy(
    src: str | Path,
    dst: str | Path,
    *,
    weights: Callable[[dict], dict] | None = None,
    config: Callable[[dict], Any] | None = None,
) -> Path:
    """A copy of the checkpoint folder ``src`` at ``dst`` with its ``model.safetensors`` passed through
    ``weights`` (tensor dict in, tensor dict out) and its ``config.json`` edited in place by ``config``:
    the broken checkpoints reliability tests load."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    shutil.copytree(src, dst)
    if weights is not None:
        state = load_file(str(dst / "model.safetensors"))
        save_file(weights(state), str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data))
    return dst
