"""Robust, recency-weighted fit of the two-branch roofline

    t = max(a_c * x_c + b_c, a_m * x_m + b_m)

where ``x_c = flops / peak_flops`` and ``x_m = bytes / bandwidth`` are the ideal compute and memory times
of each observed forward and ``t`` its measured seconds.

How the fit works:

* Residuals are relative, ``(prediction - t) / t``: timing noise is roughly proportional to the time.
* A max of two lines is fitted by alternation: assign each point to the branch that currently predicts
  more, refit each branch by weighted least squares on its points, repeat. Because alternation can
  stall in a poor local optimum, it starts from several splits along ``log(x_c / x_m)`` (compute-bound
  points have the larger ratio) and keeps the start with the lowest truncated loss.
* Outliers (page faults, GC pauses, a clock change) are down-weighted by iteratively reweighted least
  squares with Cauchy weights on a median-absolute-deviation scale; the comparison between starts uses
  a truncated quadratic, so a few wild points cannot pick the winner either.
* Caller-supplied weights carry recency (newer steps count more).
* A branch the data cannot identify (too few points, or all at nearly the same ``x``) is tied to the
  other one: same intercept, slope scaled by the prior's slope ratio. Its line then stays below the
  observed data, as physics says it should, instead of taking arbitrary values.
"""

from __future__ import annotations

import math

import numpy as np
from attrs import field, frozen

from bastion.utils.checks import finite_non_negative
from bastion.contract.errors import InvalidInputError

__all__ = ["RooflineParams", "FitResult", "fit_roofline"]

_CAUCHY_C = 2.385  # 95% efficiency at the normal
_TRUNCATE = 0.25  # relative residual beyond which a point's loss stops growing (start selection)
_MIN_EFFECTIVE = 3.0  # effective points a branch needs for slope + intercept
_MIN_SPREAD = 0.05  # relative spread of x a branch needs for a slope


@frozen
class RooflineParams:
    """Efficiency multipliers (``a_*``) and fixed costs in seconds (``b_*``) of both branches."""

    a_c: float = field(converter=float, validator=finite_non_negative)
    b_c: float = field(converter=float, validator=finite_non_negative)
    a_m: float = field(converter=float, validator=finite_non_negative)
    b_m: float = field(converter=float, validator=finite_non_negative)

    def predict(self, x_c: np.ndarray, x_m: np.ndarray) -> np.ndarray:
        """Seconds for ideal compute times ``x_c`` and memory times ``x_m`` (arrays [N])."""
        return np.maximum(self.a_c * x_c + self.b_c, self.a_m * x_m + self.b_m)

    def as_dict(self) -> dict[str, float]:
        return {"a_c": self.a_c, "b_c": self.b_c, "a_m": self.a_m, "b_m": self.b_m}


@frozen
class FitResult:
    params: RooflineParams
    median_rel_error: float  # weighted median of |prediction - t| / t over all points
    inlier_fraction: float  # share of points within 3 robust scales of the fit
    n_points: int
    compute_bound_fraction: float  # share of points on the compute branch


def fit_roofline(
    x_c: np.ndarray,
    x_m: np.ndarray,
    t: np.ndarray,
    weights: np.ndarray | None = None,
    *,
    prior: RooflineParams,
    init: RooflineParams | None = None,
    starts: int = 7,
    iters: int = 8,
) -> FitResult:
    """Fit :class:`RooflineParams` to observations (arrays [N]); ``prior`` supplies the slope ratio for a
    branch the data cannot identify (and the answer when there is no data); ``init`` adds a warm start."""
    xc = np.asarray(x_c, dtype=np.float64)
    xm = np.asarray(x_m, dtype=np.float64)
    tt = np.asarray(t, dtype=np.float64)
    w = np.ones_like(tt) if weights is None else np.asarray(weights, dtype=np.float64)
    if not (xc.shape == xm.shape == tt.shape == w.shape and xc.ndim == 1):
        raise InvalidInputError("x_c, x_m, t and weights must be 1-D arrays of one length")
    ok = np.isfinite(xc) & np.isfinite(xm) & np.isfinite(tt) & np.isfinite(w) & (tt > 0) & (w > 0) & (xc >= 0) & (xm >= 0)
    xc, xm, tt, w = xc[ok], xm[ok], tt[ok], w[ok]
    if tt.size == 0:
        return FitResult(prior, float("nan"), 0.0, 0, 0.0)
    w = w / w.sum()

    masks: list[np.ndarray] = []
    if init is not None:
        masks.append(init.a_c * xc + init.b_c > init.a_m * xm + init.b_m)
    lr = np.log(np.maximum(xc, 1e-30) / np.maximum(xm, 1e-30))
    for q in np.linspace(0.0, 1.0, max(2, starts)):
        masks.append(lr > np.quantile(lr, q) if q > 0 else np.ones_like(lr, dtype=bool))

    best: tuple[float, RooflineParams] | None = None
    for mask in masks:
        params = _alternate(xc, xm, tt, w, mask, prior, iters)
        loss = _truncated_loss(params, xc, xm, tt, w)
        if best is None or loss < best[0] - 1e-12:
            best = (loss, params)
    assert best is not None
    params = best[1]
    rel = (params.predict(xc, xm) - tt) / tt
    scale = _robust_scale(rel)
    return FitResult(
        params=params,
        median_rel_error=float(_weighted_median(np.abs(rel), w)),
        inlier_fraction=float(np.mean(np.abs(rel) <= 3 * scale)),
        n_points=int(tt.size),
        compute_bound_fraction=float(np.mean(params.a_c * xc + params.b_c > params.a_m * xm + params.b_m)),
    )


