"""Per-batch state interfaces: what a target and a drafter hold while several sequences decode together.

A batched decode opens one state object per component for the whole batch:

* :meth:`bastion.contract.target.Target.open_batch` -> a :class:`TargetBatch` (ragged contexts in one padded
  cache; one forward per step over every row's tree);
* :meth:`bastion.contract.interfaces.Drafter.open_batch` -> a :class:`DraftBatch` (per-row draft contexts;
  one :meth:`DraftBatch.propose` per step for every row).

Rows are addressed by their index in the *current* batch; :meth:`keep` drops finished rows (and
renumbers the kept ones 0..k-1 in the given order), so no compute is spent on them afterwards.

:class:`LoopDraftBatch` is the default of :meth:`Drafter.open_batch`: one independent copy of the
drafter per row (weights shared, see :meth:`Drafter.fork`), each driven through its single-sequence
methods. It is correct for every drafter; a drafter that overrides ``open_batch`` with a real batched
state runs one forward per step for all rows instead of one per row.

A single sequence is a batch of one: :class:`SoloTargetBatch` and :class:`SoloDraftBatch` run one row
on the target's and the drafter's own single-sequence state (their ``prefill`` / ``forward_tree`` /
``commit`` and ``begin`` / ``propose`` / ``commit``), so a one-row engine costs what the models' own
single-sequence paths cost (compiled verify included) and a target without batched state still decodes.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch
from attrs import field, frozen

from bastion.contract.types import DraftContext, DraftStep, Marginals

if TYPE_CHECKING:
    from bastion.contract.tree import Tree

__all__ = ["BatchPrefill", "BatchTargetOutput", "TargetBatch", "DraftBatch", "LoopDraftBatch", "SoloTargetBatch", "SoloDraftBatch"]


@frozen
class BatchPrefill:
    """What a batched prefill returns: every row's last logits and its prompt features."""

    last_logits: torch.Tensor = field(eq=False)  # [B, V] logits after each row's last prompt token
    features: tuple[torch.Tensor, ...] | None = field(default=None, eq=False)  # per row [L_i, F], or None


@frozen
class BatchTargetOutput:
    """One batched tree forward: row i's node j sits at ``[i, j]`` for ``j < len(trees[i])``; the
    other slots are padding (their values are meaningless)."""

    logits: torch.Tensor = field(eq=False)  # [B, W, V]
    features: torch.Tensor | None = field(default=None, eq=False)  # [B, W, F] or None


class TargetBatch(abc.ABC):
    """A batch of sequences in one target cache."""

    @property
    @abc.abstractmethod
    def context_lens(self) -> list[int]:
        """Committed tokens per row (row i's tokens sit at positions 0 .. ctx_i - 1)."""

    @abc.abstractmethod
    def forward_trees(self, trees: Sequence["Tree"], feature_layers: tuple[int, ...] = ()) -> BatchTargetOutput:
        """One forward over every row's tree (row i's nodes at positions ``ctx_i + depth``, ancestor-only
        attention inside its tree, its own committed context visible). The cache holds the nodes until
        :meth:`commit`."""

    @abc.abstractmethod
    def commit(self, accepted_nodes: Sequence[torch.Tensor]) -> None:
        """Per row, keep the cache entries of ``accepted_nodes[i]`` [m_i] (root first, increasing) right
        after that row's context and drop every other tree node."""

    @abc.abstractmethod
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the current batch, in that order); the others leave."""

    def prefill_more(self, tokens: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A batch of one row takes ``tokens`` [k] more prompt tokens after its context (a prompt
        prefilled in chunks) -> (the logits after the last of them [1, V], their features [k, F] or
        None). The default runs them as a chain tree through :meth:`forward_trees` and commits it;
        override it to skip the logits of all but the last position (``HFTargetBatch`` does)."""
        from bastion.contract.tree import Tree

        if self.batch_size != 1:
            raise ValueError(f"prefill_more() extends a batch of one row, this one has {self.batch_size}")
        k = int(tokens.shape[0])
        out = self.forward_trees([Tree.from_parents(tokens, list(range(-1, k - 1)))], feature_layers)  # [1, k, V]
        self.commit([torch.arange(k)])
        return out.logits[:, k - 1], None if out.features is None else out.features[0, :k]

    def extend(self, other: "TargetBatch") -> None:
        """Append the rows of ``other`` (a batch opened on the same target, e.g. requests that join a
        running batch, prefilled on their own) after this batch's rows; ``other`` is spent. The engine
        calls it between steps, with no tree block pending. Targets whose batches cannot merge keep
        this default, and requests then wait until the running batch has drained."""
        raise NotImplementedError(f"{type(self).__name__} cannot take in rows of another batch")

    @property
    def batch_size(self) -> int:
        return len(self.context_lens)

    def forward_next(self, tokens: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> BatchTargetOutput:
        """A plain step: one forward over every row's next token (LongTensor [B], row i's at position
        ``ctx_i``) -> logits [B, 1, V] (features [B, 1, F]); the cache holds the entries until
        :meth:`commit_next`. The default runs :meth:`forward_trees` on one-node trees; override it to
        skip building B trees per step (``HFTargetBatch`` does)."""
        from bastion.contract.tree import Tree

        trees = [Tree.from_parents(tokens[i : i + 1], [-1]) for i in range(int(tokens.shape[0]))]
        return self.forward_trees(trees, feature_layers)

    def commit_next(self) -> None:
        """Commit every row's one entry of the last :meth:`forward_next` (the default: :meth:`commit`
        with each row's root)."""
        root = torch.zeros(1, dtype=torch.long)  # [1]
        self.commit([root] * self.batch_size)


class DraftBatch(abc.ABC):
    """A batch of per-row draft contexts."""

    @abc.abstractmethod
    def propose(self, steps: Sequence[DraftStep]) -> list[Marginals]:
        """Marginals per row (see :meth:`bastion.contract.interfaces.Drafter.propose`)."""

    @abc.abstractmethod
    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor | None]) -> None:
        """Per row: newly committed tokens [m_i] and their target features [m_i, F] (or None)."""

    @abc.abstractmethod
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the current batch, in that order)."""

    def extend(self, other: "DraftBatch") -> None:
        """Append the rows of ``other`` (opened by the same drafter for requests that join a running
        batch) after this batch's rows; ``other`` is spent. Drafters whose batches cannot merge keep
        this default, and requests then wait until the running batch has drained."""
        raise NotImplementedError(f"{type(self).__name__} cannot take in rows of another batch")

    def commit_next(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """A plain step committed one token per row: ``tokens`` [B] and their features [B, F] (or None).
        The default calls :meth:`commit` with one-entry slices per row; override it to keep a plain
        step O(1) in the batch size (DFlash stacks them and projects them at its next proposal)."""
        b = int(tokens.shape[0])
        self.commit([tokens[i : i + 1] for i in range(b)], [None if features is None else features[i : i + 1] for i in range(b)])


class SequenceDrafter(Protocol):
    """What :class:`LoopDraftBatch` calls on a drafter: its single-sequence methods (every
    :class:`bastion.contract.interfaces.Drafter` has them)."""

    def fork(self) -> "SequenceDrafter": ...

    def begin(self, context: DraftContext) -> None: ...

    def propose(self, step: DraftStep) -> Any: ...

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None: ...


class LoopDraftBatch(DraftBatch):
    """The correct default: one forked single-sequence drafter per row, called row by row. Every row is
    a fork, so the drafter's own state stays free for a single-sequence generation running beside it."""

    def __init__(self, drafter: "SequenceDrafter", contexts: Sequence[DraftContext]) -> None:
        self.rows: list[SequenceDrafter] = []
        for context in contexts:
            row = drafter.fork()
            row.begin(context)
            self.rows.append(row)

    def propose(self, steps: Sequence[DraftStep]) -> list[Marginals]:
        return [row.propose(step) for row, step in zip(self.rows, steps, strict=True)]

    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor | None]) -> None:
        for row, tok, feat in zip(self.rows, tokens, features, strict=True):
            row.commit(tok, feat)

    def keep(self, rows: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in rows]

    def extend(self, other: DraftBatch) -> None:
        if not isinstance(other, LoopDraftBatch):
            raise NotImplementedError(f"LoopDraftBatch cannot take in rows of a {type(other).__name__}")
        self.rows.extend(other.rows)
        other.rows = []


