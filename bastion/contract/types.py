"""Core value types that travel between the five pipeline stages.

All are ``attrs`` frozen classes. Tensor fields use ``eq=False`` so that equality stays cheap and
well-defined; compare tensors explicitly where it matters.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Literal, Sequence

import attrs
import torch
from attrs import field, frozen

from bastion.contract.errors import InvalidInputError

__all__ = [
    "Marginals",
    "SamplingConfig",
    "DraftContext",
    "DraftStep",
    "SpeedupEstimator",
    "TargetOutput",
    "Verdict",
    "StageTimings",
    "StepRecord",
    "StepOutcome",
    "StepFeedback",
    "GenerationResult",
]


@frozen
class Marginals:
    """Position-wise draft distributions for depths 1..K.

    ``log_probs[k - 1]`` is log q_k(.), normalized over the vocabulary, for the token at depth k below
    the root. Positions are treated as independent given the context.
    """

    log_probs: torch.Tensor = field(eq=False)  # [K, V] float, log-softmax per row

    def __attrs_post_init__(self) -> None:
        lp = self.log_probs
        if not isinstance(lp, torch.Tensor) or lp.dim() != 2:
            raise InvalidInputError(
                f"Marginals.log_probs must be a 2-D tensor [K, V], got "
                f"{getattr(lp, 'shape', type(lp).__name__)}"
            )
        if lp.shape[0] < 1:
            raise InvalidInputError("Marginals need at least one depth (K >= 1), got K = 0")
        if lp.shape[1] < 1:
            raise InvalidInputError("Marginals need a non-empty vocabulary (V >= 1)")
        if not lp.is_floating_point():
            raise InvalidInputError(f"Marginals.log_probs must be floating point, got {lp.dtype}")

    @classmethod
    def from_logits(cls, logits: torch.Tensor, temperature: float = 1.0, *, validate: bool = True) -> "Marginals":
        """Normalize raw logits ``[K, V]`` into per-depth log-probabilities.

        ``temperature`` divides the logits first (it must be > 0; a greedy pipeline uses 1.0).
        NaN or infinite logits are rejected with :class:`InvalidInputError` (``-inf`` entries are
        allowed as long as every row keeps at least one finite value: they mark banned tokens).
        ``validate=False`` skips that check and its host read (a decode step's drafter uses it: every
        built-in tree builder rejects NaN marginals in its own single transfer).
        """
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise InvalidInputError(
                f"logits must be a 2-D tensor [K, V], got {getattr(logits, 'shape', type(logits).__name__)}"
            )
        if logits.shape[0] < 1:
            raise InvalidInputError("logits need at least one depth (K >= 1), got K = 0")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise InvalidInputError(f"temperature must be a finite number > 0, got {temperature!r}")
        if not validate:  # in float32 from the logits' own dtype: no separate float copy at temperature 1
            if temperature == 1.0:
                return cls(torch.log_softmax(logits, dim=-1, dtype=torch.float32))
            return cls(torch.log_softmax(logits.float() / temperature, dim=-1))
        x = logits.float()
        # one reduction pass and one host transfer: amax propagates NaN, is +inf iff the row holds +inf,
        # and is -inf iff the whole row is -inf
        row_max = x.amax(dim=-1)  # [K]
        from bastion.utils.sync import to_host

        bad_nan, bad_pos, bad_neg = to_host(
            torch.stack((torch.isnan(row_max).any(), torch.isposinf(row_max).any(), torch.isneginf(row_max).any())),
            "marginals check",
        )
        if bad_nan or bad_pos:
            raise InvalidInputError("logits contain NaN or +inf values")
        if bad_neg:
            raise InvalidInputError("a row of logits is entirely -inf (no token is possible at that depth)")
        if temperature != 1.0:
            x = x / temperature
        return cls(torch.log_softmax(x, dim=-1))

    @property
    def depth(self) -> int:
        """K, the number of drafted positions."""
        return int(self.log_probs.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.log_probs.shape[1])

    def probs(self) -> torch.Tensor:  # [K, V]
        return self.log_probs.exp()


#: smallest positive sampling temperature: below it the scaled logits overflow (use 0 for greedy)
MIN_TEMPERATURE = 1e-4


def _to_temperature(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInputError(f"temperature must be a number, got {value!r} ({type(value).__name__})")
    t = float(value)
    if not (t == 0.0 or MIN_TEMPERATURE <= t < math.inf):
        raise InvalidInputError(
            f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {value!r}"
        )
    return t


def _to_top_p(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) <= 1.0:
        raise InvalidInputError(f"top_p must be a number in (0, 1], got {value!r}")
    return float(value)


def _to_top_k(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise InvalidInputError(f"top_k must be an int >= 0 (0 disables it), got {value!r} ({type(value).__name__})")
    return int(value)


@frozen
class SamplingConfig:
    """How the target's next-token distribution is turned into a sample.

    ``temperature == 0`` means greedy (argmax). ``top_k == 0`` and ``top_p == 1.0`` disable those filters.
    ``uniforms``, when set, holds one uniform in [0, 1) per row of the logits this config samples: the
    pipeline sets it per step from the seeded positional stream (:mod:`bastion.contract.sampling`), and
    :func:`bastion.contract.sampling.sample_tokens` then samples row ``i`` by inverse CDF with ``uniforms[i]``.
    """

    temperature: float = field(default=0.0, converter=_to_temperature)
    top_p: float = field(default=1.0, converter=_to_top_p)
    top_k: int = field(default=0, converter=_to_top_k)
    uniforms: torch.Tensor | None = field(default=None, eq=False, repr=False, kw_only=True)  # [n] float64

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@frozen
class DraftContext:
    """What a drafter receives once per generation, right after the target's prefill."""

    tokens: torch.Tensor = field(eq=False)  # [L] long, the prompt (all committed to the target cache)
    features: torch.Tensor | None = field(eq=False)  # [L, F] target features at those positions, or None


