"""When an autoregressive drafter should stop expanding: the marginal-gain-per-second rule.

The controller maximizes S = A_hat / C (tokens per step over seconds per step). One more draft depth
costs ``c`` seconds and raises A_hat by ``dA``; it pays exactly when ``dA / c > A_hat / C``, i.e. when
``dA * (C / A_hat) > c``, where ``C / A_hat`` is the seconds a committed token currently costs (the
pipeline passes its running estimate as ``DraftStep.seconds_per_token``).

``dA`` is predicted before the forward runs: each frontier node about to be expanded is assumed to have
children whose probabilities follow the profile measured at the previous depth (mean of the sorted
top-k child probabilities), and the gain is how much those predicted children would add to the best
``n - 1`` candidates' sum of rho (n = the step's node budget): children only count when they would
displace weaker candidates from the tree the builder can select.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

__all__ = ["predicted_gain", "worth_expanding"]


def predicted_gain(
    scores: Sequence[float],
    frontier: Sequence[float],
    child_profile: Sequence[float],
    slots: int | None,
) -> float:
    """Predicted rise of the top-``slots`` sum of rho when the ``frontier`` nodes (log rho) each get
    children with probabilities ``child_profile`` (sorted, decreasing). ``scores`` are the log rho of the
    current non-root candidates; ``slots`` None means no node budget."""
    predicted = [f + math.log(p) for f in frontier for p in child_profile if p > 0.0]
    if not predicted:
        return 0.0
    if slots is None:
        return sum(math.exp(s) for s in predicted)
    if slots <= 0:
        return 0.0
    before = heapq.nlargest(slots, scores)
    after = heapq.nlargest(slots, [*before, *predicted])
    return sum(math.exp(s) for s in after) - sum(math.exp(s) for s in before)


def worth_expanding(gain: float, seconds_per_token: float | None, depth_cost_s: float | None) -> bool:
    """Whether a depth predicted to add ``gain`` to A_hat pays for its ``depth_cost_s`` seconds at
    ``seconds_per_token``. Unknown costs (the first steps) always expand."""
    if seconds_per_token is None or depth_cost_s is None:
        return True
    return gain * seconds_per_token > depth_cost_s
