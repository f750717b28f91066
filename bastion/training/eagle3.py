"""Train an EAGLE-3 drafter for a frozen target with the method's training-time test.

Data: the target's own greedy continuations of training prompts (``bastion train distill``), the same
sequences the DFlash and autoregressive drafters learn from. One frozen target forward per sequence gives
the features of every position (the outputs of three target layers, concatenated) and the target's
next-token distribution at every position.

The draft network (:class:`~bastion.drafters.eagle3.Eagle3DraftModel`, one decoder layer) is then run as at
inference, unrolled ``ttt_steps`` times on its own hidden states (EAGLE-3's *training-time test*):

- step 0: row ``j`` reads the target feature of position ``j`` and the token at ``j + 1`` at rotary
  position ``j``, attending causally to rows ``<= j``; its output predicts the token at ``j + 2``;
- step ``k >= 1``: row ``j`` reads the token at ``j + k + 1`` and, in place of a target feature, its OWN
  output of step ``k - 1`` (the draft's hidden state fed back, exactly as a tree node at depth ``k`` is fed at
  inference), at position ``j + k``; it attends to the step-0 rows ``<= j`` (the committed context) and to
  its own rows of steps ``1 .. k`` (its tree ancestors), and predicts the token at ``j + k + 2``.

Step ``k``'s loss is the cross-entropy of the draft distribution against the target's distribution of the
same token (restricted to the draft vocabulary and renormalised), over the positions whose token belongs to
the target's continuation, weighted by ``step_decay ** k``. The rows go through the very
:meth:`Eagle3DraftModel.rows` the drafter decodes with, so training and inference compute the same
function.

The draft vocabulary is the ``draft_vocab`` target tokens seen most often in the training continuations
(all of them by default for a vocabulary up to 32000), stored as ``d2t``; the draft lm head and final norm
start from the target's rows and norm, the token embedding is the target's own (frozen, not stored).
The result is written with :meth:`Eagle3DraftModel.save_pretrained` (SafeAILab / SpecForge layout), so the
``eagle3`` drafter, SpecForge-compatible tools and vLLM load it.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F
from tqdm import tqdm

from bastion.contract.errors import InvalidInputError
from bastion.drafters.eagle3.config import Eagle3Config, default_feature_layers
from bastion.drafters.eagle3.model import Eagle3DraftModel, Eagle3KV
from bastion.training.distill import DistillSequence
from bastion.training.loop import clipped_step, lr_at, resume, save_checkpoint, seed_everything, set_lr

__all__ = [
    "Eagle3TrainConfig",
    "training_feature_layers",
    "draft_vocabulary",
    "build_eagle3_drafter",
    "target_pass",
    "unroll",
    "unrolled_loss",
    "evaluate_eagle3",
    "train_eagle3",
]

_pos = attrs.validators.gt(0)
#: the largest target vocabulary the draft vocabulary covers in full by default (EAGLE-3's usual size)
FULL_DRAFT_VOCAB = 32000


@attrs.frozen
class Eagle3TrainConfig:
    """Shape and schedule of an EAGLE-3 training run."""

    draft_vocab: int | None = attrs.field(default=None, validator=attrs.validators.optional(_pos))  # None: see module doc
    feature_layers: tuple[int, ...] | None = None  # None: training_feature_layers(target layers)
    intermediate_size: int | None = attrs.field(default=None, validator=attrs.validators.optional(_pos))  # None: the target's
    ttt_steps: int = attrs.field(default=7, validator=_pos)  # unrolled steps (step 0 included)
    step_decay: float = attrs.field(default=0.8, validator=_pos)  # weight of step k: step_decay ** k
    seqs_per_step: int = attrs.field(default=4, validator=_pos)
    max_len: int = attrs.field(default=256, validator=_pos)  # tokens per training sequence (the tail is kept)
    steps: int = attrs.field(default=600, validator=_pos)
    lr: float = attrs.field(default=1e-3, validator=_pos)
    warmup: int = attrs.field(default=30, validator=attrs.validators.ge(1))
    weight_decay: float = attrs.field(default=0.01, validator=attrs.validators.ge(0))
    save_every: int = attrs.field(default=50, validator=_pos)
    seed: int = 0


def training_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The three target layers (ids of their outputs) a new drafter reads: EAGLE-3's default (the hidden
    states entering layers 2, L // 2 and L - 3) when those are three distinct layers of the target, else
    the first, middle and last layer (small targets, fewer than 8 layers)."""
    if num_layers < 1:
        raise InvalidInputError(f"the target must have at least one layer, got {num_layers}")
    ids = default_feature_layers(num_layers)
    if len(set(ids)) == 3 and all(0 <= i < num_layers for i in ids):
        return ids
    return (0, (num_layers - 1) // 2, num_layers - 1)


def draft_vocabulary(seqs: Sequence[DistillSequence], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` target ids occurring most often in the continuations of ``seqs`` (ties and unseen ids:
    the lower id first), sorted ascending -> LongTensor [size]."""
    if not 0 < size <= vocab_size:
        raise InvalidInputError(f"the draft vocabulary must hold 1 to {vocab_size} tokens, got {size}")
    counts: Counter[int] = Counter()
    for s in seqs:
        counts.update(int(t) for t in s.ids[s.prompt_len :].tolist())
    ranked = sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def _draft_config(target: Any, cfg: Eagle3TrainConfig, draft_vocab: int, layers: tuple[int, ...]) -> Eagle3Config:
    tcfg = target.config
    heads = int(tcfg.num_attention_heads)
    rope = getattr(tcfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": float(getattr(tcfg, "rope_theta", 10000.0))}
    return Eagle3Config(
        hidden_size=int(tcfg.hidden_size),
        intermediate_size=cfg.intermediate_size or int(tcfg.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(tcfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads),
        vocab_size=int(tcfg.vocab_size),
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(tcfg.hidden_size),
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
        feature_layer_ids=layers,
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 2048)),
        rope_parameters=dict(rope),
    )


def build_eagle3_drafter(target: Any, cfg: Eagle3TrainConfig, seqs: Sequence[DistillSequence]) -> Eagle3DraftModel:
    """A float32 draft network for ``target``: its width, heads and rope, three feature layers, the draft
    vocabulary of ``seqs`` (``d2t``), lm head rows and final norm copied from the target."""
    tcfg = target.config
    vocab = int(tcfg.vocab_size)
    layers = cfg.feature_layers if cfg.feature_layers is not None else training_feature_layers(int(tcfg.num_hidden_layers))
    outside = [i for i in layers if not 0 <= i < int(tcfg.num_hidden_layers)]
    if len(layers) != 3 or outside:
        raise InvalidInputError(
            f"an EAGLE-3 drafter reads three target layers in [0, {tcfg.num_hidden_layers}), got {list(layers)}"
        )
    size = cfg.draft_vocab if cfg.draft_vocab is not None else (vocab if vocab <= FULL_DRAFT_VOCAB else FULL_DRAFT_VOCAB)
    ids = draft_vocabulary(seqs, vocab, size)  # [Vd] target ids of the draft tokens
    torch.manual_seed(cfg.seed)  # the initial weights depend on the seed only
    model = Eagle3DraftModel(_draft_config(target, cfg, size, tuple(layers))).float()
    with torch.no_grad():
        model.d2t.copy_(ids - torch.arange(size))
        model.lm_head.weight.copy_(target.get_output_embeddings().weight.detach()[ids].float())
        norm = getattr(getattr(target, "model", None), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == model.norm.weight.shape:
            model.norm.weight.copy_(norm.weight.detach().float())
    return model.train()


@torch.no_grad()
def target_pass(target: Any, ids: torch.Tensor, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target forward over ``ids`` [T]: the features of every position [T, 3 H] (Hugging Face
    ``hidden_states[i + 1]`` of each layer, concatenated, as the drafter reads them at inference) and the
    target's logits [T, V] (row t: the distribution of token t + 1), both float32."""
    device = target.get_input_embeddings().weight.device
    out = target(input_ids=ids[None].to(device), output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)  # [T, 3H]
    return feats.float(), out.logits[0].float()


class _GrowingKV(Eagle3KV):
    """The draft layer's keys/values kept by concatenation (no in-place writes), so gradients flow through
    every step's attention."""

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = torch.cat((self.keys, keys), dim=2), torch.cat((self.values, values), dim=2)
        self.length = int(self.keys.shape[2])

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:
            raise InvalidInputError("the draft cache is empty")
        return self.keys, self.values


@attrs.frozen
class UnrolledResult:
    """What one unrolled pass over a sequence gives."""

    loss: torch.Tensor  # scalar, differentiable: the weighted sum of the steps' mean losses
    correct: torch.Tensor  # BoolTensor [K, T - 1]: step k row j's argmax equals the target's greedy token
    valid: torch.Tensor  # BoolTensor [K, T - 1]: step k row j has a label inside the continuation


def unroll(model: Eagle3DraftModel, embeds: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The draft layer's outputs at each unrolled step over one sequence (see the module doc).

    ``embeds`` [T, H] token embeddings of the sequence, ``feats`` [T, 3 H] its target features. Returns
    ``steps`` tensors [T - 1, H]: entry ``k`` row ``j`` read token ``min(j + k + 1, T - 1)`` at position ``j + k``
    (and predicts token ``j + k + 2``)."""
    device = model.device
    n_tok = int(embeds.shape[0])
    n = n_tok - 1  # rows: row j pairs feature j with token j + 1
    if n < 1:
        raise InvalidInputError("a training sequence needs at least two tokens")
    cache = _GrowingKV()
    rows = torch.arange(n, device=device)  # [n]
    hidden = model.fc(feats[:n].to(device=device, dtype=model.dtype))  # [n, H]
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n] step-0 rows <= j
    eye = torch.eye(n, dtype=torch.bool, device=device)  # [n, n] the row's own chain
    outs = []
    for k in range(steps):
        tok = (rows + k + 1).clamp(max=n_tok - 1)  # [n] input token index (clamped rows have no label)
        visible = None if k == 0 else torch.cat((causal, *([eye] * k)), dim=1)  # [n, (k + 1) n]
        hidden = model.rows(embeds[tok], hidden, rows + k, cache, visible)  # [n, H]
        outs.append(hidden)
    return outs


def unrolled_loss(
    model: Eagle3DraftModel,
    embed: torch.nn.Module,
    ids: torch.Tensor,
    prompt_len: int,
    feats: torch.Tensor,
    target_logits: torch.Tensor,
    steps: int,
    step_decay: float,
) -> UnrolledResult:
    """The training-time test's loss over one sequence (see the module doc).

    ``ids`` [T] long (prompt + continuation), ``feats`` [T, 3 H] and ``target_logits`` [T, V] from
    :func:`target_pass`, ``embed`` the target's token embedding. Row ``j`` (0 <= j < T - 1) at step ``k``
    predicts token ``j + k + 2``, whose target distribution is ``target_logits[j + k + 1]``; it counts when
    ``j + k + 1 <= T - 1`` and that token is part of the continuation (``j + k + 2 >= prompt_len``)."""
    device = model.device
    n_tok = int(ids.shape[0])
    ids = ids.to(device)
    draft_ids = model.target_ids(torch.arange(model.config.draft_vocab_size, device=device))  # [Vd] target ids
    embeds = embed(ids.to(embed.weight.device)).to(device=device, dtype=model.dtype).detach()  # [T, H]
    outs = unroll(model, embeds, feats, steps)
    n = n_tok - 1
    rows = torch.arange(n, device=device)
    total = torch.zeros((), device=device)
    correct = torch.zeros(steps, n, dtype=torch.bool, device=device)
    valid = torch.zeros(steps, n, dtype=torch.bool, device=device)
    for k, out in enumerate(outs):
        label = rows + k + 1  # [n] target logits row of the predicted token
        ok = (label <= n_tok - 1) & (label + 1 >= prompt_len)  # [n]
        valid[k] = ok
        if not bool(ok.any()):
            continue
        logq = F.log_softmax(model.logits(out[ok]).float(), dim=-1)  # [m, Vd]
        t_logits = target_logits[label[ok]].to(device)  # [m, V]
        p = F.softmax(t_logits[:, draft_ids], dim=-1)  # [m, Vd] the target's, renormalised on the draft vocabulary
        total = total + (step_decay**k) * -(p * logq).sum(-1).mean()
        correct[k, ok] = draft_ids[logq.argmax(-1)] == t_logits.argmax(-1)  # the target's greedy token
    return UnrolledResult(loss=total, correct=correct, valid=valid)


def _window(seq: DistillSequence, max_len: int) -> tuple[torch.Tensor, int]:
    """The sequence's last ``max_len`` tokens and its prompt length inside them."""
    ids = seq.ids[-max_len:]
    return ids, max(0, seq.prompt_len - (int(seq.ids.shape[0]) - int(ids.shape[0])))


@torch.no_grad()
def evaluate_eagle3(
    model: Eagle3DraftModel, target: Any, held: Sequence[DistillSequence], steps: int, max_len: int = 256
) -> dict[str, Any]:
    """Teacher-forced figures on held-out sequences, under the training-time test's conditions:
    ``top1`` per step (how often step k's argmax equals the target's greedy token, the earlier tokens of
    the chain being the target's own) and ``chain_acceptance`` (the mean over continuation positions of 1
    plus the number of leading steps whose argmax is right: the acceptance length of a ``steps``-deep
    greedy chain that ends on the first miss)."""
    was_training = model.training
    model.eval()
    embed = target.get_input_embeddings()
    hits = torch.zeros(steps)
    count = torch.zeros(steps)
    chains: list[float] = []
    for seq in held:
        ids, prompt_len = _window(seq, max_len)
        if ids.shape[0] < 2:
            continue
        feats, logits = target_pass(target, ids, model.config.feature_layer_ids or ())
        res = unrolled_loss(model, embed, ids, prompt_len, feats, logits, steps, 1.0)
        hits += (res.correct & res.valid).sum(1).float().cpu()
        count += res.valid.sum(1).float().cpu()
        full = res.valid.all(0)  # [n] rows whose every step has a label
        if bool(full.any()):
            run = res.correct[:, full].long().cumprod(0).sum(0)  # [m] leading right steps
            chains.extend((1 + run).float().tolist())
    model.train(was_training)
    return {
        "top1": [round(float(h / c), 4) if c > 0 else None for h, c in zip(hits, count)],
        "chain_acceptance": round(sum(chains) / len(chains), 4) if chains else None,
        "positions": int(count[0]),
    }


def train_eagle3(
    target: Any,
    train: Sequence[DistillSequence],
    held: Sequence[DistillSequence],
    cfg: Eagle3TrainConfig,
    out_dir: Path,
    *,
    log: Any = print,
    progress: bool = True,
) -> Eagle3DraftModel:
    """Train an EAGLE-3 drafter for the frozen ``target`` on ``train``, on the target's device (float32
    weights); resumable from
    ``out_dir/checkpoint.pt`` (the draft vocabulary is rebuilt from the same sequences, so a resumed run
    continues the same network). Returns the drafter, also saved in ``out_dir`` (``config.json``,
    ``model.safetensors``, ``train_summary.json``: losses, held-out figures, the configuration)."""
    if not train:
        raise InvalidInputError("no training sequences")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    target.eval()
    embed = target.get_input_embeddings()
    model = build_eagle3_drafter(target, cfg, train).to(embed.weight.device)  # trains where the target runs
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = out_dir / "checkpoint.pt"
    step, elapsed = resume(ckpt, model, opt, log=log)
    layers = model.config.feature_layer_ids or ()
    bar = tqdm(total=cfg.steps, initial=step, desc="eagle3", mininterval=5.0, disable=not progress)
    t0, ema, first, tokens = time.perf_counter(), None, None, 0
    while step < cfg.steps:
        rng = random.Random(cfg.seed * 1_000_003 + step)  # the step's batch depends on the seed and step only
        batch = rng.sample(list(train), min(cfg.seqs_per_step, len(train)))
        set_lr(opt, lr_at(step, peak=cfg.lr, warmup=cfg.warmup, total=cfg.steps))
        opt.zero_grad(set_to_none=True)
        value, acc0 = 0.0, []
        for seq in batch:  # one sequence at a time: gradients accumulate
            ids, prompt_len = _window(seq, cfg.max_len)
            if ids.shape[0] < 2:
                continue
            feats, logits = target_pass(target, ids, layers)
            res = unrolled_loss(model, embed, ids, prompt_len, feats, logits, cfg.ttt_steps, cfg.step_decay)
            (res.loss / len(batch)).backward()
            value += float(res.loss.detach()) / len(batch)
            tokens += int(ids.shape[0])
            if bool(res.valid[0].any()):
                acc0.append(float(res.correct[0][res.valid[0]].float().mean()))
        clipped_step(opt, params)
        step += 1
        first = value if first is None else first
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", top1=f"{sum(acc0) / max(1, len(acc0)):.2f}")
        if step % cfg.save_every == 0 or step == cfg.steps:
            save_checkpoint(ckpt, model=model.state_dict(), optimizer=opt.state_dict(), step=step,
                            elapsed=elapsed + time.perf_counter() - t0)
    bar.close()
    run_s = time.perf_counter() - t0
    model.eval()
    model.save_pretrained(out_dir)
    summary = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": cfg.steps,
        "training_sequences": len(train),
        "feature_layers": list(layers),
        "draft_vocab_size": model.config.draft_vocab_size,
        "wall_s": round(elapsed + run_s, 1),
        "tokens_per_s": round(tokens / run_s, 1) if run_s > 0 and tokens else None,
        "first_step_loss": None if first is None else round(first, 4),
        "train_loss_ema": None if ema is None else round(ema, 4),
        "heldout": evaluate_eagle3(model, target, held, cfg.ttt_steps, cfg.max_len) if held else None,
        "config": attrs.asdict(cfg),
    }
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return model