@frozen
class DraftStep:
    """Per-step request to a drafter: the root token and the sampling temperature of the pipeline."""

    root_token: int
    context_len: int  # tokens committed so far (the root sits at this position)
    temperature: float = 1.0  # the marginals' temperature (1.0 for greedy pipelines)
    #: deepest depth below the root the pipeline can use this step (None: no limit); deeper proposals are cut
    max_depth: int | None = None
    #: most nodes (root included) the tree builder may select this step (None: no limit)
    max_nodes: int | None = None
    #: the pipeline's running estimate of seconds per committed token (step cost / tokens per step), or
    #: None before the first step. A drafter whose cost grows with its work (an autoregressive drafter's
    #: per-depth forwards) stops when the next piece of work gains fewer tokens than its cost buys at this
    #: rate: the controller's marginal-gain-per-second rule.
    seconds_per_token: float | None = None
    #: the budget controller's own objective for a tree still being drafted (None: the controller offers
    #: none; see :meth:`BudgetController.speedup_estimator`). ``estimate_speedup(log_scores, draft_s)`` is
    #: the speedup the controller would predict for its choice among candidates of log rho ``log_scores``
    #: (root first, non-increasing) if drafting took ``draft_s`` seconds: a drafter whose work grows with
    #: the tree does the next piece only when the estimate after it beats the estimate without it.
    estimate_speedup: "SpeedupEstimator | None" = field(default=None, eq=False)


#: ``(log_scores, draft_s) -> predicted speedup``: see :attr:`DraftStep.estimate_speedup`
SpeedupEstimator = Callable[[Sequence[float], float], float]


@frozen
class TargetOutput:
    """Target forward result for a set of positions (prefill tokens or tree nodes)."""

    logits: torch.Tensor = field(eq=False)  # [n, V]
    features: torch.Tensor | None = field(default=None, eq=False)  # [n, F] concatenated layer outputs


@frozen
class Verdict:
    """What the verifier decided for one tree.

    ``accepted_nodes`` are node indices on the accepted root-to-leaf path, root (0) first; their
    tokens are now committed to the context. ``bonus_token`` is the target's own next token after the
    path (correction or bonus); it becomes the next root.
    """

    accepted_nodes: torch.Tensor = field(eq=False)  # [m] long, m = accepted + 1 (root included)
    accepted_tokens: tuple[int, ...] = field(converter=tuple)  # drafted tokens accepted (root excluded)
    bonus_token: int = field(converter=int)

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_tokens)

    @property
    def emitted(self) -> tuple[int, ...]:
        """The new tokens this step emits: accepted drafted tokens, then the bonus token."""
        return (*self.accepted_tokens, self.bonus_token)


