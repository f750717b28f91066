"""How this request's drafts fare against the calibrated prediction: one factor per request.

The :class:`~bastion.controllers.calibration.AcceptanceCalibrator` learns, per sampling setting and
across requests, how often a node of a given score is accepted. Requests differ at the same scores,
though: on the demo pair one chat prompt accepts 1.4-1.7 tokens per step where calibration, learnt on
the prompts before it, predicts 2.2-3.8 for the same trees, and the gate, which hears the calibrated
prediction, keeps probing (and paying for) drafts on it. :class:`RequestAcceptance` measures that
deviation while the request runs,

    f = (prior + R) / (prior + P),   R <- decay * R + realized,   P <- decay * P + predicted

over the request's speculative steps, where ``predicted`` is the calibrated number of drafted tokens
the verified tree was expected to add (A_cal(T_n) - 1) and ``realized`` the number verification
accepted. ``prior`` pseudo-tokens at ratio 1 shrink the first steps' noisy evidence toward the
calibrator; ``decay`` forgets old steps, so a request whose text changes character mid-way (a code
block in a chat answer) follows within a few steps. The controller multiplies the calibrated
per-node acceptance of the request's drafted nodes by ``f`` (at most 1 each): on a request that
accepts less than calibration says, the predicted gain falls and the gate switches to plain decoding
sooner; on one that accepts more, trees may grow.

Each request starts at ``f = 1``, not at its predecessor's factor: carrying half the previous request's
evidence into the next was measured on planted requests (a well-predicted request after a poor one) and
held the good request plain on most seeds, since the gate judges a request's first probe by the factor
it starts with.

With ``prior = 2`` and ``decay = 0.8``, three steps that each realize 1 of 1.7 predicted tokens take
``f`` to 0.72; a single step that realizes nothing of 3 predicted moves it to 0.4 at most, and
the next steps at the calibrated rate bring it back.
"""

from __future__ import annotations

import math

from bastion.contract.errors import InvalidInputError

__all__ = ["RequestAcceptance"]


class RequestAcceptance:
    """The current request's realized / predicted drafted tokens, shrunk toward 1 (see the module doc).

    ``prior``: pseudo-tokens at ratio 1 (> 0); ``decay``: weight of the older steps per new step, in
    (0, 1]; ``low`` / ``high``: bounds of the factor."""

    __slots__ = ("prior", "decay", "low", "high", "_realized", "_predicted", "steps")

    def __init__(self, *, prior: float = 2.0, decay: float = 0.8, low: float = 0.25, high: float = 2.0) -> None:
        if not (math.isfinite(prior) and prior > 0):
            raise InvalidInputError(f"prior must be a finite number > 0, got {prior!r}")
        if not (0 < decay <= 1):
            raise InvalidInputError(f"decay must lie in (0, 1], got {decay!r}")
        if not (0 < low <= 1 <= high and math.isfinite(high)):
            raise InvalidInputError(f"need 0 < low <= 1 <= high (finite), got low={low!r}, high={high!r}")
        self.prior, self.decay, self.low, self.high = float(prior), float(decay), float(low), float(high)
        self.reset()

    def reset(self) -> None:
        """A new request: no evidence yet (the factor is 1)."""
        self._realized = 0.0
        self._predicted = 0.0
        self.steps = 0

    def observe(self, predicted: float, realized: float) -> None:
        """One speculative step: ``predicted`` drafted tokens expected (calibrated, the root left out),
        ``realized`` accepted. A step that expected nothing (a tree of the root alone) ages the evidence:
        the factor drifts back toward 1, so a request whose factor chose the root alone looks again
        within a few steps instead of staying at its lowest. Non-finite or negative values are ignored."""
        if not (math.isfinite(predicted) and math.isfinite(realized)) or predicted < 0 or realized < 0:
            return
        self._realized = self.decay * self._realized + float(realized)
        self._predicted = self.decay * self._predicted + float(predicted)
        self.steps += 1

    @property
    def factor(self) -> float:
        """``(prior + R) / (prior + P)`` within ``[low, high]``; 1 before any step."""
        f = (self.prior + self._realized) / (self.prior + self._predicted)
        return min(self.high, max(self.low, f))

    def __repr__(self) -> str:
        return f"RequestAcceptance(factor={self.factor:.3g}, steps={self.steps}, prior={self.prior}, decay={self.decay})"
