"""Online calibration of the acceptance surrogate: from a node's path score rho to how often it is accepted.

Under the surrogate, node ``i`` of a verified tree lies on the accepted path with probability ``rho_i``
(the product of the drafter's probabilities along its path), so ``A_hat = sum_i rho_i``. A drafter whose
probabilities are over-confident (a weak drafter, sampling at T > 0) makes ``A_hat`` predict several
accepted tokens where a fraction of one is realized. :class:`AcceptanceCalibrator` learns, from what
verification realizes, a mapping ``g(rho)`` = the observed rate at which nodes with score ``rho`` are
accepted, and the controller predicts with ``A_cal(T_n) = 1 + sum_{0 < i < n} g(rho_i)``.

- **Bins** on ``logit(rho) = log(rho / (1 - rho))``: ``bins`` equal bins over ``logit_range`` (scores
  outside go to the end bins), fine both for long shots (rho near 0) and for sure tokens (rho near 1).
  Each keeps recency-weighted sums of nodes seen, nodes accepted and their raw scores.
- **Recency**: every observed step multiplies the sums by ``0.5 ** (1 / half_life)``, so a step
  ``half_life`` steps old counts half.
- **Prior**: each bin is shrunk towards its raw mean score times the pooled ratio of realized to claimed
  acceptance over all bins (that ratio itself starts at 1), with ``prior_weight`` pseudo-nodes; so a
  drafter that over-claims everywhere is corrected everywhere after a step or two, and each bin then
  moves to its own observed rate as data accrue.
- **Monotone**: the rates of the bins that have seen nodes are made non-decreasing in ``rho`` by
  weighted pool-adjacent-violators, then interpolated linearly in ``logit(rho)`` between their centres
  (beyond the outermost seen bins, the raw score times that bin's correction factor, capped so that
  the map stays monotone). A non-decreasing ``g`` keeps the
  best-first node order (non-increasing ``rho``) non-increasing in ``g``, so every prefix of the tree is
  still the best tree of its size under the calibrated surrogate and ``A_cal(T_n)`` stays concave in n.
- **Per sampling setting**: one table per ``(temperature, top_p, top_k)``: acceptance at T = 1 says
  little about acceptance at T = 0.

Everything is deterministic given the same observations (no randomness, no clock).
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np
from attrs import frozen

from bastion.utils.checks import check_int, check_number
from bastion.contract.errors import InvalidInputError
from bastion.contract.types import SamplingConfig

__all__ = ["AcceptanceCalibrator", "CalibrationTable", "sampling_key"]

SamplingKey = tuple[float, float, int]

#: a bin whose recency-weighted node count is below this has not been seen (it only holds the prior)
_SEEN = 1e-3


def sampling_key(sampling: SamplingConfig) -> SamplingKey:
    """The calibration table a sampling setting uses (greedy decoding is ``(0.0, 1.0, 0)``)."""
    if sampling.greedy:
        return (0.0, 1.0, 0)
    return (round(sampling.temperature, 4), round(sampling.top_p, 4), int(sampling.top_k))


def _factor(rate: float, raw: float) -> float:
    """A bin's correction factor (calibrated rate over its mean raw score), 1 where the raw mean is 0."""
    return float(rate / raw) if raw > 0 else 1.0


def _pava(values: list[float], weights: list[float]) -> list[float]:
    """Weighted isotonic (non-decreasing) regression of ``values`` [B] by pool-adjacent-violators."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            total = w1 + w2
            blocks[-1] = [(v1 * w1 + v2 * w2) / total, total, c1 + c2]
    return [b[0] for b in blocks for _ in range(int(b[2]))]


def _logit(log_rho: float) -> float:
    """logit(rho) from log rho; rho = 1 gives a large finite value (-expm1 of a negative number is in
    (0, 1], so the log never sees 0)."""
    return log_rho - math.log(-math.expm1(log_rho if log_rho < -1e-300 else -1e-300))


@frozen
class CalibrationTable:
    """A snapshot of one sampling setting's mapping over the bins that have seen nodes."""

    centers: tuple[float, ...]  # bin centres in logit(rho), ascending
    rates: tuple[float, ...]  # calibrated acceptance rate g at each centre (non-decreasing)
    raw: tuple[float, ...]  # mean raw rho of the nodes seen in each bin
    nodes: tuple[float, ...]  # recency-weighted node count per bin


class _Map:
    """The fitted mapping of one table: rates at the seen bins' centres, with what reading it needs."""

    def __init__(self, xs: list[float], ys: list[float], raw: list[float]) -> None:
        self.xs, self.ys, self.raw = xs, ys, raw  # each [S], xs ascending, ys non-decreasing
        self.slopes = [(ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) for j in range(len(xs) - 1)]  # [S - 1]
        self.low_factor = _factor(ys[0], raw[0])  # below the seen bins
        self.high_factor = _factor(ys[-1], raw[-1])  # above them


