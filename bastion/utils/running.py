"""Running estimates of per-step costs, shared by the pipeline, the engine and the controllers."""

from __future__ import annotations

__all__ = ["RobustLevel", "running_mean"]


def running_mean(previous: float, sample: float, weight: float, clip: float = 3.0) -> float:
    """Exponential running mean with outlier clipping: ``sample`` enters with ``weight`` after being
    clipped to ``clip`` times the current estimate, so one stalled step (a page fault, a burst of foreign
    load) moves the estimate by at most ``weight * (clip - 1)`` of itself while a lasting change still
    takes over within a few steps. The first sample (``previous == 0``) is taken as is."""
    if previous <= 0.0:
        return sample
    return (1.0 - weight) * previous + weight * min(sample, clip * previous)


class RobustLevel:
    """The current level of a per-step cost that a burst of foreign load cannot drag, and that follows
    a lasting change within a bounded number of samples.

    The level is the median of the last ``window`` samples, so an isolated burst (fewer than half the
    window) does not move it at all. A lasting change is a run of ``run`` samples in a row that all lie
    more than ``tolerance`` (relative) above the level, or all below it: the window then restarts from
    that run, so the level follows a step up or down within ``run`` samples. :attr:`shifts` counts the
    changes detected."""

    __slots__ = ("window", "run", "tolerance", "_samples", "_side", "_streak", "value", "shifts")

    def __init__(self, window: int = 9, run: int = 4, tolerance: float = 0.3) -> None:
        if window < 1 or not 1 <= run <= window or tolerance <= 0:
            raise ValueError(f"need window >= 1, 1 <= run <= window and tolerance > 0; got {window}, {run}, {tolerance}")
        self.window, self.run, self.tolerance = window, run, tolerance
        self._samples: list[float] = []
        self._side = 0  # +1 / -1: the side of the level the current streak lies on
        self._streak = 0
        self.value = 0.0  # 0 before any sample
        self.shifts = 0

    def __float__(self) -> float:
        return self.value

    @property
    def streak(self) -> int:
        """Samples in a row beyond the tolerance on one side (a change under way when > 0)."""
        return self._streak

    def __bool__(self) -> bool:
        return bool(self._samples)

    @property
    def count(self) -> int:
        """Samples the level is the median of now (up to ``window``; a detected change restarts it)."""
        return len(self._samples)

    def observe(self, sample: float) -> bool:
        """Add one sample -> whether it completed a lasting change (the window restarted)."""
        x = float(sample)
        if x != x:  # NaN carries no information
            return False
        shifted = False
        if self._samples and self.value > 0:
            side = 1 if x > self.value * (1.0 + self.tolerance) else (-1 if x < self.value / (1.0 + self.tolerance) else 0)
            if side != 0 and side == self._side:
                self._streak += 1
            else:
                self._side, self._streak = side, (1 if side else 0)
            if self._streak >= self.run:  # a lasting change: start over from the run that showed it
                self._samples = self._samples[-(self.run - 1):] if self.run > 1 else []
                self._side, self._streak = 0, 0
                self.shifts += 1
                shifted = True
        self._samples.append(x)
        if len(self._samples) > self.window:
            del self._samples[0]
        ordered = sorted(self._samples)
        k = len(ordered)
        self.value = ordered[k // 2] if k % 2 else 0.5 * (ordered[k // 2 - 1] + ordered[k // 2])
        return shifted

    def __repr__(self) -> str:
        return f"RobustLevel(value={self.value:.6g}, samples={len(self._samples)}, shifts={self.shifts})"
