"""What a batched step costs outside the verify forward, measured per batch size.

A batched step has three such costs, each growing with the number of rows B in its own way: drafting
(one drafter call for every row, plus building each row's tree), the rest of a speculative step
(deciding the width, verifying, committing, records) and the rest of a plain step. The budget controller
needs them at the batch size it is deciding for, including sizes it has not run yet (rows leave the
batch as they finish; the next request may be larger). :class:`CostBySize` keeps a running mean per
batch size seen and answers unseen sizes from a non-negative fit ``a + b * B`` through them (one size
seen: proportional to B, which over-prices larger batches and under-prices smaller ones, so an unseen
large batch does not start speculating on an optimistic guess). :class:`BatchCosts` holds the three.
"""

from __future__ import annotations

import numpy as np

from bastion.utils.checks import check_int, check_number
from bastion.utils.running import RobustLevel

__all__ = ["CostBySize", "BatchCosts"]


class CostBySize:
    """Robust running seconds per batch size (:class:`~bastion.utils.running.RobustLevel`: a burst of
    foreign load does not move it, a lasting change takes over within a few steps); unseen sizes from a
    non-negative linear fit (module doc). ``weight`` is kept for compatibility."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = check_number("weight", weight, strict=True)
        self._levels: dict[int, RobustLevel] = {}
        self._means: dict[int, float] = {}
        self._line: tuple[float, float] | None = None  # the fit through _means, until the next observation

    def observe(self, batch_size: int, seconds: float) -> None:
        b = check_int("batch_size", batch_size)
        s = check_number("seconds", seconds)
        level = self._levels.get(b)
        if level is None:
            level = self._levels[b] = RobustLevel()
        level.observe(s)
        if self._means.get(b) != level.value:
            self._means[b] = level.value
            self._line = None

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._means))

    def count(self, batch_size: int) -> int:
        """How many measured steps the cost at ``batch_size`` rests on (0: extrapolated): every step
        measured there until its level's window is full, and never fewer than a lasting change's run once
        one restarted it (:class:`~bastion.utils.running.RobustLevel`)."""
        level = self._levels.get(int(batch_size))
        return 0 if level is None else level.count

    def __call__(self, batch_size: int) -> float:
        """Predicted seconds at ``batch_size`` (0.0 before any observation)."""
        seen = self._means.get(batch_size)
        if seen is not None:
            return seen
        if not self._means:
            return 0.0
        if self._line is None:  # asked every step for an unseen size: fit once per observation
            self._line = self._fit()
        a, b = self._line
        return a + b * batch_size

    def _fit(self) -> tuple[float, float]:
        """(a, b) >= 0 of seconds = a + b * B, least squares over the sizes seen."""
        x = np.array(list(self._means), dtype=np.float64)  # [K] batch sizes
        y = np.array(list(self._means.values()), dtype=np.float64)  # [K] seconds
        if x.size >= 2 and np.ptp(x) > 0:
            slope, icpt = np.polyfit(x, y, 1)
            if slope >= 0 and icpt >= 0:
                return float(icpt), float(slope)
            if slope < 0:  # a cost that falls with B: take the mean as flat
                return float(y.mean()), 0.0
        return 0.0, float((x * y).sum() / (x * x).sum())  # through the origin (one size: proportional)


class BatchCosts:
    """The non-verify seconds of batched steps, per batch size (see the module doc)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.draft = CostBySize(weight)  # drafting + tree building of a speculative step
        self.other = CostBySize(weight)  # the rest of a speculative step outside the verify forward
        self.plain = CostBySize(weight)  # a plain step outside its target forward
