"""The DFlash block-diffusion drafter: one forward per step proposes marginals for depths 1..B-1.

Per sequence it keeps a draft-context cache: per-layer keys/values of the *committed* positions' projected
target features. Committed features arrive through :meth:`DFlashDrafter.begin` (the prompt) and
:meth:`DFlashDrafter.commit` (the step's root and accepted nodes); they are projected lazily at the next
:meth:`DFlashDrafter.propose`, inside the same step. The block's own keys/values are never cached: every
step drafts a fresh block ``[root, MASK x (B - 1)]`` at positions ``context_len .. context_len + B - 1``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import Drafter
from bastion.contract.types import DraftContext, DraftStep, Marginals
from bastion.drafters.dflash.checkpoint import is_dflash_checkpoint
from bastion.drafters.dflash.batch import DFlashDraftBatch, lean_draft
from bastion.drafters.dflash.model import ContextKV, DFlashDraftModel
from bastion.drafters.network import bind_network, load_draft_network

if TYPE_CHECKING:
    from bastion.contract.target import Target

__all__ = ["DFlashDrafter"]

#: at most this many new context positions are projected in the draft's own pass (more are cached first)
_FRESH_MAX = 32

class _KVBuffer:
    """Growable per-layer key/value storage (capacity doubles; reads are views, appends copy only the
    new positions)."""

    def __init__(self) -> None:
        self._keys: list[torch.Tensor] = []  # per layer [1, h_kv, capacity, D]
        self._values: list[torch.Tensor] = []
        self.length = 0

    def clear(self) -> None:
        self._keys, self._values, self.length = [], [], 0

    def append(self, new: ContextKV) -> None:
        m = new.length
        if m == 0:
            return
        need = self.length + m
        if not self._keys or need > self._keys[0].shape[2]:
            cap = max(need, 2 * (self._keys[0].shape[2] if self._keys else 0), 64)
            self._keys = [self._grow(old, k, cap) for old, k in zip(self._keys or [None] * len(new.keys), new.keys)]
            self._values = [self._grow(old, v, cap) for old, v in zip(self._values or [None] * len(new.values), new.values)]
        for buf, k in zip(self._keys, new.keys):
            buf[:, :, self.length : need] = k
        for buf, v in zip(self._values, new.values):
            buf[:, :, self.length : need] = v
        self.length = need

    def _grow(self, old: torch.Tensor | None, like: torch.Tensor, cap: int) -> torch.Tensor:
        buf = like.new_empty((like.shape[0], like.shape[1], cap, like.shape[3]))  # [1, h_kv, cap, D]
        if old is not None and self.length:
            buf[:, :, : self.length] = old[:, :, : self.length]
        return buf

    def view(self, spare: int = 0) -> ContextKV | None:
        """The committed keys/values; with ``spare`` > 0, views that also span ``spare`` scratch slots
        after them (storage grows if needed) for the step's block to be written into in place."""
        if not self.length:
            return None
        end = self.length + spare
        if spare and end > self._keys[0].shape[2]:
            cap = max(end, 2 * self._keys[0].shape[2])
            self._keys = [self._grow(k, k, cap) for k in self._keys]
            self._values = [self._grow(v, v, cap) for v in self._values]
        return ContextKV(tuple(k[:, :, :end] for k in self._keys), tuple(v[:, :, :end] for v in self._values), tail=spare)


