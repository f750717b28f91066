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

import math

import numpy as np
from attrs import frozen

from bastion.core.checks import check_int, check_number
from bastion.core.errors import InvalidInputError
from bastion.core.types import SamplingConfig

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


def _pava(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression of ``values`` [B] by pool-adjacent-violators."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            total = w1 + w2
            blocks[-1] = [(v1 * w1 + v2 * w2) / total, total, c1 + c2]
    return np.repeat([b[0] for b in blocks], [b[2] for b in blocks])


@frozen
class CalibrationTable:
    """A snapshot of one sampling setting's mapping over the bins that have seen nodes."""

    centers: tuple[float, ...]  # bin centres in logit(rho), ascending
    rates: tuple[float, ...]  # calibrated acceptance rate g at each centre (non-decreasing)
    raw: tuple[float, ...]  # mean raw rho of the nodes seen in each bin
    nodes: tuple[float, ...]  # recency-weighted node count per bin


class _Table:
    """Recency-weighted per-bin sums for one sampling setting."""

    def __init__(self, bins: int) -> None:
        self.count = np.zeros(bins)  # [B] nodes seen
        self.hits = np.zeros(bins)  # [B] nodes accepted
        self.score = np.zeros(bins)  # [B] sum of raw rho
        # (centres, g, mean raw rho) of the seen bins, or None before any node was seen
        self.rates: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.steps = 0


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
    """

    def __init__(
        self,
        *,
        bins: int = 24,
        logit_range: tuple[float, float] = (-12.0, 6.0),
        half_life: float = 128.0,
        prior_weight: float = 2.0,
    ) -> None:
        bins = check_int("bins", bins, low=2)
        lo, hi = (check_number("logit_range", x, low=-math.inf) for x in logit_range)
        if not lo < hi:
            raise InvalidInputError(f"logit_range must be two finite numbers, low < high, got {logit_range!r}")
        half_life = check_number("half_life", half_life, strict=True)
        prior_weight = check_number("prior_weight", prior_weight, strict=True)
        self.bins = bins
        self.logit_range = (lo, hi)
        self.half_life = float(half_life)
        self.prior_weight = float(prior_weight)
        self._decay = 0.5 ** (1.0 / self.half_life)
        self._width = (hi - lo) / bins
        self._centers = lo + self._width * (np.arange(bins) + 0.5)  # [B] logit(rho)
        self._tables: dict[SamplingKey, _Table] = {}

    # ------------------------------------------------------------------ use
    def calibrate(self, log_scores: np.ndarray, key: SamplingKey) -> np.ndarray:
        """Calibrated acceptance probabilities [n] of nodes with raw ``log_scores`` [n] (float64 array,
        log rho; pass the nodes below the root). Returns ``exp(log_scores)`` while this setting has seen
        no step."""
        table = self._tables.get(key)
        if table is None or table.rates is None:
            return np.exp(log_scores)
        xs, ys, raw = table.rates
        z = self._logit(log_scores)
        out = np.interp(z, xs, ys)
        # beyond the seen bins: the nearest seen bin's correction factor, capped to stay monotone (a bin
        # whose scores all underflowed to rho = 0 has no factor: the raw score is used as it is)
        below, above = z < xs[0], z > xs[-1]
        if below.any():
            out[below] = np.minimum(np.exp(log_scores[below]) * _factor(ys[0], raw[0]), ys[0])
        if above.any():
            out[above] = np.clip(np.exp(log_scores[above]) * _factor(ys[-1], raw[-1]), ys[-1], 1.0)
        return out

    def observe(self, log_scores: np.ndarray, accepted: np.ndarray, key: SamplingKey) -> None:
        """One verified step: ``log_scores`` [n] of the verified nodes below the root and ``accepted``
        [n] (bool) whether each lies on the accepted path."""
        if log_scores.shape != accepted.shape or log_scores.ndim != 1:
            raise InvalidInputError(f"log_scores {log_scores.shape} and accepted {accepted.shape} must be equal 1-D shapes")
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = _Table(self.bins)
        table.count *= self._decay
        table.hits *= self._decay
        table.score *= self._decay
        table.steps += 1
        if log_scores.size:
            idx = self._bin(log_scores)
            table.count += np.bincount(idx, minlength=self.bins)
            table.hits += np.bincount(idx, weights=accepted.astype(np.float64), minlength=self.bins)
            table.score += np.bincount(idx, weights=np.exp(log_scores), minlength=self.bins)
        table.rates = self._fit(table)

    def table(self, key: SamplingKey) -> CalibrationTable | None:
        """The current mapping for a sampling setting (None before its first observed step)."""
        t = self._tables.get(key)
        if t is None or t.rates is None:
            return None
        seen = t.count > _SEEN
        return CalibrationTable(
            centers=tuple(t.rates[0].tolist()),
            rates=tuple(t.rates[1].tolist()),
            raw=tuple(self._prior_rho(t)[seen].tolist()),
            nodes=tuple(t.count[seen].tolist()),
        )

    def reset(self) -> None:
        """Forget every observation."""
        self._tables.clear()

    # ------------------------------------------------------------------ internals
    def _logit(self, log_scores: np.ndarray) -> np.ndarray:
        """logit(rho) [n] from log rho [n], clipped to the binned range (rho = 1 maps to its top)."""
        lo, hi = self.logit_range
        with np.errstate(divide="ignore"):
            z = log_scores - np.log(-np.expm1(np.minimum(log_scores, 0.0)))
        return np.clip(z, lo, hi)

    def _bin(self, log_scores: np.ndarray) -> np.ndarray:
        idx = np.floor((self._logit(log_scores) - self.logit_range[0]) / self._width).astype(np.int64)
        return np.clip(idx, 0, self.bins - 1)

    def _prior_rho(self, t: _Table) -> np.ndarray:
        centre_rho = 1.0 / (1.0 + np.exp(-self._centers))
        seen = t.count > 1e-9
        return np.where(seen, t.score / np.where(seen, t.count, 1.0), centre_rho)

    def _fit(self, t: _Table) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(bin centres, monotone rates) over the bins that have seen nodes; None when none has."""
        seen = t.count > _SEEN
        if not seen.any():
            return None
        w0 = self.prior_weight
        raw = self._prior_rho(t)[seen]
        # pooled over all bins: how much of the claimed mass is realized (itself shrunk towards 1)
        ratio = (t.hits.sum() + w0) / (t.score.sum() + w0)
        weights = t.count[seen] + w0
        rates = (t.hits[seen] + w0 * np.minimum(1.0, raw * ratio)) / weights  # shrunk towards the pooled prior
        return self._centers[seen], np.clip(_pava(rates, weights), 0.0, 1.0), raw

    def __repr__(self) -> str:
        return (
            f"AcceptanceCalibrator(bins={self.bins}, logit_range={self.logit_range}, half_life={self.half_life}, "
            f"prior_weight={self.prior_weight})"
        )