class _Table:
    """Recency-weighted per-bin sums for one sampling setting (plain floats: a step touches a few dozen
    numbers, where each NumPy call would cost more than the arithmetic)."""

    def __init__(self, bins: int) -> None:
        self.count = [0.0] * bins  # [B] nodes seen
        self.hits = [0.0] * bins  # [B] nodes accepted
        self.score = [0.0] * bins  # [B] sum of raw rho
        self.rates: _Map | None = None  # the fitted map, None before any node was seen
        self.steps = 0
        self.recent: list[tuple[float, float]] = []  # last steps' (accepted - predicted, predicted variance)
        self.shifts = 0  # workload shifts detected (the table then forgot most of its past)


class AcceptanceCalibrator:
    """Maps raw path scores to calibrated acceptance probabilities, learnt from verification outcomes.

    Parameters
    ----------
    bins:
        Number of equal-width bins on ``logit(rho)`` over ``logit_range``.
    logit_range:
        The binned range of ``logit(rho)`` (scores outside fall into the end bins).
    half_life:
        Steps after which an observation counts half (recency weighting).
    prior_weight:
        Pseudo-nodes per bin at the raw score (how much data it takes to move away from the surrogate).
    shift_window, shift_sigmas, shift_keep:
        Workload shifts: when the accepted nodes of the last ``shift_window`` steps depart from the
        table's prediction by more than ``shift_sigmas`` standard deviations (plus one node), the table
        keeps only ``shift_keep`` of its past weight, so it follows the new acceptance within about
        ``shift_window`` + a few steps (``shift_window=0``: only the half-life forgets).

    The per-step work (:meth:`observe`, :meth:`calibrate_values`) runs on plain Python floats: a step
    touches at most a few dozen nodes and bins, where each NumPy call costs more than its arithmetic
    (about ten times more when a target forward has just evicted NumPy's code from the CPU caches).
    """

    def __init__(
        self,
        *,
        bins: int = 24,
        logit_range: tuple[float, float] = (-12.0, 6.0),
        half_life: float = 128.0,
        prior_weight: float = 2.0,
        shift_window: int = 8,
        shift_sigmas: float = 3.0,
        shift_keep: float = 0.1,
    ) -> None:
        bins = check_int("bins", bins, low=2)
        lo, hi = (check_number("logit_range", x, low=-math.inf) for x in logit_range)
        if not lo < hi:
            raise InvalidInputError(f"logit_range must be two finite numbers, low < high, got {logit_range!r}")
        half_life = check_number("half_life", half_life, strict=True)
        prior_weight = check_number("prior_weight", prior_weight, strict=True)
        self.shift_window = check_int("shift_window", shift_window, low=0)  # 0: never detect a shift
        self.shift_sigmas = check_number("shift_sigmas", shift_sigmas, strict=True)
        self.shift_keep = check_number("shift_keep", shift_keep, low=0.0)
        self.bins = bins
        self.logit_range = (float(lo), float(hi))
        self.half_life = float(half_life)
        self.prior_weight = float(prior_weight)
        self._decay = 0.5 ** (1.0 / self.half_life)
        self._width = (self.logit_range[1] - self.logit_range[0]) / bins
        self._centers = [self.logit_range[0] + self._width * (i + 0.5) for i in range(bins)]  # [B] logit(rho)
        self._tables: dict[SamplingKey, _Table] = {}

    # ------------------------------------------------------------------ use
    def calibrate(self, log_scores: np.ndarray, key: SamplingKey) -> np.ndarray:
        """Calibrated acceptance probabilities [n] of nodes with raw ``log_scores`` [n] (float64 array,
        log rho; pass the nodes below the root). Returns ``exp(log_scores)`` while this setting has seen
        no step."""
        return np.array(self.calibrate_values(np.asarray(log_scores, dtype=np.float64).tolist(), key), dtype=np.float64)

    def calibrate_values(self, log_scores: Sequence[float], key: SamplingKey) -> list[float]:
        """:meth:`calibrate` on a sequence of floats, returning a list."""
        table = self._tables.get(key)
        if table is None or table.rates is None:
            return [math.exp(v) for v in log_scores]
        m = table.rates
        xs, ys, slopes = m.xs, m.ys, m.slopes
        first, last, top = xs[0], xs[-1], len(xs) - 1
        exp, bisect_right = math.exp, bisect.bisect_right
        out = []
        for v in log_scores:
            z = _logit(v)  # unclipped: the seen bins' centres lie inside the binned range
            if z < first:  # below the seen bins: the nearest seen bin's correction, capped to stay monotone
                g = exp(v) * m.low_factor
                out.append(g if g < ys[0] else ys[0])
            elif z > last:  # above them (a bin whose scores all underflowed to 0 has no factor: 1)
                g = exp(v) * m.high_factor
                out.append(ys[-1] if g < ys[-1] else (g if g < 1.0 else 1.0))
            else:  # linear in logit(rho) between the seen bins' centres
                j = bisect_right(xs, z) - 1  # xs[j] <= z
                out.append(ys[j] if j == top else slopes[j] * (z - xs[j]) + ys[j])
        return out

    def observe(self, log_scores: np.ndarray, accepted: np.ndarray, key: SamplingKey) -> None:
        """One verified step: ``log_scores`` [n] of the verified nodes below the root and ``accepted``
        [n] (bool) whether each lies on the accepted path."""
        if log_scores.shape != accepted.shape or log_scores.ndim != 1:
            raise InvalidInputError(f"log_scores {log_scores.shape} and accepted {accepted.shape} must be equal 1-D shapes")
        self.observe_values(log_scores.tolist(), accepted.tolist(), key)

    def observe_values(self, log_scores: Sequence[float], accepted: Sequence[bool], key: SamplingKey) -> None:
        """:meth:`observe` on two equal-length sequences (floats, and bools)."""
        if len(log_scores) != len(accepted):
            raise InvalidInputError(f"{len(log_scores)} log_scores but {len(accepted)} accepted flags")
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _Table(self.bins)
        decay = self._decay
        if self.shift_window and table.rates is not None and log_scores:
            decay *= self._shift_factor(table, log_scores, accepted, key)
        count = table.count = [c * decay for c in table.count]
        hits = table.hits = [h * decay for h in table.hits]
        score = table.score = [x * decay for x in table.score]
        table.steps += 1
        (lo, hi), width, top = self.logit_range, self._width, self.bins - 1
        exp = math.exp
        for v, hit in zip(log_scores, accepted):
            z = _logit(v)  # the end bins take everything outside the binned range
            i = int(((z if z < hi else hi) - lo) // width) if z > lo else 0
            i = top if i > top else i
            count[i] += 1.0
            score[i] += exp(v)
            if hit:
                hits[i] += 1.0
        table.rates = self._fit(table)

    def _shift_factor(self, table: _Table, log_scores: Sequence[float], accepted: Sequence[bool], key: SamplingKey) -> float:
        """1.0, or ``shift_keep`` when the acceptance of the last ``shift_window`` steps departs from what
        the table predicts by more than ``shift_sigmas`` standard deviations (the workload changed: a
        new prompt domain, a chat template or none): the table then forgets most of its past at once and
        learns the new acceptance within a few steps, instead of over its half-life."""
        rates = self.calibrate_values(log_scores, key)
        predicted = math.fsum(rates)
        variance = math.fsum(g * (1.0 - g) for g in rates)
        table.recent.append((float(sum(bool(a) for a in accepted)) - predicted, variance))
        if len(table.recent) > self.shift_window:
            del table.recent[0]
        if len(table.recent) < self.shift_window:
            return 1.0
        gap = math.fsum(r for r, _ in table.recent)
        spread = math.sqrt(math.fsum(v for _, v in table.recent)) + 1.0
        if abs(gap) <= self.shift_sigmas * spread:
            return 1.0
        table.recent = []
        table.shifts += 1
        return self.shift_keep

    def shifts(self, key: SamplingKey) -> int:
        """Workload shifts detected for a sampling setting."""
        t = self._tables.get(key)
        return 0 if t is None else t.shifts

    def table(self, key: SamplingKey) -> CalibrationTable | None:
        """The current mapping for a sampling setting (None before its first observed step)."""
        t = self._tables.get(key)
        if t is None or t.rates is None:
            return None
        seen = [i for i, c in enumerate(t.count) if c > _SEEN]
        return CalibrationTable(
            centers=tuple(t.rates.xs),
            rates=tuple(t.rates.ys),
            raw=tuple(t.rates.raw),
            nodes=tuple(t.count[i] for i in seen),
        )

    def reset(self) -> None:
        """Forget every observation."""
        self._tables.clear()

    # ------------------------------------------------------------------ internals
    def _fit(self, t: _Table) -> _Map | None:
        """The monotone rates at the centres of the bins that have seen nodes; None when none has."""
        seen = [i for i, c in enumerate(t.count) if c > _SEEN]
        if not seen:
            return None
        w0 = self.prior_weight
        raw = [t.score[i] / t.count[i] for i in seen]  # mean raw rho per seen bin
        # pooled over all bins: how much of the claimed mass is realized (itself shrunk towards 1)
        ratio = (math.fsum(t.hits) + w0) / (math.fsum(t.score) + w0)
        weights = [t.count[i] + w0 for i in seen]
        # each bin shrunk towards the pooled prior
        rates = [(t.hits[i] + w0 * min(1.0, r * ratio)) / w for i, r, w in zip(seen, raw, weights)]
        monotone = [min(max(g, 0.0), 1.0) for g in _pava(rates, weights)]
        return _Map([self._centers[i] for i in seen], monotone, raw)

    def __repr__(self) -> str:
        return (
            f"AcceptanceCalibrator(bins={self.bins}, logit_range={self.logit_range}, half_life={self.half_life}, "
            f"prior_weight={self.prior_weight})"
        )
