"""When an autoregressive drafter should stop expanding: the controller's marginal-gain-per-second rule.

The controller maximizes S = A / C (tokens per step over seconds per step, drafting included). One more
draft depth costs ``c`` seconds and raises A by ``dA``; it pays exactly when ``(A + dA) / (C + c) >
A / C``, i.e. when its gain per second ``dA / c`` beats the step's current rate ``A / C``.

``dA`` is predicted before the forward runs: each frontier node about to be expanded is assumed to have
children whose probabilities follow the profile measured at the previous depth (mean of the sorted
top-k child probabilities) (:func:`predicted_children`).

Two ways to judge the depth:

- :func:`pays_for_depth` (used whenever the pipeline passes ``DraftStep.estimate_speedup``): ask the
  budget controller's own objective. The speedup it would predict for its choice among the current
  candidates, with the drafting seconds spent so far, against the same with the predicted children
  added and one more depth's seconds. The controller re-chooses its size in both, so a child only counts
  when the controller would verify it, and the drafting cost is counted once, where the controller
  counts it.
- :func:`worth_expanding` with :func:`predicted_gain` (controllers that offer no estimate): ``dA`` is
  what the predicted children add to the best ``n - 1`` candidates' sum of rho (n = the step's node
  budget), and the current rate is the pipeline's running seconds per token: the depth pays when
  ``dA * seconds_per_token > c``.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

from bastion.contract.types import SpeedupEstimator

__all__ = ["predicted_children", "predicted_gain", "pays_for_depth", "worth_expanding"]


def predicted_children(frontier: Sequence[float], child_profile: Sequence[float]) -> list[float]:
    """Log rho of the children the ``frontier`` nodes (log rho) are predicted to get when their child
    probabilities follow ``child_profile`` (zero probabilities give no child)."""
    return [f + math.log(p) for f in frontier for p in child_profile if p > 0.0]


def predicted_gain(
    scores: Sequence[float],
    frontier: Sequence[float],
    child_profile: Sequence[float],
    slots: int | None,
) -> float:
    """Predicted rise of the top-``slots`` sum of rho when the ``frontier`` nodes (log rho) each get
    children with probabilities ``child_profile`` (sorted, decreasing). ``scores`` are the log rho of the
    current non-root candidates; ``slots`` None means no node budget."""
    predicted = predicted_children(frontier, child_profile)
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


def pays_for_depth(
    estimate: SpeedupEstimator,
    scores: Sequence[float],
    predicted: Sequence[float],
    slots: int | None,
    draft_s: float,
    depth_cost_s: float | None,
) -> bool:
    """Whether the controller's ``estimate`` (see ``DraftStep.estimate_speedup``) predicts a higher speedup
    after one more depth: the best ``slots`` of ``scores`` (non-root candidates' log rho) and the
    ``predicted`` children's, after ``draft_s + depth_cost_s`` seconds of drafting, against the best
    ``slots`` of ``scores`` after ``draft_s``. ``slots`` None means no node budget; an unknown
    ``depth_cost_s`` (the first steps) always expands; ties stop."""
    if depth_cost_s is None:
        return True
    if not predicted or (slots is not None and slots <= 0):
        return False
    before = heapq.nlargest(len(scores) if slots is None else slots, scores)
    after = heapq.nlargest(len(before) + len(predicted) if slots is None else slots, [*before, *predicted])
    now = estimate([0.0, *before], draft_s)
    return estimate([0.0, *after], draft_s + depth_cost_s) > now
