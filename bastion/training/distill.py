"""The target's own greedy continuations of training prompts: the drafter's training data.

Speculative decoding accepts a drafted token when it equals what the target itself would emit, so the
drafter learns best from the target's outputs rather than from the corpus text. Prompts come only from
the training sources (see :func:`bastion.training.corpus.distill_prompts`). Generation is batched and
KV-cached (``model.generate``, greedy, left padding) and saved in chunks, so an interrupted run resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import attrs
import torch
from tqdm import tqdm

from bastion.training.loop import load_checkpoint, save_checkpoint

__all__ = ["DistillConfig", "DistillSequence", "generate_continuations", "load_continuations"]


@attrs.frozen
class DistillConfig:
    max_new_tokens: int = attrs.field(default=192, validator=attrs.validators.gt(0))
    max_prompt_tokens: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    batch_size: int = attrs.field(default=32, validator=attrs.validators.gt(0))


@attrs.frozen
class DistillSequence:
    """One training sequence: prompt ids followed by the target's greedy continuation."""

    source: str
    ids: torch.Tensor = attrs.field(eq=False)  # [L] long
    prompt_len: int


@torch.no_grad()
def _generate_batch(model, tokenizer, texts: Sequence[str], cfg: DistillConfig) -> list[tuple[list[int], list[int]]]:
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompts = [tokenizer.encode(t, add_special_tokens=False)[-cfg.max_prompt_tokens :] for t in texts]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [b, W] left-padded
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=cfg.max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad,
    )  # [b, W + new]
    result = []
    for i, p in enumerate(prompts):
        new = out[i, width:].tolist()
        if eos in new:
            new = new[: new.index(eos) + 1]
        result.append((p, new))
    return result


def generate_continuations(model, tokenizer, prompts: Sequence[tuple[str, str]], out_path: Path, cfg: DistillConfig = DistillConfig()) -> list[DistillSequence]:
    """Greedy continuations of ``(source, text)`` pairs (rendered with
    :func:`bastion.training.corpus.render_prompt`), resumable via ``out_path``."""
    from bastion.training.corpus import render_prompt

    out_path = Path(out_path)
    state = load_checkpoint(out_path) or {"done": 0, "rows": []}
    rows: list[dict] = state["rows"]
    model.eval()
    bar = tqdm(total=len(prompts), initial=state["done"], desc="distill", mininterval=10.0)
    for start in range(state["done"], len(prompts), cfg.batch_size):
        chunk = prompts[start : start + cfg.batch_size]
        for (source, _), (p, new) in zip(chunk, _generate_batch(model, tokenizer, [render_prompt(tokenizer, src, t) for src, t in chunk], cfg)):
            if new:
                rows.append({"source": source, "ids": p + new, "prompt_len": len(p)})
        save_checkpoint(out_path, done=start + len(chunk), rows=rows)
        bar.update(len(chunk))
    bar.close()
    return load_continuations(out_path)


def load_continuations(path: Path) -> list[DistillSequence]:
    state = load_checkpoint(Path(path))
    if state is None:
        raise FileNotFoundError(path)
    return [DistillSequence(r["source"], torch.tensor(r["ids"], dtype=torch.long), int(r["prompt_len"])) for r in state["rows"]]
