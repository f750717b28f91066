"""Statistics for checking samplers: does a histogram of draws fit the distribution it should follow?

Lossless speculative sampling must reproduce the target's distribution exactly, so the checks compare
counts of emitted outcomes with exact probabilities. Every acceptance threshold here is derived from the
number of trials and a false-alarm rate ``alpha`` (the probability that a correct sampler fails the
check), never hand-picked:

- :func:`chi_square_p` is Pearson's goodness-of-fit test. Its statistic is compared with the
  chi-square distribution with (cells - 1) degrees of freedom, so the acceptance region widens or
  narrows with the trial count by itself. Cells whose expected count is below 5 (where the chi-square
  approximation breaks down) are pooled into one cell. An outcome of probability zero that was drawn
  at all gives p = 0.
- :func:`tv_tolerance` is a distribution-free bound on the total variation between the empirical and
  the true distribution of ``trials`` i.i.d. draws over ``support`` outcomes:

      E[TV] <= 1/2 * sum_x sqrt(p_x (1 - p_x) / n) <= 1/2 * sqrt(support / n)     (Cauchy-Schwarz)
      P(TV >= E[TV] + t) <= exp(-2 n t^2)                                          (McDiarmid: one
                                                                                    draw moves TV by <= 1/n)

  so TV stays below ``1/2 * sqrt(support / n) + sqrt(ln(1 / alpha) / (2 n))`` with probability at least
  ``1 - alpha``. It is loose (a worst case) but needs no cell pooling; use it to state how far off a
  sampler may look after n draws.

:data:`DEFAULT_ALPHA` (1e-3) is the false-alarm rate of the shipped checks: with fixed seeds a check is
deterministic, and a correct sampler fails for one seed in a thousand.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

__all__ = ["DEFAULT_ALPHA", "assert_fits", "chi_square_p", "total_variation", "tv_tolerance"]

#: false-alarm rate of the shipped checks (probability that a correct sampler fails one check)
DEFAULT_ALPHA = 1e-3
#: cells expecting fewer draws than this are pooled (the chi-square approximation needs about 5)
MIN_EXPECTED = 5.0


def _as_arrays(
    counts: torch.Tensor | Mapping[object, int], probs: torch.Tensor | Mapping[object, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and probabilities as aligned float64 vectors; mapping keys missing from ``probs`` are
    outcomes of probability zero."""
    if isinstance(counts, Mapping) or isinstance(probs, Mapping):
        if not (isinstance(counts, Mapping) and isinstance(probs, Mapping)):
            raise TypeError("pass counts and probs both as tensors or both as mappings")
        keys: Sequence[object] = list(dict.fromkeys([*probs, *counts]))
        obs = torch.tensor([float(counts.get(k, 0)) for k in keys], dtype=torch.float64)
        p = torch.tensor([float(probs.get(k, 0.0)) for k in keys], dtype=torch.float64)
        return obs, p
    obs, p = counts.flatten().double().cpu(), probs.flatten().double().cpu()
    if obs.shape != p.shape:
        raise ValueError(f"counts {tuple(obs.shape)} and probs {tuple(p.shape)} differ in size")
    return obs, p


def chi_square_p(counts: torch.Tensor | Mapping[object, int], probs: torch.Tensor | Mapping[object, float]) -> float:
    """Pearson goodness-of-fit p-value of ``counts`` (draws per outcome) against ``probs`` (exact
    probabilities, summing to 1). Cells expecting fewer than 5 draws are pooled; drawing an outcome of
    probability zero gives 0.0."""
    obs, p = _as_arrays(counts, probs)
    total = float(obs.sum())
    if total <= 0:
        raise ValueError("chi_square_p needs at least one draw")
    if bool(((p <= 0) & (obs > 0)).any()):
        return 0.0
    exp = p / p.sum() * total
    big = exp >= MIN_EXPECTED
    e = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    o = torch.cat([obs[big], obs[~big].sum().reshape(1)])
    keep = e > 0
    df = int(keep.sum()) - 1
    if df < 1:
        return 1.0
    stat = ((o[keep] - e[keep]) ** 2 / e[keep]).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def total_variation(counts: torch.Tensor | Mapping[object, int], probs: torch.Tensor | Mapping[object, float]) -> float:
    """Total variation distance between the empirical distribution of ``counts`` and ``probs``."""
    obs, p = _as_arrays(counts, probs)
    return 0.5 * float((obs / obs.sum() - p).abs().sum())


def tv_tolerance(trials: int, support: int, alpha: float = DEFAULT_ALPHA) -> float:
    """Total variation that ``trials`` exact draws over ``support`` outcomes stay below with
    probability at least ``1 - alpha`` (see the module docstring for the derivation)."""
    if trials < 1 or support < 1 or not 0 < alpha < 1:
        raise ValueError(f"need trials >= 1, support >= 1 and 0 < alpha < 1, got {trials}, {support}, {alpha}")
    return 0.5 * math.sqrt(support / trials) + math.sqrt(math.log(1 / alpha) / (2 * trials))


def assert_fits(
    counts: torch.Tensor | Mapping[object, int],
    probs: torch.Tensor | Mapping[object, float],
    *,
    alpha: float = DEFAULT_ALPHA,
    what: str = "the draws",
) -> None:
    """Raise :class:`AssertionError` unless ``counts`` fit ``probs`` at false-alarm rate ``alpha``
    (chi-square goodness of fit); the message gives the p-value and the total variation."""
    p_value = chi_square_p(counts, probs)
    if p_value < alpha:
        obs, _ = _as_arrays(counts, probs)
        raise AssertionError(
            f"{what} do not follow the expected distribution: chi-square p = {p_value:.2g} < alpha = {alpha:g} "
            f"over {int(obs.sum())} draws (total variation {total_variation(counts, probs):.3f})"
        )
