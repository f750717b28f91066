"""Train a small Qwen3-architecture target (``Qwen3ForCausalLM``) on the tokenized corpus.

Resumable: a checkpoint (model, optimizer, step) is written every ``save_every`` steps; a re-run with the
same output directory continues from it. Batches depend only on ``(seed, step)``, so a resumed run sees
the same data as an uninterrupted one. The final model is written with ``save_pretrained`` together with
the tokenizer, so the directory loads like any hub model.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import attrs
import torch
from tqdm import tqdm

from bastion.utils.checks import positive_number
from bastion.contract.sampling import seeded_generator
from bastion.training.loop import clipped_step, lr_at, resume, save_checkpoint, seed_everything, set_lr
from bastion.training.tokens import eval_windows, sample_windows

__all__ = ["TargetConfig", "build_target", "train_target", "heldout_loss"]



@attrs.frozen
class TargetConfig:
    hidden_size: int = attrs.field(default=256, validator=positive_number)
    num_layers: int = attrs.field(default=4, validator=positive_number)
    num_heads: int = attrs.field(default=4, validator=positive_number)
    num_kv_heads: int = attrs.field(default=2, validator=positive_number)
    intermediate_size: int = attrs.field(default=768, validator=positive_number)
    max_positions: int = attrs.field(default=1024, validator=positive_number)
    seq_len: int = attrs.field(default=512, validator=positive_number)
    batch_size: int = attrs.field(default=8, validator=positive_number)
    steps: int = attrs.field(default=2000, validator=positive_number)
    lr: float = attrs.field(default=2e-3, validator=positive_number)
    warmup: int = attrs.field(default=100, validator=attrs.validators.ge(1))
    weight_decay: float = attrs.field(default=0.05, validator=attrs.validators.ge(0))
    save_every: int = attrs.field(default=100, validator=positive_number)
    eval_windows: int = attrs.field(default=64, validator=positive_number)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads and num_heads by num_kv_heads")
        if self.seq_len > self.max_positions:
            raise ValueError("seq_len must not exceed max_positions")


def build_target(cfg: TargetConfig, tokenizer):
    """A freshly initialised Qwen3ForCausalLM sized by ``cfg`` for ``tokenizer``'s vocabulary."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over held-out windows [n, T]."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        x = windows[i : i + batch_size]  # [b, T]
        logits = model(input_ids=x).logits[:, :-1].float()  # [b, T-1, V]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += float(loss)
        count += x[:, 1:].numel()
    model.train()
    return total / max(1, count)


def train_target(cfg: TargetConfig, tokenizer, train_ids, heldout_ids, out_dir: Path, *, log=print) -> dict:
    """Train (or resume) and write the final model + tokenizer + ``train_summary.json`` to ``out_dir``."""
    out_dir = Path(out_dir)
    ckpt_path = out_dir / "checkpoint.pt"
    seed_everything(cfg.seed)
    model = build_target(cfg, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, elapsed = resume(ckpt_path, model, opt, log=log)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f}M parameters, {len(train_ids) / 1e6:.2f}M training tokens")
    val = eval_windows(heldout_ids, cfg.seq_len, cfg.eval_windows)
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="target", mininterval=10.0)
    t0 = time.perf_counter() - elapsed
    loss_ema = None
    while step < cfg.steps:
        gen = seeded_generator(cfg.seed * 1_000_003 + step)
        x = sample_windows(train_ids, cfg.batch_size, cfg.seq_len, gen)  # [b, T]
        set_lr(opt, lr_at(step, peak=cfg.lr, warmup=cfg.warmup, total=cfg.steps))
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clipped_step(opt, model.parameters())
        step += 1
        lv = float(loss.detach())
        loss_ema = lv if loss_ema is None else 0.98 * loss_ema + 0.02 * lv
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt_path, model=model.state_dict(), optimizer=opt.state_dict(), step=step, elapsed=time.perf_counter() - t0)
    bar.close()
    wall = time.perf_counter() - t0
    val_loss = heldout_loss(model, val) if len(val) else float("nan")
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    summary = {
        "parameters": n_params,
        "steps": cfg.steps,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_tokens": int(len(train_ids)),
        "wall_s": round(wall, 1),
        "train_loss_ema": None if loss_ema is None else round(loss_ema, 4),
        "heldout_loss": round(val_loss, 4),
        "heldout_ppl": round(math.exp(val_loss), 2) if val_loss == val_loss else None,
        "config": attrs.asdict(cfg),
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
    log(f"target done: held-out loss {val_loss:.4f} in {wall:.0f}s")
    return summary
