"""The target's own greedy continuations of training prompts: the drafter's training data.

Speculative decoding accepts a drafted token when it equals what the target itself would emit, so the
drafter learns best from the target's outputs rather than from the corpus text. Prompts come from the training
sources (see :func:`bastion.training.corpus.distill_prompts`) or from the user's own JSONL (see
:mod:`bastion.training.prompts`), already rendered. Generation is Hugging Face's batched, KV-cached
``generate`` (greedy, left padding) on the target's device, saved in chunks so an interrupted run resumes.

Under ``torchrun`` every rank continues its share of the prompts (every ``world``-th one) into its own
part file; rank 0 merges the parts, in prompt order, into ``out_path``, so the result is the same file
for every rank count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import attrs
import torch
from tqdm import tqdm

from bastion.distributed import DistContext, barrier, shard
from bastion.training.loop import load_checkpoint, save_checkpoint

__all__ = ["DistillConfig", "DistillSequence", "generate_continuations", "distill_part", "merge_parts", "load_continuations"]


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
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = [tokenizer.encode(t, add_special_tokens=False)[-cfg.max_prompt_tokens :] for t in texts]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [b, W] left-padded
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    device = model.get_input_embeddings().weight.device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        max_new_tokens=cfg.max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad,
    ).cpu()  # [b, W + new]
    result = []
    for i, p in enumerate(prompts):
        new = out[i, width:].tolist()
        if eos in new:
            new = new[: new.index(eos) + 1]
        result.append((p, new))
    return result


def _part_path(out_path: Path, ctx: DistContext) -> Path:
    if ctx.world_size == 1:
        return out_path
    return out_path.with_name(f"{out_path.stem}.part{ctx.rank}of{ctx.world_size}{out_path.suffix}")


def _continue(model, tokenizer, items: Sequence[tuple[int, str, str]], path: Path, cfg: DistillConfig, show: bool) -> None:
    """Continue ``(index, source, text)`` items into the resumable file at ``path``."""
    state = load_checkpoint(path) or {"done": 0, "rows": []}
    rows: list[dict] = state["rows"]
    bar = tqdm(total=len(items), initial=state["done"], desc="distill", mininterval=10.0, disable=not show)
    for start in range(state["done"], len(items), cfg.batch_size):
        chunk = items[start : start + cfg.batch_size]
        for (index, source, _), (p, new) in zip(chunk, _generate_batch(model, tokenizer, [t for _, _, t in chunk], cfg)):
            if new:
                rows.append({"index": index, "source": source, "ids": p + new, "prompt_len": len(p)})
        save_checkpoint(path, done=start + len(chunk), rows=rows)
        bar.update(len(chunk))
    bar.close()


def distill_part(
    model, tokenizer, prompts: Sequence[tuple[str, str]], out_path: Path, cfg: DistillConfig, ctx: DistContext
) -> None:
    """Continue this rank's share of ``prompts`` into its part file (``out_path`` itself for one rank)."""
    items = shard([(i, src, text) for i, (src, text) in enumerate(prompts)], ctx)
    _continue(model, tokenizer, items, _part_path(Path(out_path), ctx), cfg, ctx.is_main)


def merge_parts(out_path: Path, n_prompts: int, world_size: int) -> None:
    """Merge the part files of ``world_size`` ranks into ``out_path``, in prompt order, and delete them."""
    out_path = Path(out_path)
    parts = [_part_path(out_path, DistContext(rank=r, world_size=world_size)) for r in range(world_size)]
    rows = sorted((row for p in parts for row in (load_checkpoint(p) or {"rows": []})["rows"]), key=lambda r: r["index"])
    save_checkpoint(out_path, done=n_prompts, rows=rows)
    for p in parts:
        p.unlink(missing_ok=True)


def generate_continuations(
    model,
    tokenizer,
    prompts: Sequence[tuple[str, str]],
    out_path: Path,
    cfg: DistillConfig = DistillConfig(),
    ctx: DistContext = DistContext(),
) -> list[DistillSequence]:
    """Greedy continuations of ``(source, rendered prompt text)`` pairs, resumable via ``out_path``."""
    out_path = Path(out_path)
    model.eval()
    done = load_checkpoint(out_path) if ctx.world_size > 1 else None
    if done is None or done.get("done") != len(prompts):
        distill_part(model, tokenizer, prompts, out_path, cfg, ctx)
        barrier(ctx)
        if ctx.world_size > 1 and ctx.is_main:
            merge_parts(out_path, len(prompts), ctx.world_size)
        barrier(ctx)
    return load_continuations(out_path)


def load_continuations(path: Path) -> list[DistillSequence]:
    state = load_checkpoint(Path(path))
    if state is None:
        raise FileNotFoundError(path)
    return [DistillSequence(r["source"], torch.tensor(r["ids"], dtype=torch.long), int(r["prompt_len"])) for r in state["rows"]]
