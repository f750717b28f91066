"""Train a DFlash-format block-diffusion drafter for a frozen target, on one process or many.

Each training sequence is a prompt followed by the target's greedy continuation. Its target features
(concatenated outputs of ``target_layer_ids``, see :mod:`bastion.training.features`) come from the frozen
target online or from a precomputed store; random anchors ``a`` inside the continuation give blocks
``[token a, MASK x (B - 1)]`` that see the features of positions ``< a`` only, exactly as at inference
where the anchor is the not-yet-verified root. Mask slot ``k`` is trained with cross-entropy on the token
at ``a + k``, weighted by ``exp(-(k - 1) / gamma)``: early slots matter more because a later slot only
counts when every earlier one was accepted.

Batches. One optimizer step sees ``seqs_per_step`` sequences (the global batch), drawn from a generator
seeded by ``(seed, step)``; the anchors of batch slot ``j`` come from a generator seeded by
``(seed, step, j)``. Under ``torchrun`` the ``W`` ranks split the slots evenly, dealt by sequence length
so each rank gets about as many tokens (:func:`rank_slots`); the batch, and hence the update, does not
depend on the rank count. Each rank accumulates the gradients of its slots one sequence at a time
(memory of one sequence whatever the batch) and DistributedDataParallel all-reduces them once per step:
the only collective of a step. The logged loss stays on the device and is summed over the ranks once
every ``log_every`` steps.

Checkpoints. Rank 0 writes ``checkpoint.pt`` (drafter, optimizer, step, evaluations); every rank resumes
from it. The optimizer state is the same on every rank, so one checkpoint serves any rank count.

The drafter borrows the target's embedding and lm head (frozen); only the draft layers, ``fc`` and the
norms learn, in float32 (bfloat16 autocast on CUDA). The final drafter is written with
``save_pretrained`` in the DFlash checkpoint format.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F
from tqdm import tqdm

from bastion.utils.checks import positive_number
from bastion.contract.errors import InvalidInputError
from bastion.distributed import DistContext, barrier
from bastion.training.distill import DistillSequence
from bastion.training.features import FeatureSource, OnlineFeatures, target_features
from bastion.training.loop import clipped_step, load_checkpoint, lr_at, resume, save_checkpoint, seed_everything, set_lr

__all__ = [
    "DrafterTrainConfig",
    "build_drafter",
    "trainable_indices",
    "train_drafter",
    "DrafterTraining",
    "prepare_training",
    "train_step",
    "step_batch",
    "rank_slots",
    "evaluate_drafter",
    "target_features",
]



@attrs.frozen
class DrafterTrainConfig:
    num_layers: int = attrs.field(default=2, validator=positive_number)
    block_size: int = attrs.field(default=16, validator=attrs.validators.ge(2))
    target_layer_ids: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    intermediate_size: int | None = None
    anchors_per_seq: int = attrs.field(default=32, validator=positive_number)
    seqs_per_step: int = attrs.field(default=4, validator=positive_number)  # global batch, over every rank
    steps: int = attrs.field(default=2400, validator=positive_number)
    lr: float = attrs.field(default=1e-3, validator=positive_number)
    warmup: int = attrs.field(default=50, validator=attrs.validators.ge(1))
    weight_decay: float = attrs.field(default=0.01, validator=attrs.validators.ge(0))
    gamma: float = attrs.field(default=7.0, validator=positive_number)
    save_every: int = attrs.field(default=50, validator=positive_number)
    eval_every: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # 0: evaluate at the end only
    log_every: int = attrs.field(default=25, validator=positive_number)  # steps between loss all-reduces
    seed: int = 0


def build_drafter(target, cfg: DrafterTrainConfig, mask_token_id: int):
    """A fresh :class:`DFlashDraftModel` sized for ``target`` (an HF causal LM), float32."""
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


def trainable_indices(seqs: Sequence[DistillSequence], exclude: Sequence[int] = ()) -> list[int]:
    """Indices of the sequences that give at least one anchor (a generated token with a label)."""
    skip = set(exclude)
    return [i for i, s in enumerate(seqs) if i not in skip and len(s.ids) - 2 >= s.prompt_len]


def _anchors(seq: DistillSequence, n: int, rng: random.Random) -> torch.Tensor:
    lo, hi = seq.prompt_len, len(seq.ids) - 2  # the anchor is a generated token with at least one label
    if hi < lo:
        return torch.zeros(0, dtype=torch.long)
    pool = range(lo, hi + 1)
    picks = rng.sample(pool, n) if len(pool) > n else list(pool)
    return torch.tensor(sorted(picks), dtype=torch.long)


def _slot_weights(k: int, gamma: float, device: torch.device) -> torch.Tensor:
    return torch.exp(-torch.arange(k, dtype=torch.float32, device=device) / gamma)  # [K]


def _block_loss(net, model, target, feats: torch.Tensor, seq: DistillSequence, anchors: torch.Tensor, gamma: float):
    """(weighted loss, logits [N, K, V], labels [N, K]) for one sequence's anchors. ``net`` is ``model``
    or its DistributedDataParallel wrapper (whose forward is the draft network's)."""
    from bastion.training.blocks import TrainingBlocks, make_training_blocks

    cfg = model.config
    device = model.device
    # built on the host from host tensors (no device read to check the anchors), then copied without waiting
    blocks = make_training_blocks(seq.ids, anchors, cfg.block_size, cfg.mask_token_id)
    blocks = TrainingBlocks(*(t.to(device, non_blocking=True) for t in attrs.astuple(blocks, recurse=False)))
    embeds = target.get_input_embeddings()(blocks.block_ids)  # [N, B, H]
    hidden = net(embeds, blocks.block_positions, feats, None, blocks.context_mask)  # [N, B, H]
    head = target.get_output_embeddings()
    logits = head(hidden[:, 1:].to(head.weight.dtype))  # [N, K, V]
    ce = F.cross_entropy(logits.flatten(0, 1).float(), blocks.labels.flatten(), ignore_index=-100, reduction="none")
    ce = ce.view_as(blocks.labels)  # [N, K]
    w = _slot_weights(ce.shape[1], gamma, device)[None, :] * (blocks.labels != -100)  # [N, K]
    return (ce * w).sum() / w.sum().clamp_min(1e-6), logits, blocks.labels


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate_drafter(
    model, target, seqs: Sequence[DistillSequence], *, features: FeatureSource | None = None,
    indices: Sequence[int] | None = None, anchors_per_seq: int = 32, seed: int = 1234,
) -> dict:
    """Held-out teacher-forced figures: top-1 accuracy per slot and the chain acceptance length (1 +
    number of leading slots whose argmax equals the target's greedy token), averaged over anchors."""
    was_training = model.training
    model.eval()
    source = features or OnlineFeatures(target, model.config.target_layer_ids)
    rng = random.Random(seed)
    k = model.config.block_size - 1
    correct = torch.zeros(k)
    counted = torch.zeros(k)
    accept = []
    for i in indices if indices is not None else range(len(seqs)):
        seq = seqs[i]
        anchors = _anchors(seq, anchors_per_seq, rng)
        if not len(anchors):
            continue
        with _autocast(model.device):
            feats = source.features(i, seq, model.device)
            _, logits, labels = _block_loss(model, model, target, feats, seq, anchors, 1.0)
        hit = ((logits.argmax(-1) == labels) & (labels != -100)).cpu()  # [N, K]
        labels = labels.cpu()
        correct += hit.float().sum(0)
        counted += (labels != -100).float().sum(0)
        accept.append(1.0 + hit.long().cumprod(dim=1).sum(1).float())  # [N]
    model.train(was_training)
    acc = torch.cat(accept) if accept else torch.zeros(1)
    return {
        "chain_acceptance": round(float(acc.mean()), 4),
        "slot_accuracy": [round(float(c / max(n, 1)), 4) for c, n in zip(correct, counted)],
    }


def _global_sum(value: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """``value`` summed over every rank (itself for one process)."""
    if ctx.distributed:
        value = value.clone()
        torch.distributed.all_reduce(value)
    return value


def rank_slots(lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's batch slots: the slots sorted by sequence length (longest first, ties by slot) dealt out
    in snake order (0, 1, .., W - 1, W - 1, .., 0, ...), so every rank gets the same number of sequences
    and about the same number of tokens. Every rank computes the same split from the same batch."""
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    mine = []
    for n, j in enumerate(order):
        lap, pos = divmod(n, world_size)
        if (pos if lap % 2 == 0 else world_size - 1 - pos) == rank:
            mine.append(j)
    return sorted(mine)


@attrs.define(eq=False)
class DrafterTraining:
    """One rank's training state: the draft model, its DistributedDataParallel wrapper (``net``; the model
    itself on one process), the optimizer and the feature source. Built by :func:`prepare_training`,
    advanced by :func:`train_step`."""

    target: Any
    model: Any  # DFlashDraftModel
    net: torch.nn.Module
    opt: torch.optim.Optimizer
    source: FeatureSource
    cfg: DrafterTrainConfig
    ctx: DistContext


def prepare_training(
    target, cfg: DrafterTrainConfig, mask_token_id: int, *, features: FeatureSource | None = None,
    ctx: DistContext = DistContext(), checkpoint: Path | None = None, log=print,
) -> tuple[DrafterTraining, int, float]:
    """A fresh drafter and optimizer on ``ctx.device`` (restored from ``checkpoint`` when it exists),
    wrapped in DistributedDataParallel under torchrun. Returns (state, step, elapsed seconds) to go on from."""
    seed_everything(cfg.seed)
    device = ctx.device
    model = build_drafter(target, cfg, mask_token_id).to(device)
    source = features or OnlineFeatures(target, model.config.target_layer_ids)
    # foreach: one kernel per operation over all parameters instead of one per parameter (same update)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, foreach=True)
    step, elapsed = resume(checkpoint, model, opt, log=log) if checkpoint is not None else (0, 0.0)
    net: torch.nn.Module = model
    if ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the drafter's buffers (rotary frequencies) are constants: no per-forward broadcast
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    model.train()
    return DrafterTraining(target, model, net, opt, source, cfg, ctx), step, elapsed


def step_batch(cfg: DrafterTrainConfig, train_ids: Sequence[int], step: int) -> list[int]:
    """The global batch of optimizer step ``step``: ``seqs_per_step`` indices drawn by ``(seed, step)``."""
    rng = random.Random(f"{cfg.seed}:{step}")
    return [train_ids[rng.randrange(len(train_ids))] for _ in range(cfg.seqs_per_step)]


def train_step(state: DrafterTraining, seqs: Sequence[DistillSequence], train_ids: Sequence[int], step: int) -> tuple[torch.Tensor, int]:
    """Optimizer step ``step`` on this rank: its slots of the global batch (:func:`rank_slots`), gradients
    accumulated one sequence at a time without synchronisation, all-reduced by DistributedDataParallel on
    the last backward only, clipped and applied. Returns (this rank's share of the batch's mean loss, a
    0-dim tensor on the device: no host sync; tokens of this rank's sequences)."""
    cfg, ctx, model, net = state.cfg, state.ctx, state.model, state.net
    device = ctx.device
    batch = step_batch(cfg, train_ids, step)
    slots = rank_slots([len(seqs[i].ids) for i in batch], ctx.rank, ctx.world_size)
    scale = ctx.world_size / cfg.seqs_per_step  # DDP averages over ranks: the update is sum(loss) / batch
    set_lr(state.opt, lr_at(step, peak=cfg.lr, warmup=cfg.warmup, total=cfg.steps))
    state.opt.zero_grad(set_to_none=True)
    local = torch.zeros((), device=device)
    tokens = 0
    for n, j in enumerate(slots):
        seq = seqs[batch[j]]
        anchors = _anchors(seq, cfg.anchors_per_seq, random.Random(f"{cfg.seed}:{step}:{j}"))
        last = n == len(slots) - 1  # DDP all-reduces on the last backward of the step only
        sync = contextlib.nullcontext() if last or not ctx.distributed else net.no_sync()  # type: ignore[operator]
        # accumulation micro-steps run the bare drafter: under no_sync DDP's forward wrapper does
        # nothing they need, at a cost per call; the last one goes through DDP, whose backward
        # all-reduces the accumulated gradients
        forward = net if last else model
        with sync, _autocast(device):
            feats = state.source.features(batch[j], seq, device)  # [1, L, F]
            loss, _, _ = _block_loss(forward, model, state.target, feats, seq, anchors, cfg.gamma)
            (loss * scale).backward()
        local += loss.detach().float()
        tokens += len(seq.ids)
    clipped_step(state.opt, model.parameters())
    return local / cfg.seqs_per_step, tokens


def train_drafter(
    target,
    seqs: Sequence[DistillSequence],
    train_ids: Sequence[int],
    held_ids: Sequence[int],
    cfg: DrafterTrainConfig,
    mask_token_id: int,
    out_dir: Path,
    *,
    features: FeatureSource | None = None,
    ctx: DistContext = DistContext(),
    evaluate: Any = None,
    log=print,
) -> dict:
    """Train (or resume) a drafter for the frozen ``target`` on ``seqs[train_ids]``; rank 0 writes the
    DFlash checkpoint and ``train_summary.json`` to ``out_dir``.

    ``evaluate``: None, or a callable ``(draft model) -> dict`` (e.g. the held-out acceptance evaluation
    of :mod:`bastion.training.evaluate`) run by rank 0 every ``cfg.eval_every`` steps and at the end;
    its results are kept in the checkpoint, logged and written to the summary."""
    if not train_ids:
        raise InvalidInputError("no training sequence has a generated continuation of 2 tokens or more")
    if cfg.seqs_per_step % ctx.world_size:
        raise InvalidInputError(
            f"--seqs-per-step ({cfg.seqs_per_step}) must be a multiple of the number of ranks ({ctx.world_size})"
        )
    out_dir = Path(out_dir)
    ckpt_path = out_dir / "checkpoint.pt"
    say = log if ctx.is_main else (lambda *_a, **_k: None)
    state, step, elapsed = prepare_training(target, cfg, mask_token_id, features=features, ctx=ctx, checkpoint=ckpt_path, log=say)
    model, opt, device = state.model, state.opt, ctx.device
    evals: list[dict] = list((load_checkpoint(ckpt_path) or {}).get("evals", [])) if step else []
    n_params = sum(p.numel() for p in model.parameters())
    say(f"drafter: {n_params / 1e6:.2f}M parameters, {len(train_ids)} training sequences, "
        f"{ctx.world_size} rank(s), global batch {cfg.seqs_per_step}")

    def run_eval(at: int) -> None:
        if evaluate is None or not ctx.is_main:
            return
        with torch.no_grad():
            row = {"step": at, **evaluate(model)}
        evals.append(row)
        say("eval " + json.dumps(row))

    bar = tqdm(total=cfg.steps, initial=step, desc="drafter", mininterval=10.0, disable=not ctx.is_main)
    t0 = time.perf_counter()
    tokens = 0
    loss_ema: float | None = None
    pending: list[torch.Tensor] = []  # this rank's losses of the steps not yet summed over the ranks

    def flush_losses() -> None:
        """One all-reduce (and one host read) for every ``log_every`` steps, not one per step."""
        nonlocal loss_ema
        totals = _global_sum(torch.stack(pending), ctx).tolist()  # [steps]
        pending.clear()
        for total in totals:
            loss_ema = total if loss_ema is None else 0.97 * loss_ema + 0.03 * total
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)

    while step < cfg.steps:
        loss, n_tokens = train_step(state, seqs, train_ids, step)
        pending.append(loss)
        tokens += n_tokens
        step += 1
        bar.update(1)
        evaluating = bool(cfg.eval_every) and step % cfg.eval_every == 0 and step < cfg.steps
        saving = step % cfg.save_every == 0 or step == cfg.steps
        if step % cfg.log_every == 0 or evaluating or saving:  # the same steps on every rank
            flush_losses()
        if evaluating:
            run_eval(step)
        if ctx.is_main and saving:
            save_checkpoint(ckpt_path, model=model.state_dict(), optimizer=opt.state_dict(), step=step,
                            elapsed=elapsed + time.perf_counter() - t0, evals=evals)
    bar.close()
    run_wall = time.perf_counter() - t0
    tokens_all = float(_global_sum(torch.tensor(float(tokens), dtype=torch.float64, device=device), ctx))
    summary: dict[str, Any] = {}
    if ctx.is_main:
        model.eval()
        model.save_pretrained(out_dir)
        if not evals or evals[-1]["step"] != cfg.steps:
            run_eval(cfg.steps)
        held = evaluate_drafter(model, target, seqs, features=state.source, indices=held_ids) if held_ids else {}
        summary = {
            "parameters": n_params,
            "steps": cfg.steps,
            "ranks": ctx.world_size,
            "training_sequences": len(train_ids),
            "wall_s": round(elapsed + run_wall, 1),
            "tokens_per_s": round(tokens_all / run_wall, 1) if run_wall > 0 and tokens_all else None,
            "train_loss_ema": None if loss_ema is None else round(loss_ema, 4),
            "heldout": held,
            "acceptance": evals,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(cfg).items()},
            "target_layer_ids": list(model.config.target_layer_ids),
        }
        (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
        say(f"drafter done in {elapsed + run_wall:.0f}s; held-out teacher-forced chain acceptance "
            f"{held.get('chain_acceptance')}; acceptance {evals[-1] if evals else None}")
    barrier(ctx)
    return summary
