"""What a batched step costs outside the verify forward, measured per batch size.

A batched step has three such costs, each growing with the number of rows B in its own way: drafting
(one drafter call for every row, plus building each row's tree), the rest of a speculative step
(deciding the width, verifying, committing, records) and the rest of a plain step. The budget controller
needs them at the batch size it is deciding for, including sizes it has not run yet (rows leave the
batch as they finish; the next request may be larger). :class:`CostBySize` keeps a running mean per
batch size seen and answers unseen sizes from a non-negative fit ``a + b * B`` through them (one size
seen: proportional to B, which over-prices larger batches and under-prices smaller ones, so an unseen
large batch does not start speculating on an optimistic guess). :class:`BatchCosts` holds the three,
and a fourth that is not per step: the drafting seconds per position a drafter takes in late (after a
plain stretch or a join, see :meth:`bastion.contract.batch_state.DraftBatch.pending_positions`), which
prices a probe's catch-up.
"""

from __future__ import annotations

import numpy as np

from bastion.utils.checks import check_int, check_number
from bastion.utils.running import RobustLevel

__all__ = ["CostBySize", "BatchCosts", "CATCH_UP_MIN"]

#: a draft owing at least this many late positions per row teaches the catch-up cost
CATCH_UP_MIN = 8


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
        #: drafting seconds per position taken in late, beyond a steady step's drafting (robust level;
        #: 0 until a draft that caught up on many positions was timed)
        self.catch_up = RobustLevel()

    def observe_catch_up(self, batch_size: int, seconds: float, pending: int) -> None:
        """A draft of ``batch_size`` rows that took ``seconds`` while taking in ``pending`` positions
        first: its seconds beyond a steady draft at that size, per position, teach :attr:`catch_up`.
        Only drafts owing at least :data:`CATCH_UP_MIN` positions per row count (a steady step takes in
        the few positions its last step accepted, already inside the steady cost), and only at a batch
        size whose steady drafting was measured."""
        b = check_int("batch_size", batch_size)
        if pending < CATCH_UP_MIN * b or b not in self.draft.sizes:
            return
        self.catch_up.observe(max(0.0, check_number("seconds", seconds) - self.draft(b)) / pending)

    def catch_up_s(self, pending: int) -> float:
        """Predicted seconds of taking in ``pending`` late positions (0.0 before any was timed)."""
        return self.catch_up.value * pending if pending > 0 else 0.0
