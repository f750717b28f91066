"""Train a small autoregressive drafter (a plain causal LM) for a frozen target by distillation.

The drafter is a Hugging Face causal LM of the target's family with fewer layers and the target's
vocabulary. With the target's width it starts from the target's own embedding, first decoder layers and
final norm (a truncated copy of the target), which it then adapts on the target's own greedy
continuations of training prompts (``bastion train distill``, the DFlash drafter's data): cross-entropy
on every continuation token, which is exactly the token the target emits there, so the drafter learns
to predict what verification accepts.

Checkpoints are resumable; the final drafter is written with ``save_pretrained`` (any
``AutoModelForCausalLM`` loads it; bastion's ``model`` drafter takes the directory).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F
from tqdm import tqdm

from bastion.training.distill import DistillSequence
from bastion.training.loop import clipped_step, lr_at, resume, save_checkpoint, seed_everything, set_lr

__all__ = ["ARDrafterConfig", "build_ar_drafter", "train_ar_drafter", "evaluate_ar_drafter"]

_pos = attrs.validators.gt(0)


@attrs.frozen
class ARDrafterConfig:
    num_layers: int = attrs.field(default=1, validator=_pos)
    hidden_size: int | None = None  # None: the target's width (and initialisation from its weights)
    init_from_target: bool = True  # copy embedding, first layers and final norm when widths match
    seqs_per_step: int = attrs.field(default=4, validator=_pos)
    max_len: int = attrs.field(default=192, validator=_pos)
    steps: int = attrs.field(default=300, validator=_pos)
    lr: float = attrs.field(default=1e-3, validator=_pos)
    warmup: int = attrs.field(default=30, validator=attrs.validators.ge(1))
    weight_decay: float = attrs.field(default=0.01, validator=attrs.validators.ge(0))
    save_every: int = attrs.field(default=50, validator=_pos)
    seed: int = 0


def build_ar_drafter(target: Any, cfg: ARDrafterConfig) -> Any:
    """A causal LM of the target's class with ``cfg.num_layers`` layers and the target's vocabulary;
    initialised from the target's embedding, first layers and final norm when the widths match."""
    from transformers import AutoModelForCausalLM

    tcfg = target.config
    dcfg = tcfg.__class__.from_dict(tcfg.to_dict())
    dcfg.num_hidden_layers = cfg.num_layers
    if getattr(dcfg, "layer_types", None) is not None:
        dcfg.layer_types = list(dcfg.layer_types)[: cfg.num_layers]
    width = cfg.hidden_size or tcfg.hidden_size
    if width != tcfg.hidden_size:
        heads = max(1, width // int(getattr(tcfg, "head_dim", 64) or 64))
        dcfg.hidden_size, dcfg.intermediate_size = width, 3 * width
        dcfg.num_attention_heads, dcfg.num_key_value_heads = heads, max(1, heads // 2)
    model = AutoModelForCausalLM.from_config(dcfg, dtype=torch.float32)
    if cfg.init_from_target and width == tcfg.hidden_size:
        own = model.state_dict()
        copied = {k: v for k, v in target.state_dict().items() if k in own and own[k].shape == v.shape}
        model.load_state_dict(copied, strict=False)
    return model


def _batch(seqs: Sequence[DistillSequence], max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [b, T], attention mask [b, T] and the loss mask [b, T] (positions whose next token
    is part of the target's continuation)."""
    rows = [s.ids[-max_len:] for s in seqs]
    starts = [max(0, s.prompt_len - (len(s.ids) - len(r))) for s, r in zip(seqs, rows)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    loss = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (r, st) in enumerate(zip(rows, starts)):
        ids[i, : len(r)] = r
        attn[i, : len(r)] = 1
        loss[i, max(0, st - 1) : len(r) - 1] = True  # position t predicts token t + 1
    return ids, attn, loss


def _logits_at(model: Any, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits at the ``mask`` positions only -> [N, V] (the vocabulary projection skips the rest)."""
    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state  # [b, T, H]
    return model.get_output_embeddings()(hidden[mask]).float()  # [N, V]


def _distill_loss(drafter: Any, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the next token at the ``mask`` positions: the target's own greedy choices."""
    labels = torch.roll(ids, -1, dims=1)[mask]  # [N] token t + 1
    return F.cross_entropy(_logits_at(drafter, ids, attn, mask), labels)


@torch.no_grad()
def evaluate_ar_drafter(drafter: Any, target: Any, held: Sequence[DistillSequence], max_len: int = 192) -> dict[str, float]:
    """Teacher-forced agreement on held-out continuations: ``top1`` = how often the drafter's argmax equals
    the target's (the per-token acceptance of a greedy chain), ``expected_q`` = mean probability the
    drafter gives the target's choice, and ``chain_acceptance`` = mean run length of agreements (+1)."""
    drafter.eval()
    hits = total = 0
    q_sum = 0.0
    runs: list[int] = []
    for s in held:
        ids, attn, mask = _batch([s], max_len)
        t_arg = _logits_at(target, ids, attn, mask).argmax(-1)  # [N]
        lq = F.log_softmax(_logits_at(drafter, ids, attn, mask), dim=-1)  # [N, V]
        agree = (lq.argmax(-1) == t_arg).tolist()
        hits += sum(agree)
        total += len(agree)
        q_sum += float(lq.gather(1, t_arg[:, None]).exp().sum())
        run = 0
        for a in agree:  # acceptance of a depth-unbounded greedy chain, step after step
            if a:
                run += 1
            else:
                runs.append(run + 1)
                run = 0
    drafter.train()
    return {
        "top1": hits / max(1, total),
        "expected_q": q_sum / max(1, total),
        "chain_acceptance": sum(runs) / max(1, len(runs)),
    }


def train_ar_drafter(
    target: Any, train: Sequence[DistillSequence], held: Sequence[DistillSequence], cfg: ARDrafterConfig, out_dir: Path
) -> Any:
    """Distil ``target`` into a small causal LM; resumable from ``out_dir/checkpoint.pt``. Returns the
    drafter (also saved with ``save_pretrained`` in ``out_dir``, with ``train_summary.json``)."""
    out_dir = Path(out_dir)
    seed_everything(cfg.seed)
    target.eval()
    drafter = build_ar_drafter(target, cfg).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = out_dir / "checkpoint.pt"
    step, elapsed = resume(ckpt, drafter, opt)
    rng = random.Random(cfg.seed * 1_000_003 + step)
    bar = tqdm(total=cfg.steps, initial=step, desc="ar-drafter", mininterval=5.0)
    t0, ema = time.perf_counter(), None
    while step < cfg.steps:
        set_lr(opt, lr_at(step, peak=cfg.lr, warmup=cfg.warmup, total=cfg.steps))
        ids, attn, mask = _batch(rng.sample(list(train), min(cfg.seqs_per_step, len(train))), cfg.max_len)
        loss = _distill_loss(drafter, ids, attn, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clipped_step(opt, drafter.parameters())
        step += 1
        value = float(loss.detach())
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt, model=drafter.state_dict(), optimizer=opt.state_dict(), step=step,
                            elapsed=elapsed + time.perf_counter() - t0)
    bar.close()
    wall = elapsed + time.perf_counter() - t0
    drafter.eval()
    drafter.save_pretrained(out_dir)
    summary = {
        "parameters": sum(p.numel() for p in drafter.parameters()),
        "steps": cfg.steps,
        "training_sequences": len(train),
        "wall_s": round(wall, 1),
        "train_loss_ema": None if ema is None else round(ema, 4),
        "heldout": {k: round(v, 4) for k, v in evaluate_ar_drafter(drafter, target, held, cfg.max_len).items()},
        "config": attrs.asdict(cfg),
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return drafter