def head_in_dtype(head: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The target's lm head as the drafter reads it: the head itself, or, when the drafter runs in a
    narrower floating dtype than the head's weight (a bfloat16 drafter beside a float32 target), a
    frozen copy in the drafter's dtype on the head's device. The head is most of a draft's arithmetic,
    so it runs at the drafter's precision and speed; the copy costs vocab x hidden elements of that
    dtype. A wider drafter dtype never widens the head (that would only cost memory and time)."""
    weight = getattr(head, "weight", None)
    if (
        not isinstance(head, torch.nn.Linear)
        or not isinstance(weight, torch.Tensor)
        or not dtype.is_floating_point
        or torch.finfo(dtype).bits >= torch.finfo(weight.dtype).bits
    ):
        return head
    copy = torch.nn.Linear(head.in_features, head.out_features, bias=head.bias is not None, device=weight.device, dtype=dtype)
    with torch.no_grad():
        copy.weight.copy_(weight)
        if head.bias is not None:
            copy.bias.copy_(head.bias)
    return copy.requires_grad_(False).eval()


class DFlashDrafter(Drafter):
    """Drafter over a DFlash checkpoint (local dir or hub id) or a :class:`DFlashDraftModel` instance.

    Options: ``checkpoint`` (path / hub id / model), ``device``, ``dtype`` (``torch.dtype`` or a name such
    as ``"bfloat16"``; ``None`` or ``"auto"`` keeps the checkpoint's, except a float16 checkpoint loaded
    on a CPU, which computes in float32: see :func:`bastion.utils.dtypes.auto_dtype`), ``block_size``
    (draft a shorter block than the checkpoint's, >= 2).
    """

    proposes = "marginals"

    def __init__(
        self,
        checkpoint: str | Path | DFlashDraftModel,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = torch.float32,
        block_size: int | None = None,
    ) -> None:
        model = load_draft_network(checkpoint, DFlashDraftModel, device=device, dtype=dtype, drafter="DFlash")
        self.model = model.eval()
        self.config = model.config
        full = self.config.block_size
        if block_size is None:
            block_size = full
        if not isinstance(block_size, int) or not 2 <= block_size <= full:
            raise InvalidInputError(f"block_size must be an int in [2, {full}] for this checkpoint, got {block_size!r}")
        self.block_size = block_size
        self._embed: torch.nn.Module | None = None
        self._head: torch.nn.Module | None = None
        self._cache = _KVBuffer()
        self._pending: list[torch.Tensor] = []  # committed features [m, F] not yet projected
        self._pending_len = 0

    # ---------------------------------------------------------------- interface
    @classmethod
    def claims_checkpoint(cls, path: str | Path) -> bool:
        """DFlash checkpoints: a ``config.json`` with a ``dflash_config`` section."""
        return is_dflash_checkpoint(path)

    @property
    def feature_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.config.target_layer_ids

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_draft_tokens(self) -> int:
        """K: depths proposed per step."""
        return self.block_size - 1

    def bind(self, target: "Target") -> None:
        cfg = self.config
        problems = []
        if target.hidden_size != cfg.hidden_size:
            problems.append(f"target hidden size {target.hidden_size} != drafter hidden size {cfg.hidden_size}")
        if target.vocab_size != cfg.vocab_size:
            problems.append(f"target vocabulary {target.vocab_size} != drafter vocabulary {cfg.vocab_size}")
        if target.num_layers != cfg.num_target_layers:
            problems.append(
                f"target has {target.num_layers} layers but the drafter was built for {cfg.num_target_layers} "
                f"(target_layer_ids {list(cfg.target_layer_ids)})"
            )
        out_of_range = [i for i in cfg.target_layer_ids if i >= target.num_layers]
        if out_of_range and target.num_layers == cfg.num_target_layers:  # pragma: no cover - config validated
            problems.append(f"target_layer_ids {out_of_range} exceed the target's {target.num_layers} layers")
        if not 0 <= cfg.mask_token_id < target.vocab_size:
            problems.append(f"mask token id {cfg.mask_token_id} lies outside the target vocabulary [0, {target.vocab_size})")
        embed, head = target.input_embeddings(), target.output_head()
        emb_weight = getattr(embed, "weight", None)
        if emb_weight is not None:
            if emb_weight.shape[-1] != cfg.hidden_size:
                problems.append(f"target embedding width {emb_weight.shape[-1]} != drafter hidden size {cfg.hidden_size}")
            if cfg.mask_token_id >= emb_weight.shape[0]:
                problems.append(f"mask token id {cfg.mask_token_id} has no row in the target embedding ({emb_weight.shape[0]} rows)")
        self.model = bind_network(self.model, target, cfg.target_layer_ids, problems, "DFlash")
        self._embed, self._head = embed, head_in_dtype(head, self.model.dtype)
        self.reset()

    def reset(self) -> None:
        self._cache.clear()
        self._pending = []
        self._pending_len = 0

    def begin(self, context: DraftContext) -> None:
        self.reset()
        if context.features is None:
            raise InvalidInputError("the DFlash drafter needs target features; prefill with its feature_layers")
        if context.features.shape[0] != context.tokens.shape[0]:
            raise InvalidInputError(
                f"context has {context.tokens.shape[0]} tokens but {context.features.shape[0]} feature rows"
            )
        self._push(context.features)

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        if features is None:
            raise InvalidInputError("the DFlash drafter needs the committed positions' target features")
        if features.shape[0] != tokens.shape[0]:
            raise InvalidInputError(f"commit got {tokens.shape[0]} tokens but {features.shape[0]} feature rows")
        self._push(features)

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> Marginals:
        if self._embed is None or self._head is None:
            raise InvalidInputError("DFlashDrafter.propose called before bind(target)")
        if not 0 <= step.root_token < self.config.vocab_size:
            raise InvalidInputError(f"root token {step.root_token} lies outside the vocabulary [0, {self.config.vocab_size})")
        committed = self._cache.length + self._pending_len
        if step.context_len != committed:
            raise InvalidInputError(
                f"drafter holds {committed} committed positions but the step's context length is {step.context_len}"
            )
        device = self.model.device
        # a few new positions (the last step's accepted tokens) are projected in the block's own pass;
        # many (the prompt, a long run of plain steps) first, on their own (no wasted query rows)
        fresh = None
        if 0 < self._pending_len <= _FRESH_MAX and self._cache.length and not torch.is_grad_enabled():
            fresh = self._take_pending(device)  # [1, P, F]
        else:
            self._flush(device)
        spare = self.block_size + (0 if fresh is None else fresh.shape[1])
        # the block's B positions follow the committed ones
        marginals = lean_draft(self.model, self._embed, self._head, self.block_size, step, committed, self._cache.view(spare=spare), fresh)
        if fresh is not None:  # their keys/values now sit in the first scratch slots
            self._cache.length += fresh.shape[1]
        return marginals

    def open_batch(self, contexts: Sequence[DraftContext]) -> DFlashDraftBatch:
        """Per-row draft contexts in one padded buffer: one draft forward per step for every row."""
        if self._embed is None or self._head is None:
            raise InvalidInputError("DFlashDrafter.open_batch called before bind(target)")
        return DFlashDraftBatch(self.model, self._embed, self._head, self.block_size, contexts)

    # ---------------------------------------------------------------- cache
    def _push(self, features: torch.Tensor) -> None:
        if features.dim() != 2 or features.shape[1] != self.config.feature_size:
            raise InvalidInputError(
                f"features must be [m, {self.config.feature_size}] "
                f"(layers {list(self.config.target_layer_ids)} x hidden {self.config.hidden_size}), "
                f"got {tuple(features.shape)}"
            )
        if features.shape[0]:
            self._pending.append(features)
            self._pending_len += int(features.shape[0])

    def _take_pending(self, device: torch.device) -> torch.Tensor:
        """The pending committed features as one [1, P, F] tensor on ``device``; none are pending after."""
        feats = torch.cat(self._pending, dim=0).to(device)[None]
        self._pending = []
        self._pending_len = 0
        return feats

    def _flush(self, device: torch.device) -> None:
        """Project pending committed features into the per-layer context cache."""
        if not self._pending:
            return
        start = self._cache.length
        feats = self._take_pending(device)  # [1, P, F]
        positions = torch.arange(start, start + feats.shape[1], device=device)  # [P]
        self._cache.append(self.model.context_kv(feats, positions))

    @property
    def cached_positions(self) -> int:
        """Committed positions whose keys/values are in the draft-context cache."""
        return self._cache.length