class SoloTargetBatch(TargetBatch):
    """One row on the target's own single-sequence cache (the target's ``forward_tree`` and ``commit``;
    rows of other batches cannot join it). Open it with :meth:`open`, which resets and prefills the
    target's cache: the caller owns the target's state for as long as the batch lives."""

    def __init__(self, target: Any) -> None:
        self.target = target

    @classmethod
    def open(cls, target: Any, prompt: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> tuple["SoloTargetBatch", BatchPrefill]:
        """Prefill ``prompt`` [L] into the target's fresh cache -> (the batch of one, its prefill)."""
        target.reset()
        pre = target.prefill(prompt[None], feature_layers)  # logits [1, V], features [L, F] or None
        return cls(target), BatchPrefill(last_logits=pre.logits[-1:], features=None if pre.features is None else (pre.features,))

    @property
    def context_lens(self) -> list[int]:
        return [self.target.context_len]

    def forward_trees(self, trees: Sequence["Tree"], feature_layers: tuple[int, ...] = ()) -> BatchTargetOutput:
        (tree,) = trees
        out = self.target.forward_tree(tree, feature_layers)  # logits [n, V], features [n, F] or None
        return BatchTargetOutput(out.logits[None], None if out.features is None else out.features[None])

    def forward_next(self, tokens: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> BatchTargetOutput:
        from bastion.contract.tree import Tree

        (token,) = tokens.tolist()  # [1] a host tensor of the row's root (the engine builds it from ints)
        return self.forward_trees([Tree.root_only(token, self.target.device)], feature_layers)

    def commit(self, accepted_nodes: Sequence[torch.Tensor]) -> None:
        (nodes,) = accepted_nodes
        self.target.commit(nodes)

    def keep(self, rows: Sequence[int]) -> None:
        _keep_one(rows)


class SoloDraftBatch(DraftBatch):
    """One row on the drafter's own single-sequence state (``begin`` / ``propose`` / ``commit``, no fork);
    the caller owns the drafter's state for as long as the batch lives."""

    def __init__(self, drafter: "SequenceDrafter", context: DraftContext) -> None:
        self.drafter = drafter
        reset = getattr(drafter, "reset", None)
        if reset is not None:
            reset()
        drafter.begin(context)

    def propose(self, steps: Sequence[DraftStep]) -> list[Marginals]:
        (step,) = steps
        return [self.drafter.propose(step)]

    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor | None]) -> None:
        (tok,), (feat,) = tokens, features
        self.drafter.commit(tok, feat)

    def commit_next(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self.drafter.commit(tokens[:1], None if features is None else features[:1])

    def keep(self, rows: Sequence[int]) -> None:
        _keep_one(rows)


def _keep_one(rows: Sequence[int]) -> None:
    """A batch of one keeps its row or none (the state is the component's own: nothing to drop)."""
    if list(rows) not in ([], [0]):
        raise ValueError(f"a batch of one keeps row 0 or none, not {list(rows)}")
