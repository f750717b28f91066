"""A learnt correction on top of the roofline: what the two-branch model cannot follow.

A real device's verify-cost curve has steps (kernel tile sizes, threading thresholds, cache sizes) that
``max(compute line, memory line)`` smooths over. :class:`ResidualTable` keeps, per cell of a grid over
the verified tokens ``n`` (half-octave bins) and the context length ``c`` (octave bins), the
recency-weighted mean of ``log(measured / roofline)``, and multiplies predictions by its exponential.

Slow outliers (a page fault, a pause) are down-weighted by Cauchy reweighting on a median-absolute-
deviation scale. Cells shrink towards their ``n`` column (all contexts pooled) and columns towards 0 (no correction), each
with a pseudo-count of ``strength`` observations, so a cell seen once moves only part of the way and a
size never seen keeps the roofline's prediction. Piecewise-constant cells follow steps in the curve; the
roofline's interpretable parameters stay the model's backbone. The table is plain sums, so it is
deterministic given the same observations and serializes to portable JSON.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bastion.contract.errors import InvalidInputError

__all__ = ["ResidualTable"]

#: bins per octave of the verified-token count n (2: half-octave bins 1, 1.41, 2, 2.83, 4, ...)
_N_BINS_PER_OCTAVE = 2
_N_BINS = 2 * 13 + 1  # n up to 8192
_C_BINS = 21  # context up to 2**20 tokens
_ROBUST_ITERATIONS = 4  # the first pass is plain weighted means; later passes down-weight outliers
_CAUCHY_C = 2.385
_MAD_TO_SIGMA = 1.4826
_MIN_SCALE = 0.02  # timing noise floor (log units, about 2%)


def _n_bin(n: np.ndarray) -> np.ndarray:
    x = np.log2(np.maximum(np.asarray(n, dtype=np.float64), 1.0)) * _N_BINS_PER_OCTAVE
    return np.minimum(np.floor(x + 1e-9).astype(np.int64), _N_BINS - 1)


def _c_bin(c: np.ndarray) -> np.ndarray:
    x = np.log2(np.asarray(c, dtype=np.float64) + 1.0)
    return np.minimum(np.floor(x + 1e-9).astype(np.int64), _C_BINS - 1)


class ResidualTable:
    """Multiplicative residual ``exp(r(n, c))`` over a (tokens, context) grid, fitted from weighted
    observations of ``log(measured / roofline)``.

    ``strength``: pseudo-count of the shrinkage towards the coarser level (larger: more observations
    needed before a cell departs from its column, and a column from the plain roofline).
    ``max_abs_log``: clamp on any single observation's log ratio (a page fault or a pause must not
    teach the table a 100x correction).
    """

    def __init__(self, strength: float = 2.0, max_abs_log: float = math.log(8.0)) -> None:
        if not (isinstance(strength, (int, float)) and math.isfinite(strength) and strength > 0):
            raise InvalidInputError(f"strength must be a finite number > 0, got {strength!r}")
        if not (isinstance(max_abs_log, (int, float)) and math.isfinite(max_abs_log) and max_abs_log > 0):
            raise InvalidInputError(f"max_abs_log must be a finite number > 0, got {max_abs_log!r}")
        self.strength = float(strength)
        self.max_abs_log = float(max_abs_log)
        self._table = np.zeros((_N_BINS, _C_BINS))  # [n bins, c bins] fitted log correction
        self.n_points = 0
        self.version = 0  # bumped whenever the table changes (a cache of its factors compares it)

    def fit(self, n: np.ndarray, c: np.ndarray, log_ratio: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Refit the whole table from observations ``n`` [P], ``c`` [P], ``log_ratio`` [P] (log of
        measured over roofline seconds) with optional ``weights`` [P] (recency)."""
        n, c, r = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (n, c, log_ratio))
        w = np.ones_like(r) if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        if not (n.shape == c.shape == r.shape == w.shape):
            raise InvalidInputError("n, c, log_ratio and weights must have the same length")
        ok = np.isfinite(r) & np.isfinite(w) & (w > 0)
        n, c, r, w = n[ok], c[ok], np.clip(r[ok], -self.max_abs_log, self.max_abs_log), w[ok]
        bn, bc = _n_bin(n), _c_bin(c)
        robust = np.ones_like(r)
        for _ in range(_ROBUST_ITERATIONS):  # Cauchy reweighting: a few slow outliers cannot move a cell
            self._table = self._cells(bn, bc, r, w * robust)
            dev = r - self._table[bn, bc]
            scale = max(_MAD_TO_SIGMA * float(np.median(np.abs(dev))) if dev.size else 0.0, _MIN_SCALE)
            robust = 1.0 / (1.0 + (dev / (_CAUCHY_C * scale)) ** 2)
        self.n_points = int(r.size)
        self.version += 1

    def _cells(self, bn: np.ndarray, bc: np.ndarray, r: np.ndarray, w: np.ndarray) -> np.ndarray:
        """Shrunk weighted means per cell [n bins, c bins] from binned observations."""
        cells_w = np.zeros((_N_BINS, _C_BINS))
        cells_wr = np.zeros((_N_BINS, _C_BINS))
        np.add.at(cells_w, (bn, bc), w)
        np.add.at(cells_wr, (bn, bc), w * r)
        col_w, col_wr = cells_w.sum(axis=1), cells_wr.sum(axis=1)  # [n bins]
        column = col_wr / (col_w + self.strength)  # shrunk towards 0
        # each cell: its column plus the cell's own departure from it, shrunk towards 0
        return column[:, None] + (cells_wr - cells_w * column[:, None]) / (cells_w + self.strength)

    def log_correction(self, n: np.ndarray, c: np.ndarray | int) -> np.ndarray:
        """``r(n, c)`` for ``n`` [N] and ``c`` (a scalar or [N]) -> [N] log multipliers."""
        n = np.asarray(n, dtype=np.float64)
        c = np.broadcast_to(np.asarray(c, dtype=np.float64), n.shape)
        return self._table[_n_bin(n), _c_bin(c)]

    def context_bin(self, c: int) -> int:
        """The context bin of one context length (the cells' column index): :func:`_c_bin` for one int,
        in scalar arithmetic (a step asks for it every time, where a NumPy call costs more)."""
        return min(int(math.floor(math.log2(c + 1.0) + 1e-9)), _C_BINS - 1)

    def factor(self, n: np.ndarray, c: np.ndarray | int) -> np.ndarray:
        """``exp(r(n, c))``: the multiplier to apply to roofline seconds."""
        return np.exp(self.log_correction(n, c))

    def factor_one(self, n: float, c: int) -> float:
        """:meth:`factor` of one size and one context, in scalar arithmetic (the latency model reads it
        for every timing it records, where each NumPy call costs more than the lookup)."""
        x = math.log2(n if n > 1.0 else 1.0) * _N_BINS_PER_OCTAVE
        i = min(int(math.floor(x + 1e-9)), _N_BINS - 1)
        return math.exp(float(self._table[i, self.context_bin(c)]))

    # ------------------------------------------------------------------ portable JSON
    def to_dict(self) -> dict[str, Any]:
        """Only the non-zero cells, as ``[n_bin, c_bin, log_correction]`` triples."""
        nz = np.argwhere(self._table != 0.0)
        cells = [[int(i), int(j), float(self._table[i, j])] for i, j in nz]
        return {"strength": self.strength, "n_bins_per_octave": _N_BINS_PER_OCTAVE, "cells": cells}

    @classmethod
    def from_dict(cls, data: Any) -> "ResidualTable":
        if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
            raise InvalidInputError("a residual table needs a 'cells' list")
        if data.get("n_bins_per_octave", _N_BINS_PER_OCTAVE) != _N_BINS_PER_OCTAVE:
            raise InvalidInputError("residual table was saved with a different grid")
        table = cls(strength=float(data.get("strength", 2.0)))
        for cell in data["cells"]:
            if not (isinstance(cell, list) and len(cell) == 3):
                raise InvalidInputError(f"residual cell must be [n_bin, c_bin, value], got {cell!r}")
            i, j, v = int(cell[0]), int(cell[1]), float(cell[2])
            if not (0 <= i < _N_BINS and 0 <= j < _C_BINS and math.isfinite(v)):
                raise InvalidInputError(f"residual cell out of range: {cell!r}")
            table._table[i, j] = v
        table.version += 1
        return table

    def __repr__(self) -> str:
        return f"ResidualTable(strength={self.strength}, points={self.n_points}, cells={int((self._table != 0).sum())})"
