"""The five pluggable stage interfaces of a bastion pipeline.

Signatures are fixed: optional per-call context travels inside typed objects (``DraftStep``,
``SamplingConfig``), never as extra positional arguments on a subclass. Implementations register through
the ``bastion_register_components`` hook (see :mod:`bastion.contract.hookspecs`).
"""

from __future__ import annotations

import abc
import copy
import numbers
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Mapping, Sequence

import torch
from attrs import field, frozen

from bastion.contract.candidates import CandidateTree
from bastion.contract.tree import Tree
from bastion.contract.types import DraftContext, DraftStep, Marginals, SamplingConfig, SpeedupEstimator, StepFeedback, Verdict

if TYPE_CHECKING:
    from bastion.contract.batch_state import DraftBatch
    from bastion.contract.target import Target

__all__ = [
    "COMPONENT_INTERFACES",
    "KINDS",
    "BatchStepCosts",
    "BudgetController",
    "BudgetDecision",
    "Drafter",
    "LatencyModel",
    "TreeBuilder",
    "Verifier",
]


class Drafter(abc.ABC):
    """Proposes the tokens after the root, in one call per step: position-wise :class:`Marginals` (block
    drafters) or a :class:`CandidateTree` with per-node conditional log-probabilities (autoregressive
    drafters).

    Life cycle per generation: :meth:`bind` (once per pipeline) -> :meth:`begin` (after prefill) ->
    repeated (:meth:`propose`, :meth:`commit`).
    """

    #: the proposal kind :meth:`propose` returns (``"marginals"`` or ``"candidate_tree"``), declared so
    #: the pipeline can check the tree builder takes it when it is assembled. ``None``: undeclared, the
    #: pipeline checks the first proposal instead.
    proposes: ClassVar[str | None] = None

    #: target layer ids whose outputs the drafter reads (HF ``hidden_states[i + 1]``), concatenated
    #: along the feature axis in this order. Empty: the drafter needs no target features.
    feature_layers: tuple[int, ...] = ()

    def bind(self, target: "Target") -> None:  # noqa: B027 - optional hook
        """Attach to the target (borrow embeddings / lm head, check compatibility). Raise
        :class:`bastion.contract.errors.IncompatibleComponentsError` when the two cannot work together."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Size V of the vocabulary the marginals range over (must equal the target's)."""

    @abc.abstractmethod
    def begin(self, context: DraftContext) -> None:
        """Start a new sequence: ``context.tokens`` [L] are committed, ``context.features`` [L, F]."""

    @abc.abstractmethod
    def propose(self, step: DraftStep) -> Marginals | CandidateTree:
        """Return marginals ``[K, V]`` for depths 1..K below ``step.root_token``, or a candidate tree rooted
        at ``step.root_token``, tempered by ``step.temperature``. The root itself is NOT yet committed.
        ``step.max_depth`` (when set) is the deepest depth the pipeline can use; deeper proposals are cut."""

    @abc.abstractmethod
    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Append newly committed tokens ``[m]`` (the step's root then its accepted nodes) and the
        target features ``[m, F]`` at those positions (``None`` when ``feature_layers`` is empty)."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Drop all per-sequence state."""

    @classmethod
    def claims_checkpoint(cls, path: str | Path) -> bool:
        """Whether this drafter loads the checkpoint at ``path`` (a local directory or a hub id).

        ``Pipeline.from_pretrained(target, path)`` asks every registered drafter and creates the one
        that claims the path with ``checkpoint=path, device=..., dtype=...``. Claim only checkpoints
        you can load (look at the files, do not just accept every directory): when several drafters
        claim one path, the pipeline refuses to guess and names them. Must not raise; return False
        when the path cannot be read.
        """
        return False

    # ---------------------------------------------------------------- batches
    def fork(self) -> "Drafter":
        """A new drafter with its own (reset) per-sequence state, sharing this one's weights.

        The default deep-copies the instance while sharing every ``torch.nn.Module`` and tensor it
        holds directly; override it when per-sequence state lives elsewhere."""
        memo: dict[int, object] = {}
        for value in vars(self).values():
            if isinstance(value, (torch.nn.Module, torch.Tensor)):
                memo[id(value)] = value
        clone = copy.deepcopy(self, memo)
        clone.reset()
        return clone

    def open_batch(self, contexts: Sequence[DraftContext]) -> "DraftBatch":
        """Start a batch of sequences, one :class:`DraftContext` per row -> a
        :class:`~bastion.contract.batch_state.DraftBatch`.

        The default drives one :meth:`fork` per row through the single-sequence methods (correct for
        every drafter, one drafter call per row per step). Override it to draft every row in one
        forward (the built-in DFlash drafter does)."""
        from bastion.contract.batch_state import LoopDraftBatch

        return LoopDraftBatch(self, contexts)


class TreeBuilder(abc.ABC):
    """Turns a drafter's proposal into a verification tree whose node order keeps every prefix
    prefix-closed."""

    #: the proposal kinds :meth:`build` takes (see :data:`bastion.core.PROPOSAL_KINDS`)
    accepts: ClassVar[frozenset[str]] = frozenset({"marginals"})

    #: True when :meth:`build` returns valid trees by construction (checked by the contract kit's
    #: ``check_tree_builder``), so the pipeline need not re-validate every tree it builds. Leave False
    #: to have the pipeline validate each tree (the default for third-party builders).
    builds_valid_trees: ClassVar[bool] = False

    @abc.abstractmethod
    def build(self, marginals: Marginals | CandidateTree, root_token: int, max_nodes: int) -> Tree:
        """Return a tree of at most ``max_nodes`` nodes (root included) below ``root_token`` from the
        proposal (marginals, or a candidate tree for builders whose :attr:`accepts` lists it)."""


class LatencyModel(abc.ABC):
    """Predicts the seconds of one target forward over ``n_tokens`` tree tokens after ``context_len``
    committed tokens, and learns from measured verify times."""

    def bind(self, target: "Target") -> None:  # noqa: B027 - optional hook
        """Attach to the target whose forwards this model predicts (read its config, device and
        dtype). Called once when a pipeline is assembled; options given at construction take
        precedence over what the target says."""

    @abc.abstractmethod
    def predict(self, n_tokens: int, context_len: int) -> float:
        """Seconds for one target forward over ``n_tokens`` tokens at context length ``context_len``."""

    @abc.abstractmethod
    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        """Feed one measured verify time (online calibration)."""

    def predict_many(self, n_tokens: torch.Tensor, context_len: int) -> torch.Tensor:
        """Vectorized :meth:`predict`: ``n_tokens`` LongTensor[N] -> FloatTensor[N] seconds.
        Override for speed; the default loops over :meth:`predict`."""
        return torch.tensor([self.predict(int(n), context_len) for n in n_tokens.tolist()], dtype=torch.float64)

    def predict_batch(self, widths: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        """Seconds of one *batched* verify forward: every row of a batch with committed lengths
        ``context_lens`` [B] gets a padded block of ``widths`` [N] tree slots -> FloatTensor[N].

        The default treats the batch as one sequence of ``B * W`` tokens after the longest context;
        override it with a model of padded batched attention (the ``roofline`` model does)."""
        b = len(context_lens)
        if b == 1:
            return self.predict_many(widths, int(context_lens[0]))
        return self.predict_many(widths * b, int(max(context_lens)))

    def observe_batch(self, width: int, context_lens: Sequence[int], seconds: float) -> None:
        """Feed one measured batched verify time (defaults to :meth:`observe` for one row and to
        nothing for larger batches, which the single-sequence model cannot describe)."""
        if len(context_lens) == 1:
            self.observe(width, int(context_lens[0]), seconds)


def _as_int(value: object) -> object:
    """An integer-like ``value`` (a numpy integer, not a bool) as a Python int; anything else as is."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


@frozen
class BudgetDecision:
    """A controller's choice for one step: the tree size ``n`` and, when the controller estimates them,
    its predictions for that size (for step records and benchmarks)."""

    n: int = field(converter=lambda v: _as_int(v))  # numpy integers are ints; other types are checked where it is read
    predicted_speedup: float | None = None  # S(n), predicted speedup over plain decoding
    predicted_accept: float | None = field(default=None, kw_only=True)  # A_hat(T_n)
    predicted_cost_s: float | None = field(default=None, kw_only=True)  # C(n), seconds per step
    #: A_cal(T_n): the acceptance the controller predicted with, after calibration (None: not calibrated)
    calibrated_accept: float | None = field(default=None, kw_only=True)
    #: S(n) / S_plain: above 1 when this step was predicted to beat plain decoding (None: not estimated)
    gain: float | None = field(default=None, kw_only=True)


@frozen
class BatchStepCosts:
    """Measured seconds of a batched step outside its verify forward, at one batch size."""

    overhead_s: float  # a speculative step's non-verify seconds besides drafting
    draft_s: float  # drafting and tree building (not spent on a plain step)
    plain_s: float  # a plain step's non-verify seconds


class BudgetController(abc.ABC):
    """Chooses how many nodes of the best-first tree to verify this step, and whether to draft at all.

    Life cycle per sequence: :meth:`begin` -> repeated (:meth:`speculate`, then :meth:`decide` when it
    said yes, then :meth:`observe`). Only :meth:`choose` is required; the defaults of the others make a
    controller that always drafts and learns nothing from outcomes.

    Implement :meth:`choose`; implement :meth:`decide` too when the controller predicts the speedup of
    its choice (then ``choose`` can return ``self.decide(...).n``). The pipeline calls :meth:`decide`.
    """

    def begin(self, sampling: SamplingConfig) -> None:  # noqa: B027 - optional hook
        """A sequence starts, decoded with ``sampling`` (reset per-sequence state here)."""

    def speculate(self) -> bool:
        """Whether this step drafts (True) or is a plain target step (False). Called once per step."""
        return True

    def observe(self, outcome: StepFeedback) -> None:  # noqa: B027 - optional hook
        """What the step just verified realized (online calibration). Every speculative step is
        reported; plain steps (``outcome.drafted`` False), all alike, are reported in a sample: in
        single-sequence decoding the first of each run of plain steps and then one in 32."""

    def begin_batch(self, sampling: SamplingConfig, batch_size: int) -> None:
        """A batch of ``batch_size`` sequences starts (the default: :meth:`begin`)."""
        self.begin(sampling)

    def speculate_batch(self, context_lens: Sequence[int], latency: LatencyModel, costs: BatchStepCosts) -> bool:
        """Whether this batched step drafts, for rows with ``context_lens``; ``costs`` are the measured
        non-verify seconds of a speculative and of a plain step at this batch size. Called once per
        batched step, before :meth:`decide_width`. The default: :meth:`speculate`."""
        return self.speculate()

    @abc.abstractmethod
    def choose(
        self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float
    ) -> int:
        """``log_scores`` FloatTensor[n_max]: log rho in node order (root first). ``overhead_s``: draft
        and other non-verify seconds per step. Return n with 1 <= n <= n_max."""

    def decide(
        self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float
    ) -> BudgetDecision:
        """:meth:`choose` with its predictions, as a typed :class:`BudgetDecision` (the default wraps
        :meth:`choose` and predicts nothing)."""
        return BudgetDecision(self.choose(log_scores, context_len, latency, overhead_s))

    def speedup_estimator(self, context_len: int, latency: LatencyModel, overhead_s: float) -> SpeedupEstimator | None:
        """This controller's objective for a tree that is still being drafted, so that a drafter whose work
        grows with the tree (an autoregressive drafter's forward per depth) stops where the controller
        would: a function ``(log_scores, draft_s) -> speedup``, the speedup :meth:`decide` would predict
        for its choice among candidates of log rho ``log_scores`` (a sequence of floats, root first,
        non-increasing, as best-first orders them) at ``context_len`` when drafting took ``draft_s``
        seconds on top of ``overhead_s``. Calling it must not change the controller's state.

        The default offers none (``None``); such drafters fall back to ``DraftStep.seconds_per_token``."""
        return None

    def decide_width(
        self,
        log_scores: Sequence[torch.Tensor],
        context_lens: Sequence[int],
        latency: LatencyModel,
        overhead_s: float,
        draft_s: float,
    ) -> BudgetDecision:
        """One decision for a whole batch: ``n`` is the width W of the padded tree block every row
        verifies (row i verifies its first ``min(W, n_i)`` nodes). ``log_scores[i]`` FloatTensor[n_i]
        are row i's log rho in node order; ``overhead_s`` the per-step seconds outside the verify
        forward and drafting, ``draft_s`` the drafting seconds (not spent when drafting is skipped).

        The default takes the widest of the rows' single-sequence decisions."""
        return BudgetDecision(
            max(
                self.decide(scores, int(ctx), latency, overhead_s + draft_s).n
                for scores, ctx in zip(log_scores, context_lens, strict=True)
            )
        )


class Verifier(abc.ABC):
    """Decides which path of the tree the target accepts; must be lossless."""

    #: whether this verifier supports temperature > 0
    supports_sampling: ClassVar[bool] = True

    @abc.abstractmethod
    def verify(
        self,
        tree: Tree,
        logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> Verdict:
        """``logits`` FloatTensor[n, V]: target logits at every node (row i predicts the token after
        node i). Return the accepted root-to-node path and the bonus token."""

    def verify_batch(
        self,
        trees: Sequence[Tree],
        logits: torch.Tensor,
        sampling: Sequence[SamplingConfig],
        generators: Sequence[torch.Generator | None],
    ) -> list[Verdict]:
        """One verdict per row: ``logits`` FloatTensor[B, W, V] holds row i's node logits in
        ``[i, :len(trees[i])]`` (the rest is padding); ``sampling[i]`` and ``generators[i]`` are row
        i's sampling rule and random stream.

        The default calls :meth:`verify` row by row; override it to decide all rows with one device
        pass and one host transfer (the ``exact`` verifier does for greedy rows)."""
        return [
            self.verify(tree, logits[i, : len(tree)], sampling[i], generators[i]) for i, tree in enumerate(trees)
        ]

    def next_tokens(
        self,
        roots: Sequence[int],
        logits: torch.Tensor,
        sampling: Sequence[SamplingConfig],
        generators: Sequence[torch.Generator | None],
    ) -> list[int]:
        """A plain step: row i verified its root ``roots[i]`` alone, ``logits`` FloatTensor[B, V] are the
        target's logits after it; return each row's next token (the bonus token of a one-node tree),
        ``sampling[i]`` and ``generators[i]`` as in :meth:`verify_batch`. Plain batched steps and a single
        sequence's plain steps (B = 1) both call it; the pipeline checks each token lies in the
        vocabulary.

        The default runs :meth:`verify_batch` on one-node trees; override it to skip building B trees
        and verdicts per step (the ``exact`` verifier takes one argmax and one host transfer)."""
        device = logits.device
        trees = [Tree.from_parents(torch.tensor([int(r)], device=device), [-1]) for r in roots]
        return [v.bonus_token for v in self.verify_batch(trees, logits[:, None], sampling, generators)]


#: the one table of component kinds: kind name -> the interface its components implement (hook
#: specifications, the registry, the pipeline and the contract kit all read it)
COMPONENT_INTERFACES: Mapping[str, type] = MappingProxyType(
    {
        "drafter": Drafter,
        "tree_builder": TreeBuilder,
        "latency_model": LatencyModel,
        "budget_controller": BudgetController,
        "verifier": Verifier,
    }
)
#: the component kinds, in pipeline order
KINDS: tuple[str, ...] = tuple(COMPONENT_INTERFACES)
