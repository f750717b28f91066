"""The ``eagle3`` drafter: EAGLE-3 checkpoints proposing candidate trees under bastion's verifier and budget.

Rows. The draft layer's row ``j`` pairs the target feature of committed position ``j`` (three target
hidden states, see :attr:`Eagle3Drafter.feature_layers`) with the token at ``j + 1``, at rotary position
``j``; its output predicts the token at ``j + 2``. The last row of a step pairs the last committed
position's feature with the step's root, so its output gives the root's children. Committed rows live in
the drafter's own key/value cache (:class:`~bastion.drafters.eagle3.model.Eagle3KV`); the features of
newly committed positions (the root and the accepted tokens, from :meth:`Eagle3Drafter.commit`) become
rows at the next :meth:`Eagle3Drafter.propose`, in one forward with the root's row.

Tree (EAGLE-3's own expansion, with its defaults ``total_token`` 60, ``depth`` 7, ``top_k`` 10):

1. the ``top_k`` draft tokens of the root's row are depth-1 candidates and the first frontier;
2. ``depth`` times: the frontier (``top_k`` nodes) is fed in one forward, each node's input being its
   token's embedding and its parent's output (the draft's own hidden state) at position
   ``context_len + depth - 1``, attending to the committed rows and its tree ancestors; each fed node gets
   its ``top_k`` children as candidates, and the ``top_k`` children of highest cumulative log-probability
   form the next frontier;
3. the ``total_token - 1`` candidates of highest cumulative log-probability are kept (in expansion
   order, so parents precede children; a child never scores above its parent, so the set is
   prefix-closed).

**Stopping early** (``early_stop``, default on): when the pipeline passes the budget controller's own
objective (``DraftStep.estimate_speedup``: the bastion and fixed controllers do, ``full`` does not), a
depth is expanded only when that objective predicts a higher speedup with it than without it: the
frontier's children are predicted from the previous depth's mean top-k probabilities, the depth's cost
is the measured seconds of earlier expansions (:func:`bastion.drafters.model.stopping.pays_for_depth`,
the rule the ``model`` drafter follows). Under ``full`` (the ``eagle3`` bench method) the tree is
EAGLE-3's whole tree; stopping early only leaves out the deeper candidates, so the kept nodes are the
best of what was expanded.

Each kept node carries log q (its token given its path, the draft's log-softmax at the step's
temperature) and its draft token mapped into the target vocabulary (``j + d2t[j]``). The tree rows are
dropped at the next commit: the accepted tokens' rows are recomputed from the target's own features, as
EAGLE-3 does.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from attrs import frozen

from bastion.contract.candidates import CandidateTree
from bastion.contract.errors import InvalidInputError
from bastion.contract.interfaces import Drafter
from bastion.contract.types import DraftContext, DraftStep
from bastion.drafters.eagle3.checkpoint import is_eagle3_checkpoint
from bastion.drafters.eagle3.config import check_positive
from bastion.drafters.eagle3.model import Eagle3DraftModel, Eagle3KV
from bastion.drafters.model.stopping import pays_for_depth, predicted_children
from bastion.drafters.network import bind_network, load_draft_network

if TYPE_CHECKING:
    from bastion.contract.target import Target

__all__ = ["Eagle3Drafter"]

#: weight of the newest measurement in the running mean of an expansion's seconds
_COST_EMA = 0.3


@frozen
class _RootRow:
    """The cache's last row, computed with a root that is not committed yet (it is at the next commit)."""

    root: int
    feature: torch.Tensor  # [1, F] the target feature the row read
    output: torch.Tensor  # [1, H] the row's layer output (the root's hidden state)


