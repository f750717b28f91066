"""Train a DFlash-format block-diffusion drafter for a frozen target.

Each training sequence is a prompt followed by the target's greedy continuation. Per sequence, one frozen
target forward gives the features (concatenated outputs of ``target_layer_ids``) of every position; random
anchors ``a`` inside the continuation give blocks ``[token a, MASK x (B - 1)]`` that see the features of
positions ``< a`` only, exactly as at inference where the anchor is the not-yet-verified root. Mask slot
``k`` is trained with cross-entropy on the token at ``a + k``, weighted by ``exp(-(k - 1) / gamma)``: early
slots matter more because a later slot only counts when every earlier one was accepted.

The drafter borrows the target's embedding and lm head (frozen); only the draft layers, ``fc`` and the
norms learn. Checkpoints are resumable; the final drafter is written with ``save_pretrained`` in the
DFlash checkpoint format.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Sequence

import attrs
import torch
import torch.nn.functional as F
from tqdm import tqdm

from bastion.training.distill import DistillSequence
from bastion.training.loop import lr_at, resume, save_checkpoint, seed_everything

__all__ = ["DrafterTrainConfig", "build_drafter", "train_drafter", "evaluate_drafter", "target_features"]

_pos = attrs.validators.gt(0)


@attrs.frozen
class DrafterTrainConfig:
    num_layers: int = attrs.field(default=2, validator=_pos)
    block_size: int = attrs.field(default=16, validator=attrs.validators.ge(2))
    target_layer_ids: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    intermediate_size: int | None = None
    anchors_per_seq: int = attrs.field(default=32, validator=_pos)
    seqs_per_step: int = attrs.field(default=4, validator=_pos)
    steps: int = attrs.field(default=2400, validator=_pos)
    lr: float = attrs.field(default=1e-3, validator=_pos)
    warmup: int = attrs.field(default=50, validator=attrs.validators.ge(1))
    weight_decay: float = attrs.field(default=0.01, validator=attrs.validators.ge(0))
    gamma: float = attrs.field(default=7.0, validator=_pos)
    save_every: int = attrs.field(default=50, validator=_pos)
    seed: int = 0


def build_drafter(target, cfg: DrafterTrainConfig, mask_token_id: int):
    """A fresh :class:`DFlashDraftModel` sized for ``target`` (an HF causal LM)."""
    from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel

    n_layers = target.config.num_hidden_layers
    layer_ids = cfg.target_layer_ids if cfg.target_layer_ids is not None else tuple(range(n_layers))
    dcfg = DFlashConfig.for_target(
        target.config,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        target_layer_ids=layer_ids,
        mask_token_id=mask_token_id,
        intermediate_size=cfg.intermediate_size,
    )
    return DFlashDraftModel(dcfg)


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Features of every position of ``ids`` [L]: concatenated decoder-layer outputs -> [1, L, F]."""
    out = target(input_ids=ids[None], output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def _anchors(seq: DistillSequence, n: int, rng: random.Random) -> torch.Tensor:
    lo, hi = seq.prompt_len, len(seq.ids) - 2  # the anchor is a generated token with at least one label
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    pool = range(lo, hi + 1)
    picks = rng.sample(pool, n) if len(pool) > n else list(pool)
    return torch.tensor(sorted(picks), dtype=torch.long)


def _slot_weights(k: int, gamma: float) -> torch.Tensor:
    return torch.exp(-torch.arange(k, dtype=torch.float32) / gamma)  # [K]


def _block_loss(model, target, seq: DistillSequence, anchors: torch.Tensor, gamma: float):
    """(weighted loss, logits [N, K, V], labels [N, K]) for one sequence's anchors."""
    from bastion.training.blocks import make_training_blocks

    cfg = model.config
    feats = target_features(target, seq.ids, cfg.target_layer_ids)  # [1, L, F]
    blocks = make_training_blocks(seq.ids, anchors, cfg.block_size, cfg.mask_token_id)
    logits = model.block_logits(
        feats,
        blocks.block_ids,
        embed=target.get_input_embeddings(),
        head=target.get_output_embeddings(),
        block_positions=blocks.block_positions,
        context_mask=blocks.context_mask,
    )  # [N, K, V]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), blocks.labels.flatten(), ignore_index=-100, reduction="none")
    ce = ce.view_as(blocks.labels)  # [N, K]
    w = _slot_weights(ce.shape[1], gamma)[None, :] * (blocks.labels != -100)  # [N, K]
    return (ce * w).sum() / w.sum().clamp_min(1e-6), logits, blocks.labels


@torch.no_grad()
def evaluate_drafter(model, target, seqs: Sequence[DistillSequence], *, anchors_per_seq: int = 32, seed: int = 1234) -> dict:
    """Held-out teacher-forced figures: loss per slot and the chain acceptance length (1 + number of
    leading slots whose argmax equals the target's greedy token), averaged over anchors."""
    model.eval()
    rng = random.Random(seed)
    k = model.config.block_size - 1
    correct = torch.zeros(k)
    counted = torch.zeros(k)
    accept = []
    for seq in seqs:
        anchors = _anchors(seq, anchors_per_seq, rng)
        if not len(anchors):
            continue
        _, logits, labels = _block_loss(model, target, seq, anchors, 1.0)
        hit = (logits.argmax(-1) == labels) & (labels != -100)  # [N, K]
        correct += hit.float().sum(0)
        counted += (labels != -100).float().sum(0)
        accept.append(1.0 + hit.long().cumprod(dim=1).sum(1).float())  # [N]
    model.train()
    acc = torch.cat(accept) if accept else torch.zeros(1)
    return {
        "chain_acceptance": round(float(acc.mean()), 4),
        "slot_accuracy": [round(float(c / max(n, 1)), 4) for c, n in zip(correct, counted)],
    }


def train_drafter(
    target,
    seqs: Sequence[DistillSequence],
    heldout: Sequence[DistillSequence],
    cfg: DrafterTrainConfig,
    mask_token_id: int,
    out_dir: Path,
    *,
    log=print,
) -> dict:
    """Train (or resume) a drafter for the frozen ``target``; writes the DFlash checkpoint and a
    ``train_summary.json`` to ``out_dir``."""
    out_dir = Path(out_dir)
    ckpt_path = out_dir / "checkpoint.pt"
    seed_everything(cfg.seed)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    model = build_drafter(target, cfg, mask_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, elapsed = resume(ckpt_path, model, opt, log=log)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"drafter: {n_params / 1e6:.2f}M parameters, {len(seqs)} training sequences")
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="drafter", mininterval=10.0)
    t0 = time.perf_counter() - elapsed
    loss_ema = None
    while step < cfg.steps:
        rng = random.Random(cfg.seed * 1_000_003 + step)
        batch = [seqs[rng.randrange(len(seqs))] for _ in range(cfg.seqs_per_step)]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, peak=cfg.lr, warmup=cfg.warmup, total=cfg.steps)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for seq in batch:
            anchors = _anchors(seq, cfg.anchors_per_seq, rng)
            if not len(anchors):
                continue
            loss, _, _ = _block_loss(model, target, seq, anchors, cfg.gamma)
            (loss / len(batch)).backward()
            total += float(loss.detach()) / len(batch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_ema = total if loss_ema is None else 0.97 * loss_ema + 0.03 * total
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt_path, model=model.state_dict(), optimizer=opt.state_dict(), step=step, elapsed=time.perf_counter() - t0)
    bar.close()
    wall = time.perf_counter() - t0
    model.eval()
    model.save_pretrained(out_dir)
    held = evaluate_drafter(model, target, heldout) if heldout else {}
    summary = {
        "parameters": n_params,
        "steps": cfg.steps,
        "training_sequences": len(seqs),
        "wall_s": round(wall, 1),
        "train_loss_ema": None if loss_ema is None else round(loss_ema, 4),
        "heldout": held,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(cfg).items()},
        "target_layer_ids": list(model.config.target_layer_ids),
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    log(f"drafter done in {wall:.0f}s; held-out teacher-forced chain acceptance {held.get('chain_acceptance')}")
    return summary
