"""The five pluggable stage interfaces of a bastion pipeline.

Every interface is **batch-first**: the engine decodes a batch of running requests, and a single
sequence is a batch of one, so each stage has one set of methods that the engine calls, taking one entry
per row:

============== ======================================== ===============================================
stage          the engine calls                          single-sequence adapters (kept for existing code)
============== ======================================== ===============================================
drafter        ``open_batch`` -> :class:`DraftBatch`     ``begin``, ``propose``, ``commit``
tree builder   ``build`` (one row's tree)                --
latency model  ``predict_batch``, ``observe_batch``      ``predict``, ``predict_many``, ``observe``
controller     ``begin_batch``, ``speculate_batch``,     ``begin``, ``speculate``, ``choose``,
               ``decide_width``, ``observe``             ``decide``
verifier       ``verify_batch`` (``next_tokens``)        ``verify``
============== ======================================== ===============================================

Implement either side of each row: a component written against the batch-first methods answers the
single-sequence calls through thin adapters (a batch of one), and a component written against the
single-sequence methods (every plugin written before the engine was batch-first) is driven row by row by
the batch-first defaults. A class that implements neither side cannot be instantiated (``TypeError``
naming what to implement). Built-in components implement the batch-first methods, with a fast path for
a batch of one.

Signatures are fixed: optional per-call context travels inside typed objects (``DraftStep``,
``SamplingConfig``), never as extra positional arguments on a subclass. Implementations register through
the ``bastion_register_components`` hook (see :mod:`bastion.contract.hookspecs`).
"""

from __future__ import annotations

import abc
import copy
import functools
import numbers
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Mapping, Sequence

import torch
from attrs import field, frozen

from bastion.contract.candidates import CandidateTree
from bastion.contract.errors import InvalidInputError
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


def overrides(component: object, method: str, interface: type) -> bool:
    """Whether ``component`` (an instance or a class) implements ``method`` itself rather than
    inheriting ``interface``'s default (how the adapters pick their direction)."""
    cls = component if isinstance(component, type) else type(component)
    return getattr(cls, method, None) is not getattr(interface, method)


@functools.lru_cache(maxsize=None)
def _nearer(cls: type, single: str, batch: str) -> bool:
    for k in cls.__mro__:
        if batch in vars(k):
            return False
        if single in vars(k):
            return True
    return False


def single_is_nearer(component: object, single: str, batch: str) -> bool:
    """Whether ``component``'s class defines the single-sequence method ``single`` nearer in its MRO
    than the batch-first ``batch``: a subclass of a batch-first component that overrides only the
    single-sequence method, whose batch calls must then go through that method."""
    return _nearer(type(component), single, batch)


class _BatchFirst(abc.ABC):
    """What every stage interface shares: an instance needs one way of implementing each of its
    operations (``_IMPLEMENT``: per operation, the alternatives, each a set of method names; the
    batch-first method first)."""

    _IMPLEMENT: ClassVar[tuple[tuple[tuple[str, ...], ...], ...]] = ()

    def __new__(cls, *args: object, **kwargs: object) -> "_BatchFirst":
        interface = next(k for k in cls.__mro__ if "_IMPLEMENT" in vars(k))
        for ways in interface._IMPLEMENT:
            if not any(all(overrides(cls, m, interface) for m in way) for way in ways):
                options = " or ".join(" + ".join(way) for way in ways)
                raise TypeError(f"Can't instantiate {interface.__name__} {cls.__name__}: implement {options}")
        return super().__new__(cls)