class Eagle3Drafter(Drafter):
    """Drafter over an EAGLE-3 checkpoint (SafeAILab / SpecForge or vLLM layout; folder or hub id) or an
    :class:`Eagle3DraftModel`.

    Options: ``checkpoint``; ``total_token`` (the tree's nodes, root included: ``total_token - 1``
    candidates are kept, default 60), ``depth`` (expansion steps after the root's, default 7: candidates
    reach depth ``depth + 1``), ``top_k`` (children per expanded node and frontier width, default 10),
    ``device`` (default CPU; moved to the target's feature device at bind), ``dtype`` (default float32;
    None or ``"auto"`` keeps the checkpoint's, except float16 on a CPU, which computes in float32),
    ``early_stop`` (stop expanding where the controller's objective stops rising, see the module doc;
    default True).
    """

    proposes = "candidate_tree"

    def __init__(
        self,
        checkpoint: str | Path | Eagle3DraftModel,
        *,
        total_token: int = 60,
        depth: int = 7,
        top_k: int = 10,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = torch.float32,
        early_stop: bool = True,
    ) -> None:
        self.early_stop = bool(early_stop)
        #: running mean of one expansion's seconds (forward, top-k, host read), measured when stopping early
        self.depth_cost_s: float | None = None
        self.total_token = check_positive("total_token", total_token)
        self.depth = check_positive("depth", depth)
        self.top_k = check_positive("top_k", top_k)
        model = load_draft_network(checkpoint, Eagle3DraftModel, device=device, dtype=dtype, drafter="EAGLE-3")
        self.model = model.eval()
        self.config = model.config
        self._embed: torch.nn.Module | None = model.embed_tokens
        self._layers: tuple[int, ...] | None = self.config.feature_layer_ids
        #: forwards the last proposal ran (the root's rows count as one)
        self.last_depth = 0
        self.reset()

    # ---------------------------------------------------------------- interface
    @classmethod
    def claims_checkpoint(cls, path: str | Path) -> bool:
        """EAGLE-3 checkpoints: a ``config.json`` naming an ``*Eagle3*`` architecture, or a local folder
        whose config has ``draft_vocab_size`` and whose weights hold ``fc`` and a decoder layer."""
        return is_eagle3_checkpoint(path)

    @property
    def feature_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """Target layers whose outputs form the features: the config's
        ``eagle_aux_hidden_state_layer_ids``, else EAGLE-3's default for the bound target (the hidden
        states entering layers 2, L // 2 and L - 3, i.e. outputs 1, L // 2 - 1, L - 4)."""
        if self._layers is None:
            raise InvalidInputError(
                "the EAGLE-3 drafter's feature layers depend on the target's layer count; bind(target) first"
            )
        return self._layers

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def cached_rows(self) -> int:
        """Committed rows whose keys/values are in the draft cache."""
        return self._rows

    def bind(self, target: "Target") -> None:
        cfg = self.config
        problems = []
        if target.vocab_size != cfg.vocab_size:
            problems.append(f"target vocabulary {target.vocab_size} != the checkpoint's vocab_size {cfg.vocab_size}")
        if target.hidden_size != cfg.target_hidden_size:
            problems.append(
                f"fc reads {cfg.feature_size} features (3 x target_hidden_size {cfg.target_hidden_size}) but the target's "
                f"hidden size is {target.hidden_size} (3 x {target.hidden_size} = {3 * target.hidden_size})"
            )
        layers = cfg.feature_layers_for(target.num_layers)
        outside = [i for i in layers if not 0 <= i < target.num_layers]
        if outside:
            source = "eagle_aux_hidden_state_layer_ids" if cfg.feature_layer_ids is not None else "EAGLE-3's default layers"
            problems.append(
                f"feature layer ids {list(layers)} ({source}) include {outside}, outside the target's "
                f"{target.num_layers} layers [0, {target.num_layers})"
            )
        embed = self.model.embed_tokens
        if embed is None:
            embed = target.input_embeddings()
            weight = getattr(embed, "weight", None)
            if weight is not None and weight.shape[-1] != cfg.hidden_size:
                problems.append(
                    f"the checkpoint has no embed_tokens and the target's embedding is {weight.shape[-1]} wide, not the "
                    f"drafter's hidden size {cfg.hidden_size}"
                )
        self.model = bind_network(self.model, target, layers, problems, "EAGLE-3")
        self._embed, self._layers = embed, layers
        self.reset()

    def reset(self) -> None:
        # fresh objects (never cleared in place): a fork's reset leaves its parent's state alone
        self._cache = Eagle3KV()
        self._tokens: list[int] = []  # committed tokens
        self._pending: list[torch.Tensor] = []  # features [m, F] of committed positions not yet in a row
        self._rows = 0  # committed rows in the cache (row j: feature j, token j + 1)
        self._root_row: _RootRow | None = None

    def fork(self) -> "Eagle3Drafter":
        """A drafter sharing this one's network and borrowed embedding, with its own (empty) sequence state."""
        clone = copy.copy(self)
        clone.reset()
        return clone

    def begin(self, context: DraftContext) -> None:
        self.reset()
        tokens = context.tokens.flatten()
        if tokens.numel() == 0:
            raise InvalidInputError("the EAGLE-3 drafter needs at least one context token")
        if context.features is None:
            raise InvalidInputError("the EAGLE-3 drafter needs target features; prefill with its feature_layers")
        self._check_features(context.features, int(tokens.numel()), "context")
        self._tokens = [int(t) for t in tokens.tolist()]
        self._pending = [context.features]

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        toks = [int(t) for t in tokens.flatten().tolist()]
        if features is None:
            raise InvalidInputError("the EAGLE-3 drafter needs the committed positions' target features")
        self._check_features(features, len(toks), "commit")
        self._cache.truncate(self._rows)  # drop the last proposal's tree rows
        if self._root_row is not None and (not toks or toks[0] != self._root_row.root):
            self._undo_root_row()  # the row read a root that was not committed after all
        self._root_row = None  # its root is committed now: the row stays
        self._tokens.extend(toks)
        if toks:
            self._pending.append(features)

    @torch.inference_mode()
    def propose(self, step: DraftStep) -> CandidateTree:
        if self._embed is None:
            raise InvalidInputError("Eagle3Drafter.propose called before bind(target) (the checkpoint has no embed_tokens)")
        root = int(step.root_token)
        if not 0 <= root < self.config.vocab_size:
            raise InvalidInputError(f"root token {root} lies outside the vocabulary [0, {self.config.vocab_size})")
        if step.context_len != len(self._tokens):
            raise InvalidInputError(
                f"drafter holds {len(self._tokens)} committed tokens but the step's context length is {step.context_len}"
            )
        t_start = time.perf_counter()
        self._cache.truncate(self._rows)
        if self._root_row is not None and self._root_row.root != root:
            self._undo_root_row()
        root_hidden = self._root_row.output if self._root_row is not None else self._run_rows(root)  # [1, H]
        self.last_depth = 1
        device = self.model.device
        if step.max_depth is not None and step.max_depth < 1:
            return CandidateTree.from_lists([root], [-1], [0.0], device)
        steps = self.depth if step.max_depth is None else min(self.depth, step.max_depth - 1)
        temperature = step.temperature if step.temperature > 0 else 1.0
        return self._expand(root, root_hidden, steps, temperature, step, t_start)

    # ---------------------------------------------------------------- internals
    def _check_features(self, features: torch.Tensor, rows: int, what: str) -> None:
        width = self.config.feature_size
        if features.dim() != 2 or features.shape[1] != width or features.shape[0] != rows:
            raise InvalidInputError(
                f"{what} features must be [{rows}, {width}] (one row per token, 3 target layers x hidden "
                f"{self.config.target_hidden_size}), got {tuple(features.shape)}"
            )

    def _undo_root_row(self) -> None:
        """Forget the cache's last row (it read a root that is not the committed token)."""
        assert self._root_row is not None
        self._rows -= 1
        self._cache.truncate(self._rows)
        self._pending.insert(0, self._root_row.feature)
        self._root_row = None

    def _embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [n, H] of target ids [n], in the drafter's dtype on its device."""
        assert self._embed is not None
        weight = getattr(self._embed, "weight", None)
        where = weight.device if isinstance(weight, torch.Tensor) else ids.device
        return self._embed(ids.to(where)).to(device=self.model.device, dtype=self.model.dtype)

    def _run_rows(self, root: int) -> torch.Tensor:
        """Turn every pending committed feature into a row (the last one reading ``root``) in one
        forward; returns the root's hidden state [1, H]."""
        model, device = self.model, self.model.device
        feats = torch.cat(self._pending, dim=0).to(device=device, dtype=model.dtype)  # [P, F]
        first, count = self._rows, int(feats.shape[0])
        if count == 0:
            raise InvalidInputError("the EAGLE-3 drafter has no committed position to draft from")
        ids = torch.tensor([*self._tokens[first + 1 :], root], dtype=torch.long, device=device)  # [P]
        positions = torch.arange(first, first + count, device=device)  # [P]
        out = model.rows(self._embed_ids(ids), model.fc(feats), positions, self._cache, None)  # [P, H]
        self._rows += count
        self._pending = []
        self._root_row = _RootRow(root=root, feature=feats[-1:], output=out[-1:])
        return out[-1:]

    def _expand(
        self, root: int, root_hidden: torch.Tensor, steps: int, temperature: float, step: DraftStep, t_start: float
    ) -> CandidateTree:
        """EAGLE-3's top-k tree below ``root`` (see the module docstring), all on the drafter's device;
        fewer than ``steps`` expansions when stopping early."""
        model, device = self.model, self.model.device
        context_len = step.context_len
        estimate = step.estimate_speedup if self.early_stop else None
        k = min(self.top_k, self.config.draft_vocab_size)
        log_p = torch.log_softmax(model.logits(root_hidden).float() / temperature, dim=-1)  # [1, Vd]
        vals, idx = log_p.topk(k, dim=-1)  # [1, k]
        scores = vals[0]  # [k] cumulative log q of the frontier
        # every candidate, in expansion order: draft id, log q, cumulative log q, parent (flat id, -1 root)
        c_ids, c_logq, c_score = [idx[0]], [vals[0]], [scores]
        c_parent = [torch.full((k,), -1, dtype=torch.long, device=device)]
        frontier = torch.arange(k, device=device)  # [k] flat ids of the nodes fed next
        next_ids = model.target_ids(idx[0])  # [k] target ids of the frontier tokens
        hidden = root_hidden.expand(k, -1)  # [k, H] their parents' hidden states
        ancestors = torch.eye(k, dtype=torch.bool, device=device)  # [k, fed] tree rows each fed node sees
        context = torch.ones(k, self._rows, dtype=torch.bool, device=device)  # [k, rows] committed rows
        offset = k
        if estimate is not None:  # host copies of every candidate's log rho and the child profile
            host_scores = scores.tolist()
            profile = vals[0].exp().tolist()  # [k] sorted child probabilities of the last fed nodes
            slots = self.total_token - 1 if step.max_nodes is None else min(self.total_token, step.max_nodes) - 1
        for d in range(steps):
            if estimate is not None:
                predicted = predicted_children(scores.tolist(), profile)
                if not pays_for_depth(estimate, host_scores, predicted, slots, time.perf_counter() - t_start, self.depth_cost_s):
                    break
                t0 = time.perf_counter()
            positions = torch.full((k,), context_len + d, dtype=torch.long, device=device)  # [k]
            visible = torch.cat((context, ancestors), dim=1)  # [k, rows + fed]
            out = model.rows(self._embed_ids(next_ids), hidden, positions, self._cache, visible)  # [k, H]
            log_p = torch.log_softmax(model.logits(out).float() / temperature, dim=-1)  # [k, Vd]
            vals, idx = log_p.topk(k, dim=-1)  # [k, k]
            cumulative = (vals + scores[:, None]).flatten()  # [k * k]
            c_ids.append(idx.flatten())
            c_logq.append(vals.flatten())
            c_score.append(cumulative)
            c_parent.append(frontier.repeat_interleave(k))
            scores, best = cumulative.topk(k)  # [k]
            parent_rows = best // k  # [k] which fed node each new frontier node hangs under
            frontier = offset + best
            offset += k * k
            next_ids = model.target_ids(idx.flatten()[best])
            hidden = out[parent_rows]
            ancestors = torch.cat((ancestors[parent_rows], torch.eye(k, dtype=torch.bool, device=device)), dim=1)
            self.last_depth += 1
            if estimate is not None:
                host_scores.extend(cumulative.tolist())
                profile = vals.exp().mean(0).tolist()  # [k] mean sorted child probabilities of the fed nodes
                cost = time.perf_counter() - t0
                self.depth_cost_s = cost if self.depth_cost_s is None else (1 - _COST_EMA) * self.depth_cost_s + _COST_EMA * cost
        ids, log_q, score, parent = torch.cat(c_ids), torch.cat(c_logq), torch.cat(c_score), torch.cat(c_parent)
        keep = min(self.total_token - 1, int(ids.shape[0]))
        # best first, ties in expansion order (a parent before its child); then back to expansion order
        chosen = torch.sort(score, descending=True, stable=True).indices[:keep].sort().values  # [keep]
        slot = torch.full((int(ids.shape[0]),), -1, dtype=torch.long, device=device)
        slot[chosen] = torch.arange(1, keep + 1, device=device)
        parents = parent[chosen]
        parents = torch.where(parents < 0, 0, slot[parents.clamp(min=0)])  # [keep] node index, root 0
        root_t = torch.tensor([root], dtype=torch.long, device=device)
        return CandidateTree(
            torch.cat((root_t, model.target_ids(ids[chosen]))),
            torch.cat((torch.tensor([-1], dtype=torch.long, device=device), parents)),
            torch.cat((torch.zeros(1, dtype=torch.float32, device=device), log_q[chosen].float())),
        )
