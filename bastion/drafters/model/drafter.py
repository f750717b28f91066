"""The ``model`` drafter: any Hugging Face causal LM with the target's vocabulary, drafting a candidate tree.

Per step (see :meth:`ModelDrafter.propose`):

1. One causal forward over the committed tokens not yet in the draft cache and the root: the root's
   next-token distribution gives its ``top_k`` children (depth 1).
2. Depth by depth: the ``width`` frontier nodes of highest rho are fed in ONE batched tree forward
   (ancestor-only mask, positions ``context_len + depth``); each gets its ``top_k`` most likely children.
   Before each such forward the drafter asks whether the depth can pay for itself
   (:mod:`bastion.drafters.model.stopping`) with its measured per-depth cost.
3. Every candidate carries log q(token | its path) at the step's temperature, so rho is the product
   along the path and best-first selection over the candidates is optimal under A_hat.

:meth:`ModelDrafter.commit` keeps the cache entries of the accepted path's fed nodes (no recomputation)
and queues the rest (e.g. an accepted leaf that was never fed) for the next step's first forward.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bastion.contract.candidates import CandidateTree
from bastion.utils.checks import check_device, check_number
from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.contract.interfaces import Drafter
from bastion.contract.types import DraftContext, DraftStep
from bastion.drafters.dtypes import as_dtype
from bastion.drafters.model.cache import DraftKV
from bastion.drafters.model.stopping import pays_for_depth, predicted_children, predicted_gain, worth_expanding

if TYPE_CHECKING:
    from bastion.contract.target import Target

__all__ = ["ModelDrafter", "load_causal_lm"]

#: weight of the newest measurement in the running per-depth cost
_COST_EMA = 0.3
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def load_causal_lm(checkpoint: Any, device: str | torch.device | None, dtype: torch.dtype | str | None) -> Any:
    """A causal LM from a local directory, a hub id or an already loaded model (moved to ``device`` /
    ``dtype`` when given), in eval mode with an attention implementation that takes a 4D tree mask. A
    checkpoint loaded with no dtype keeps its stored one, except float16 loaded onto a CPU ``device``:
    float32 (see :func:`bastion.utils.dtypes.auto_dtype`)."""
    from bastion.huggingface.causal_lm import SUPPORTED_ATTENTION, check_finite_weights, load_checked_causal_lm

    dt = as_dtype(dtype)
    if device is not None:
        device = check_device(device)  # a CUDA device on a build without one: bastion's error, not torch's
    if isinstance(checkpoint, (str, Path)):
        # complete or refused: missing, unexpected, mis-shaped or integer weights, a DFlash folder (which
        # has no embedding or head) and absurd config sizes are named before anything decodes
        model = load_checked_causal_lm(checkpoint, "the draft model", dtype=dt or "auto", attn_implementation="sdpa")
        if dt is None and device is not None:  # auto: the stored dtype, but float32 for float16 on a CPU
            from bastion.huggingface.causal_lm import compute_in_auto_dtype

            model = compute_in_auto_dtype(model, device, f"draft model {str(checkpoint)!r}")
        check_finite_weights(model, checkpoint)
    elif isinstance(checkpoint, torch.nn.Module) and hasattr(checkpoint, "config"):
        model = checkpoint
        impl = getattr(model.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise IncompatibleComponentsError(
                f"draft model attention {impl!r} cannot take a tree mask; load it with attn_implementation='sdpa'"
            )
    else:
        raise InvalidInputError(
            f"checkpoint must be a directory, a hub id or a Hugging Face causal LM, got {type(checkpoint).__name__}"
        )
    if device is not None or dt is not None:
        model = model.to(device=device, dtype=dt)
    return model.eval()


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
    return value


class ModelDrafter(Drafter):
    """Autoregressive drafter over any Hugging Face causal LM sharing the target's vocabulary.

    Options: ``checkpoint`` (local dir, hub id or a loaded model), ``depth`` (most draft depths, default
    8), ``width`` (frontier nodes expanded per depth, default 4), ``top_k`` (children per expanded node,
    default 4), ``early_stop`` (apply the gain-per-second rule, default True), ``depth_cost_s`` (seconds
    one expansion depth costs, when known; default: measured, a running mean), ``device`` (default: the
    target's at bind), ``dtype`` (default float32; ``None`` keeps the checkpoint's, except float16
    loaded onto a CPU, which computes in float32).
    """

    proposes = "candidate_tree"

    def __init__(
        self,
        checkpoint: Any,
        *,
        depth: int = 8,
        width: int = 4,
        top_k: int = 4,
        early_stop: bool = True,
        depth_cost_s: float | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = torch.float32,
    ) -> None:
        self.depth = _positive("depth", depth)
        self.width = _positive("width", width)
        self.top_k = _positive("top_k", top_k)
        self.early_stop = bool(early_stop)
        self.model = load_causal_lm(checkpoint, device, dtype)
        cfg = self.model.config
        self._vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self._max_positions = next((int(getattr(cfg, k)) for k in _POSITION_KEYS if getattr(cfg, k, None)), 1 << 30)
        self._kv = DraftKV(self.model)
        self._tokens: list[int] = []  # committed tokens whose keys/values are in the cache
        self._pending: list[int] = []  # committed tokens still to run through the model
        self._last: tuple[int, list[dict[int, int]], list[int]] | None = None  # root, children, slots
        #: seconds of one expansion depth: its forward and the bookkeeping of its children (a running
        #: mean of measurements, None until the first one; fixed when given to the constructor). The
        #: root's forward is the same work and is measured every step (unless it also runs more queued
        #: tokens than a depth feeds), so the estimate stays current while the rule expands nothing.
        self.depth_cost_s: float | None = None if depth_cost_s is None else check_number("depth_cost_s", depth_cost_s)
        self._measure_depths = depth_cost_s is None
        #: depths the last proposal expanded (the root forward counts as one)
        self.last_depth = 0

    # ---------------------------------------------------------------- interface
    @classmethod
    def claims_checkpoint(cls, path: str | Path) -> bool:
        """Plain causal LMs: a ``config.json`` whose ``architectures`` name a ``*ForCausalLM`` class and that
        is not a DFlash checkpoint (those carry a ``dflash_config`` section)."""
        from bastion.drafters.dflash.checkpoint import resolve_checkpoint_dir

        try:
            data = json.loads((resolve_checkpoint_dir(path, config_only=True) / "config.json").read_text())
        except (InvalidInputError, OSError, ValueError):
            return False
        if not isinstance(data, dict) or "dflash_config" in data:
            return False
        archs = data.get("architectures") or []
        return isinstance(archs, list) and any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def committed_tokens(self) -> list[int]:
        """Committed tokens whose keys/values are in the draft cache (the rest wait in a queue)."""
        return list(self._tokens)

    @property
    def cache(self) -> Any:
        """The draft model's ``DynamicCache`` (read-only use: tests inspect it)."""
        return self._kv.cache

    def bind(self, target: "Target") -> None:
        if self._vocab != target.vocab_size:
            raise IncompatibleComponentsError(
                f"draft model vocabulary ({self._vocab}) differs from the target's ({target.vocab_size}); the "
                "model drafter needs a causal LM with the target's tokenizer"
            )
        if self._kv.device != target.device:
            self.model = self.model.to(target.device)
            self._kv = DraftKV(self.model)
        self.reset()

    def reset(self) -> None:
        self._kv.reset()
        self._tokens, self._pending, self._last = [], [], None

    @torch.inference_mode()
    def begin(self, context: DraftContext) -> None:
        self.reset()
        ids = context.tokens.flatten().tolist()
        if not ids:
            raise InvalidInputError("the model drafter needs at least one context token")
        self._check_room(len(ids))
        self._kv.chain(torch.tensor(ids, dtype=torch.long), len(ids))
        self._tokens = ids

    @torch.inference_mode()
    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        toks = [int(t) for t in tokens.tolist()]
        slots: list[int] = []
        done = 0
        if self._last is not None and toks and toks[0] == self._last[0]:
            _root, children, slot_of = self._last
            node, slots, done = 0, [slot_of[0]], 1
            for tok in toks[1:]:
                child = children[node].get(tok)
                if child is None or slot_of[child] < 0:  # not a candidate, or never fed: queue it
                    break
                node = child
                slots.append(slot_of[child])
                done += 1
        if slots:
            self._kv.keep(slots)
        else:
            self._kv.drop_tree()
        self._tokens.extend(toks[:done])
        self._pending.extend(toks[done:])
        self._last = None

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> CandidateTree:
        t_start = time.perf_counter()
        root = int(step.root_token)
        if not 0 <= root < self._vocab:
            raise InvalidInputError(f"root token {root} lies outside the vocabulary [0, {self._vocab})")
        held = len(self._tokens) + len(self._pending)
        if step.context_len != held:
            raise InvalidInputError(f"drafter holds {held} committed tokens but the step's context length is {step.context_len}")
        self._kv.drop_tree()
        self._last = None
        depth = min(self.depth, self._max_positions - step.context_len)
        if step.max_depth is not None:
            depth = min(depth, step.max_depth)
        if depth < 1:
            self.last_depth = 0
            return CandidateTree.from_lists([root], [-1], [0.0], self._kv.device)
        temperature = step.temperature if step.temperature > 0 else 1.0
        slots_left = None if step.max_nodes is None else step.max_nodes - 1

        # candidate lists (host): token, parent, log q, log rho, depth, fed slot (-1: not fed)
        tokens, parents, log_q, scores, depths, slot_of = [root], [-1], [0.0], [0.0], [0], [0]
        children: list[dict[int, int]] = [{}]
        ancestors: list[list[int]] = [[0]]  # per fed slot: the fed slots it sees (itself included)
        fed_nodes = [0]  # candidate index of each fed slot

        # depth 0: queued committed tokens + the root, one causal chain
        chain = torch.tensor([*self._pending, root], dtype=torch.long)
        # the root's forward measures a depth's cost too, unless it also catches up on many queued tokens
        measure = self._measure_depths and chain.shape[0] <= self.width
        t0 = time.perf_counter()
        logits = self._kv.chain(chain, len(self._pending))[-1:]  # [1, V]
        self._tokens.extend(self._pending)
        self._pending = []
        frontier = [0]
        profile: list[float] = []
        self.last_depth = 1
        for d in range(depth):
            if d:  # expand the best `width` frontier nodes of depth d in one tree forward
                frontier = sorted((i for i in frontier if scores[i] != float("-inf")), key=lambda i: -scores[i])[: self.width]
                if not frontier:
                    break
                if self.early_stop and not self._pays(step, scores, [scores[i] for i in frontier], profile, slots_left, t_start):
                    break
                t0, measure = time.perf_counter(), self._measure_depths
                logits = self._feed(frontier, parents, tokens, slot_of, ancestors, fed_nodes, step.context_len + d)
                self.last_depth += 1
            vals, idx = torch.topk(torch.log_softmax(logits.float() / temperature, dim=-1), min(self.top_k, self._vocab), dim=-1)
            packed = torch.stack((vals.double(), idx.double())).tolist()  # [2][w][k]: one host transfer
            new_frontier: list[int] = []
            sums = [0.0] * len(packed[0][0])
            for node, row_v, row_t in zip(frontier, packed[0], packed[1]):
                for r, (v, t) in enumerate(zip(row_v, row_t)):
                    sums[r] += math.exp(v)
                    if v == float("-inf"):
                        continue
                    c = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                    log_q.append(v)
                    scores.append(scores[node] + v)
                    depths.append(d + 1)
                    slot_of.append(-1)
                    children.append({})
                    children[node][int(t)] = c
                    new_frontier.append(c)
            profile = [s / len(frontier) for s in sums]
            frontier = new_frontier
            if measure:  # forward, host read and bookkeeping of the depth (the root's too)
                cost = time.perf_counter() - t0
                self.depth_cost_s = cost if self.depth_cost_s is None else (1 - _COST_EMA) * self.depth_cost_s + _COST_EMA * cost
        self._last = (root, children, slot_of)
        return CandidateTree.from_lists(tokens, parents, log_q, self._kv.device)

    # ---------------------------------------------------------------- internals
    def _pays(
        self,
        step: DraftStep,
        scores: list[float],
        frontier: list[float],
        profile: list[float],
        slots: int | None,
        t_start: float,
    ) -> bool:
        """Whether the next depth pays for its cost: by the controller's own estimate when the pipeline
        passes one, else by the pipeline's running seconds per token (:mod:`.stopping`)."""
        if step.estimate_speedup is not None:
            predicted = predicted_children(frontier, profile)
            draft_s = time.perf_counter() - t_start
            return pays_for_depth(step.estimate_speedup, scores[1:], predicted, slots, draft_s, self.depth_cost_s)
        gain = predicted_gain(scores[1:], frontier, profile, slots)
        return worth_expanding(gain, step.seconds_per_token, self.depth_cost_s)

    def _feed(
        self,
        frontier: list[int],
        parents: list[int],
        tokens: list[int],
        slot_of: list[int],
        ancestors: list[list[int]],
        fed_nodes: list[int],
        position: int,
    ) -> torch.Tensor:
        """One batched tree forward over ``frontier`` (all at ``position``) -> logits [w, V]."""
        base = self._kv.fed
        w = len(frontier)
        mask = torch.zeros(w, base + w, dtype=torch.bool)  # [w, fed + w]
        for j, node in enumerate(frontier):
            seen = [*ancestors[slot_of[parents[node]]], base + j]
            mask[j, seen] = True
            slot_of[node] = base + j
            ancestors.append(seen)
            fed_nodes.append(node)
        ids = torch.tensor([tokens[i] for i in frontier], dtype=torch.long)  # [w]
        positions = torch.full((w,), position, dtype=torch.long)  # [w]
        return self._kv.tree(ids, positions, mask)

    def _check_room(self, length: int) -> None:
        if length > self._max_positions:
            raise InvalidInputError(f"context of {length} tokens exceeds the draft model's {self._max_positions} positions")
