"""One running estimate of a per-step cost, shared by the pipeline and the controllers."""

from __future__ import annotations

__all__ = ["running_mean"]


def running_mean(previous: float, sample: float, weight: float, clip: float = 3.0) -> float:
    """Exponential running mean with outlier clipping: ``sample`` enters with ``weight`` after being
    clipped to ``clip`` times the current estimate, so one stalled step (a page fault, a burst of foreign
    load) moves the estimate by at most ``weight * (clip - 1)`` of itself while a lasting change still
    takes over within a few steps. The first sample (``previous == 0``) is taken as is."""
    if previous <= 0.0:
        return sample
    return (1.0 - weight) * previous + weight * min(sample, clip * previous)