def _alternate(
    xc: np.ndarray, xm: np.ndarray, t: np.ndarray, w: np.ndarray, mask: np.ndarray, prior: RooflineParams, iters: int
) -> RooflineParams:
    robust = np.ones_like(t)
    params = prior
    for _ in range(iters):
        ww = w * robust
        c_line = _fit_line(xc[mask], t[mask], ww[mask])
        m_line = _fit_line(xm[~mask], t[~mask], ww[~mask])
        params = _combine(c_line, m_line, xc[mask], xm[~mask], t, mask, ww, prior)
        pc = params.a_c * xc + params.b_c
        pm = params.a_m * xm + params.b_m
        rel = (np.maximum(pc, pm) - t) / t
        robust = 1.0 / (1.0 + (rel / (_CAUCHY_C * _robust_scale(rel))) ** 2)
        new_mask = pc > pm
        if np.array_equal(new_mask, mask):
            break
        mask = new_mask
    return params


def _fit_line(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[str, float, float]:
    """Weighted least squares of ``a * x + b`` against ``t`` in relative terms.

    Returns ``("full", a, b)``, ``("intercept", nan, nan)`` when only the level is identified, or
    ``("none", nan, nan)`` when the branch has no usable points.
    """
    if x.size == 0 or w.sum() <= 0:
        return ("none", math.nan, math.nan)
    eff = w.sum() ** 2 / np.square(w).sum()
    mean_x = float(np.average(x, weights=w))
    spread = float(np.sqrt(np.average((x - mean_x) ** 2, weights=w))) / max(mean_x, 1e-30)
    if eff < _MIN_EFFECTIVE or spread < _MIN_SPREAD:
        return ("intercept", math.nan, math.nan)
    v = w / (t * t)  # relative residuals: minimise sum w ((a x + b - t) / t)^2
    s0, s1, s2 = v.sum(), (v * x).sum(), (v * x * x).sum()
    r0, r1 = (v * t).sum(), (v * x * t).sum()
    det = s0 * s2 - s1 * s1
    if det <= 1e-300 * max(s0 * s2, 1e-300):
        return ("intercept", math.nan, math.nan)
    a = (s0 * r1 - s1 * r0) / det
    b = (r0 - a * s1) / s0
    if a < 0:  # more tokens never make a forward faster
        a, b = 0.0, r0 / s0
    elif b < 0:
        a, b = r1 / s2, 0.0
    return ("full", float(a), float(b))


def _fit_intercept(x: np.ndarray, t: np.ndarray, w: np.ndarray, a: float) -> float:
    """Best relative-LS intercept ``b >= 0`` for a fixed slope ``a``."""
    if x.size == 0:
        return math.nan
    v = w / (t * t)
    return max(float((v * (t - a * x)).sum() / v.sum()), 0.0)


def _combine(
    c_line: tuple[str, float, float],
    m_line: tuple[str, float, float],
    xc_on: np.ndarray,
    xm_on: np.ndarray,
    t: np.ndarray,
    mask: np.ndarray,
    w: np.ndarray,
    prior: RooflineParams,
) -> RooflineParams:
    ratio = prior.a_c / prior.a_m if prior.a_m > 0 else 1.0  # a_c / a_m the prior believes in
    (kc, a_c, b_c), (km, a_m, b_m) = c_line, m_line
    if kc == "full" and km == "full":
        return RooflineParams(a_c, b_c, a_m, b_m)
    if kc == "full":
        a_m = a_c / ratio if ratio > 0 else prior.a_m
        b_m = _fit_intercept(xm_on, t[~mask], w[~mask], a_m) if km == "intercept" else b_c
        return RooflineParams(a_c, b_c, a_m, b_m)
    if km == "full":
        a_c = a_m * ratio
        b_c = _fit_intercept(xc_on, t[mask], w[mask], a_c) if kc == "intercept" else b_m
        return RooflineParams(a_c, b_c, a_m, b_m)
    # neither slope identified: keep the prior's slopes, fit the levels
    a_c, a_m = prior.a_c, prior.a_m
    b_c = _fit_intercept(xc_on, t[mask], w[mask], a_c)
    b_m = _fit_intercept(xm_on, t[~mask], w[~mask], a_m)
    if math.isnan(b_c):
        b_c = b_m if not math.isnan(b_m) else prior.b_c
    if math.isnan(b_m):
        b_m = b_c
    return RooflineParams(a_c, b_c, a_m, b_m)


def _robust_scale(rel: np.ndarray) -> float:
    """Median absolute deviation of relative residuals, as a normal-consistent scale (floor 0.1%)."""
    return max(1.4826 * float(np.median(np.abs(rel))), 1e-3)


def _weighted_median(x: np.ndarray, w: np.ndarray) -> float:
    order = np.argsort(x)
    cw = np.cumsum(w[order])
    return float(x[order][np.searchsorted(cw, 0.5 * cw[-1])])


def _truncated_loss(params: RooflineParams, xc: np.ndarray, xm: np.ndarray, t: np.ndarray, w: np.ndarray) -> float:
    rel = (params.predict(xc, xm) - t) / t
    return float((w * np.minimum(rel * rel, _TRUNCATE**2)).sum())