class Drafter(_BatchFirst):
    """Proposes the tokens after the root, in one call per step: position-wise :class:`Marginals` (block
    drafters) or a :class:`CandidateTree` with per-node conditional log-probabilities (autoregressive
    drafters).

    Batch-first: :meth:`open_batch` starts a :class:`~bastion.contract.batch_state.DraftBatch` for the
    rows of a batch (one proposal per row per step, rows join and leave). Or implement the
    single-sequence methods :meth:`begin` (after prefill) -> repeated (:meth:`propose`, :meth:`commit`),
    and the default :meth:`open_batch` drives one :meth:`fork` per row through them. :meth:`bind` is
    called once per pipeline either way.
    """

    _IMPLEMENT = ((("open_batch",), ("begin", "propose", "commit")),)

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

    def begin(self, context: DraftContext) -> None:
        """Start a new sequence: ``context.tokens`` [L] are committed, ``context.features`` [L, F].

        Single-sequence method; for a batch-first drafter it opens a batch of one."""
        self._solo_rows = self.open_batch([context])

    def propose(self, step: DraftStep) -> Marginals | CandidateTree:
        """Return marginals ``[K, V]`` for depths 1..K below ``step.root_token``, or a candidate tree rooted
        at ``step.root_token``, tempered by ``step.temperature``. The root itself is NOT yet committed.
        ``step.max_depth`` (when set) is the deepest depth the pipeline can use; deeper proposals are cut.

        Single-sequence method; for a batch-first drafter the proposal of its batch of one."""
        return self._solo_batch("propose").propose([step])[0]

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Append newly committed tokens ``[m]`` (the step's root then its accepted nodes) and the
        target features ``[m, F]`` at those positions (``None`` when ``feature_layers`` is empty).

        Single-sequence method; for a batch-first drafter a commit to its batch of one."""
        self._solo_batch("commit").commit([tokens], [features])

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Drop all per-sequence state (the default drops a batch-first drafter's batch of one)."""
        self.__dict__.pop("_solo_rows", None)

    def _solo_batch(self, method: str) -> "DraftBatch":
        rows = self.__dict__.get("_solo_rows")
        if rows is None:
            raise InvalidInputError(f"{type(self).__name__}.{method}() before begin(): start the sequence first")
        return rows

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
        :class:`~bastion.contract.batch_state.DraftBatch` (the batch-first method).

        The default drives one :meth:`fork` per row through the single-sequence methods (correct for
        every drafter that implements them, one drafter call per row per step). Override it to draft
        every row in one forward (the built-in DFlash drafter does)."""
        from bastion.contract.batch_state import LoopDraftBatch

        return LoopDraftBatch(self, contexts)


class TreeBuilder(_BatchFirst):
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


class LatencyModel(_BatchFirst):
    """Predicts the seconds of one target forward over a batch's tree tokens, and learns from measured
    verify times.

    Batch-first: :meth:`predict_batch` and :meth:`observe_batch` (a single sequence is a batch of one
    row). Or implement the single-sequence :meth:`predict` (or :meth:`predict_many`) and
    :meth:`observe`: a batch of B rows is then priced as one sequence of ``B * W`` tokens after the
    longest context, and batched timings are not learnt."""

    _IMPLEMENT = ((("predict_batch",), ("predict_many",), ("predict",)), (("observe_batch",), ("observe",)))

    def bind(self, target: "Target") -> None:  # noqa: B027 - optional hook
        """Attach to the target whose forwards this model predicts (read its config, device and
        dtype). Called once when a pipeline is assembled; options given at construction take
        precedence over what the target says."""

    def predict_batch(self, widths: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        """Seconds of one verify forward where every row of a batch with committed lengths
        ``context_lens`` [B] gets a padded block of ``widths`` [N] tree slots -> FloatTensor[N]
        (a single sequence: ``context_lens`` of one entry, ``widths`` its candidate tree sizes).

        The default, for single-sequence models, treats the batch as one sequence of ``B * W`` tokens
        after the longest context; override it with a model of padded batched attention (the
        ``roofline`` model does)."""
        b = len(context_lens)
        if b == 1:
            return self.predict_many(widths, int(context_lens[0]))
        return self.predict_many(widths * b, int(max(context_lens)))

    def observe_batch(self, width: int, context_lens: Sequence[int], seconds: float) -> None:
        """Feed one measured verify time of a batch of ``len(context_lens)`` rows at ``width`` tree
        slots each (online calibration). The default, for single-sequence models: :meth:`observe` for
        one row, nothing for larger batches (which such a model cannot describe)."""
        if len(context_lens) == 1:
            self.observe(width, int(context_lens[0]), seconds)

    def predict(self, n_tokens: int, context_len: int) -> float:
        """Seconds for one target forward over ``n_tokens`` tokens at context length ``context_len``
        (single-sequence adapter: :meth:`predict_many` of one size)."""
        return float(self.predict_many(torch.tensor([int(n_tokens)]), context_len)[0])

    def predict_many(self, n_tokens: torch.Tensor, context_len: int) -> torch.Tensor:
        """Vectorized :meth:`predict`: ``n_tokens`` LongTensor[N] -> FloatTensor[N] seconds
        (single-sequence adapter: :meth:`predict_batch` of one row, or a loop over :meth:`predict`)."""
        if overrides(self, "predict_batch", LatencyModel):
            return self.predict_batch(n_tokens, [int(context_len)])
        return torch.tensor([self.predict(int(n), context_len) for n in n_tokens.tolist()], dtype=torch.float64)

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        """Feed one measured single-sequence verify time (adapter: :meth:`observe_batch` of one row)."""
        if overrides(self, "observe_batch", LatencyModel):
            self.observe_batch(int(n_tokens), [int(context_len)], seconds)


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
    #: measured plain steps ``plain_s`` rests on at this batch size (0: extrapolated from other sizes; None: not counted)
    plain_steps: int | None = None


class BudgetController(_BatchFirst):
    """Chooses how many nodes of the best-first trees to verify this step, and whether to draft at all.

    Batch-first life cycle (what the engine calls; a single sequence is a batch of one row):
    :meth:`begin_batch` (a batch starts or changes size) -> repeated (:meth:`speculate_batch`, then
    :meth:`decide_width` when it said yes, then :meth:`observe` once per row). Only :meth:`decide_width`
    is required; the defaults of the others make a controller that always drafts and learns nothing.

    Controllers written against the single-sequence methods keep working: implement :meth:`choose` (or
    :meth:`decide`, when the controller predicts the speedup of its choice) and optionally :meth:`begin`
    and :meth:`speculate`; the batch-first defaults call them (a batch's width is then the widest of its
    rows' choices).
    """

    _IMPLEMENT = ((("decide_width",), ("decide",), ("choose",)),)

    def begin(self, sampling: SamplingConfig) -> None:  # noqa: B027 - optional hook
        """A sequence starts, decoded with ``sampling`` (single-sequence hook; for a batch-first
        controller :meth:`begin_batch` of one row)."""
        if overrides(self, "begin_batch", BudgetController):
            self.begin_batch(sampling, 1)

    def speculate(self) -> bool:
        """Whether this step drafts (True) or is a plain target step (False): the single-sequence hook
        the default :meth:`speculate_batch` asks."""
        return True

    def observe(self, outcome: StepFeedback) -> None:  # noqa: B027 - optional hook
        """What the step just verified realized (online calibration). Every speculative step is
        reported; plain steps (``outcome.drafted`` False), all alike, are reported in a sample: in
        single-sequence decoding the first of each run of plain steps and then one in 32."""

    def begin_batch(self, sampling: SamplingConfig, batch_size: int) -> None:
        """A batch of ``batch_size`` sequences starts, or the running batch changed size (rows joined
        or left); ``sampling`` is its first row's rule. The default: :meth:`begin`."""
        if overrides(self, "begin", BudgetController):
            self.begin(sampling)

    def speculate_batch(self, context_lens: Sequence[int], latency: LatencyModel, costs: BatchStepCosts) -> bool:
        """Whether this step drafts, for rows with ``context_lens`` (one entry: a single sequence);
        ``costs`` are the measured non-verify seconds of a speculative and of a plain step at this
        batch size. Called once per step, before :meth:`decide_width`. The default: :meth:`speculate`."""
        return self.speculate()

    def choose(
        self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float
    ) -> int:
        """Single-sequence choice: ``log_scores`` FloatTensor[n_max] log rho in node order (root first),
        ``overhead_s`` the draft and other non-verify seconds per step -> n with 1 <= n <= n_max
        (the default: :meth:`decide`'s n)."""
        return self.decide(log_scores, context_len, latency, overhead_s).n

    def decide(
        self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float
    ) -> BudgetDecision:
        """:meth:`choose` with its predictions, as a typed :class:`BudgetDecision` (the default wraps
        :meth:`choose`, or asks :meth:`decide_width` for a batch of one row)."""
        if overrides(self, "choose", BudgetController):
            return BudgetDecision(self.choose(log_scores, context_len, latency, overhead_s))
        return self.decide_width([log_scores], [context_len], latency, overhead_s, 0.0)

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
        """One decision for the step: ``n`` is the width W of the padded tree block every row verifies
        (row i verifies its first ``min(W, n_i)`` nodes; a single sequence: its tree size).
        ``log_scores[i]`` FloatTensor[n_i] are row i's log rho in node order (root first);
        ``overhead_s`` the per-step seconds outside the verify forward and drafting, ``draft_s`` the
        drafting seconds (not spent when drafting is skipped). Return 1 <= n <= max n_i.

        The default, for single-sequence controllers: :meth:`decide` for one row, else the widest of
        the rows' decisions."""
        if len(log_scores) == 1:
            return self.decide(log_scores[0], int(context_lens[0]), latency, overhead_s + draft_s)
        return BudgetDecision(
            max(
                self.decide(scores, int(ctx), latency, overhead_s + draft_s).n
                for scores, ctx in zip(log_scores, context_lens, strict=True)
            )
        )


class Verifier(_BatchFirst):
    """Decides which path of each row's tree the target accepts; must be lossless.

    Batch-first: :meth:`verify_batch` (a single sequence is a batch of one row) and, optionally,
    :meth:`next_tokens` for plain steps. Or implement the single-sequence :meth:`verify`, and the
    defaults verify row by row."""

    _IMPLEMENT = ((("verify_batch",), ("verify",)),)

    #: whether this verifier supports temperature > 0
    supports_sampling: ClassVar[bool] = True

    def verify(
        self,
        tree: Tree,
        logits: torch.Tensor,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> Verdict:
        """``logits`` FloatTensor[n, V]: target logits at every node (row i predicts the token after
        node i). Return the accepted root-to-node path and the bonus token (single-sequence adapter:
        :meth:`verify_batch` of one row)."""
        check_node_logits(tree, logits)
        return self.verify_batch([tree], logits[None], [sampling], [generator])[0]

    def verify_batch(
        self,
        trees: Sequence[Tree],
        logits: torch.Tensor,
        sampling: Sequence[SamplingConfig],
        generators: Sequence[torch.Generator | None],
    ) -> list[Verdict]:
        """One verdict per row: ``logits`` FloatTensor[B, W, V] holds row i's node logits in
        ``[i, :len(trees[i])]`` (the rest is padding); ``sampling[i]`` and ``generators[i]`` are row
        i's sampling rule and random stream. Logits of another batch size, or with fewer slots than
        the largest tree, raise :class:`~bastion.contract.errors.InvalidInputError`.

        The default, for single-sequence verifiers, calls :meth:`verify` row by row; override it to
        decide all rows with one device pass and one host transfer (the ``exact`` verifier does for
        greedy rows)."""
        check_batch_logits(trees, logits)
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


def check_node_logits(tree: Tree, logits: object) -> None:
    """Raise :class:`~bastion.contract.errors.InvalidInputError` unless ``logits`` is a tensor [n, V]
    with one row per node of ``tree``."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(tree):
        raise InvalidInputError(
            f"logits must be a tensor [n, V] with one row per tree node (n = {len(tree)}), "
            f"got {getattr(logits, 'shape', type(logits).__name__)}"
        )


def check_batch_logits(trees: Sequence[Tree], logits: object) -> None:
    """Raise :class:`~bastion.contract.errors.InvalidInputError` unless ``logits`` is a tensor
    [B, W, V] with one row per tree and at least as many slots as the largest tree."""
    if (
        not isinstance(logits, torch.Tensor)
        or logits.dim() != 3
        or logits.shape[0] != len(trees)
        or (trees and logits.shape[1] < max(len(t) for t in trees))
    ):
        raise InvalidInputError(
            f"logits must be [B, W, V] with B = {len(trees)} rows and W >= the largest tree, "
            f"got {getattr(logits, 'shape', type(logits).__name__)}"
        )


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