@frozen
class StageTimings:
    """Wall seconds spent in each stage of one decode step."""

    draft: float = 0.0
    tree: float = 0.0
    controller: float = 0.0
    verify: float = 0.0  # target forward over the tree
    accept: float = 0.0  # verifier walk
    commit: float = 0.0  # KV compaction in target and drafter
    other: float = 0.0  # bookkeeping, latency-model update, emission

    @property
    def total(self) -> float:
        return self.draft + self.tree + self.controller + self.verify + self.accept + self.commit + self.other

    def as_dict(self) -> dict[str, float]:
        return attrs.asdict(self)


@frozen
class StepRecord:
    """One decode step, as recorded by the pipeline."""

    budget: int  # nodes verified, root included
    accepted: int  # drafted tokens accepted (bonus excluded)
    emitted: int  # tokens this step added to the output (accepted + 1, less if truncated by EOS/limit)
    context_len: int  # committed tokens before the step
    predicted_accept: float  # A_hat(T_n) = sum of rho over the verified tree (root included)
    predicted_speedup: float | None  # the controller's S(n) estimate, when it provides one
    timings: StageTimings
    #: the controller's calibrated prediction of tokens per step for the verified tree (None: the
    #: controller does not calibrate); compare with ``accepted + 1``, the realized value
    calibrated_accept: float | None = None
    #: False for a plain step: the target alone decoded one token, nothing was drafted
    drafted: bool = True

    batch_size: int = 1  # rows decoded together in this step (the step's timings are the batch's)
    width: int | None = None  # batched steps: the padded tree width W every row's block had

    @classmethod
    def plain(cls, context_len: int, timings: StageTimings) -> "StepRecord":
        """The record of a plain step: the target alone verified the root and emitted one token."""
        return cls(budget=1, accepted=0, emitted=1, context_len=context_len, predicted_accept=1.0,
                   predicted_speedup=None, timings=timings, drafted=False)


@frozen
class StepFeedback:
    """What a budget controller learns after each step (:meth:`BudgetController.observe`).

    For a speculative step, ``log_scores`` are the verified tree's log rho in node order (root first) and
    ``accepted_nodes`` the accepted path; a plain step verified the root alone. Seconds are wall times of
    the step: ``verify_s`` the target forward, ``overhead_s`` everything else (drafting included).
    """

    drafted: bool
    log_scores: torch.Tensor = field(eq=False)  # [n] log rho of the verified nodes, root first
    accepted_nodes: torch.Tensor = field(eq=False)  # [m] node indices of the accepted path, root first
    context_len: int
    verify_s: float
    overhead_s: float
    #: rows of the batched step this came from (a plain batched step sends one feedback for the batch,
    #: its seconds the whole step's; a speculative one sends one per row)
    batch_size: int = 1

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted (the bonus token excluded)."""
        return int(self.accepted_nodes.shape[0]) - 1


@frozen
class StepOutcome:
    """What one pipeline step returns: its record and the verifier's verdict (the accepted path and the
    next root)."""

    record: StepRecord
    verdict: Verdict


@frozen(repr=False)
class GenerationResult:
    """Result of :meth:`bastion.Pipeline.generate`.

    ``stop_reason`` is ``"eos"`` (an end-of-sequence token), ``"length"`` (``max_new_tokens``),
    ``"position-limit"`` (the target's position limit came first) or ``"stop"`` (a stop string; ``text``
    ends right before it). ``text`` is the
    decoded output when the pipeline knows a tokenizer, else None.
    """

    tokens: list[int]  # new tokens only
    steps: tuple[StepRecord, ...] = field(converter=tuple)
    prompt_len: int
    prefill_s: float
    wall_s: float
    stop_reason: Literal["eos", "length", "stop", "position-limit"]
    text: str | None = None

    def __repr__(self) -> str:
        text = "" if self.text is None else f", text={_shorten(self.text)!r}"
        return (
            f"GenerationResult(tokens={len(self.tokens)}, steps={len(self.steps)}, "
            f"acceptance_length={self.acceptance_length:.2f}, stop_reason={self.stop_reason!r}{text})"
        )

    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per decode step (accepted drafted tokens + 1)."""
        if not self.steps:
            return 0.0
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps)

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_budget(self) -> float:
        return sum(s.budget for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def drafted_share(self) -> float:
        """Share of decode steps that drafted (the rest were plain target steps)."""
        return sum(1 for s in self.steps if s.drafted) / len(self.steps) if self.steps else 0.0


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
