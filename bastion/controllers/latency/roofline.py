"""The ``roofline`` latency model: verify time from the target's shape, the device's peaks and an
online fit of the measured verify times.

    T_verify(n, c) = max(a_c * flops(n, c) / peak_flops + b_c,  a_m * bytes(n, c) / bandwidth + b_m)

Before any observation the parameters come from a saved profile for this device and model, or from a
prior (60% of peak compute, 80% of peak bandwidth, a per-layer fixed cost), which already orders sizes
sensibly. Every verify the pipeline times is recorded; the parameters are refitted every few steps with
the robust, recency-weighted fit of :mod:`bastion.controllers.latency.fit`. After each refit a
:class:`~bastion.controllers.latency.residual.ResidualTable` learns what the two lines cannot follow
(steps of the real cost curve over n and context) from the same timings, and multiplies predictions.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Sequence

import numpy as np
import torch

from bastion.controllers.latency.cost import ModelCost
from bastion.controllers.latency.devices import DevicePeaks, device_name, device_peaks
from bastion.controllers.latency.fit import FitResult, RooflineParams, fit_roofline
from bastion.controllers.latency.profiles import default_profile_path, load_profile, save_profile
from bastion.controllers.latency.residual import ResidualTable
from bastion.utils.checks import check_int, check_number
from bastion.contract.errors import InvalidInputError
from bastion.utils.files import warn_cache
from bastion.contract.interfaces import LatencyModel
from bastion.utils.running import RobustLevel

if TYPE_CHECKING:
    from bastion.contract.target import Target

__all__ = ["RooflineLatency", "prior_params"]

#: fixed cost per decoder layer of one forward (kernel launches, framework overhead), by device type
_LAYER_OVERHEAD_S = {"cuda": 3e-5, "cpu": 1e-4}
_PRIOR_COMPUTE_EFFICIENCY = 0.6
_PRIOR_MEMORY_EFFICIENCY = 0.8


def prior_params(num_layers: int, device_type: str) -> RooflineParams:
    """Parameters to use before any measurement on this device."""
    b = num_layers * _LAYER_OVERHEAD_S.get(device_type, _LAYER_OVERHEAD_S["cuda"])
    return RooflineParams(1.0 / _PRIOR_COMPUTE_EFFICIENCY, b, 1.0 / _PRIOR_MEMORY_EFFICIENCY, b)


#: timings up to which a refit tries 3 starting splits of the two branches besides the current fit (the
#: early fits, where the split is least settled); later refits try 2. A refit runs inside a decode step,
#: so each start costs the step about half a millisecond on a CPU
_MANY_STARTS_UNTIL = 16


class RooflineLatency(LatencyModel):
    """Roofline verify-latency model calibrated online from observed verify times.

    Options (all keyword): ``model_config`` (HF config or dict; or pass ``cost``; default: the bound
    target's), ``device`` (where the target runs; default: the bound target's, else CPU), ``dtype``
    (overrides the config's; default: the bound target's), ``peak_flops`` / ``bandwidth`` (override device
    peaks), ``probe`` (allow the cached CPU / unknown-device micro-benchmark; default: unless
    ``BASTION_NO_DEVICE_PROBE=1``), ``params`` (start from these parameters), ``profile`` (``"auto"``:
    the user cache's profile file; a path; or ``None`` to ignore saved profiles), ``half_life``
    (observations after which an old timing counts half), ``window`` (timings kept), ``refit_every``,
    ``min_observations`` (timings before the first fit), ``online`` (False: never refit), ``residual``
    (learn the correction table over (n, context) on top of the roofline; default True),
    ``shift_ratio`` / ``shift_run`` (robustness: predictions are the fit times a load factor, the robust
    level of recent measured / modelled times; a timing more than ``shift_ratio`` off it is held out of
    the fit unless ``shift_run`` in a row are, which is a lasting change the load follows; ``shift_run=0``
    fits every timing as it comes).
    """

    def __init__(
        self,
        model_config: Any = None,
        device: str | torch.device | None = None,
        *,
        dtype: Any = None,
        cost: ModelCost | None = None,
        peak_flops: float | None = None,
        bandwidth: float | None = None,
        probe: bool | None = None,
        params: RooflineParams | dict[str, float] | None = None,
        profile: str | Path | None | Literal["auto"] = "auto",
        half_life: float = 128.0,
        window: int = 512,
        refit_every: int = 32,
        min_observations: int = 6,
        online: bool = True,
        residual: bool = True,
        shift_ratio: float = 1.5,
        shift_run: int = 4,
    ) -> None:
        check_number("half_life", half_life, strict=True)
        for name, value in (("window", window), ("refit_every", refit_every), ("min_observations", min_observations)):
            check_int(name, value)
        if window < min_observations:
            raise InvalidInputError(f"window ({window}) must be >= min_observations ({min_observations})")
        self.half_life = float(half_life)
        if not (check_number("shift_ratio", shift_ratio, strict=True) > 1.0):
            raise InvalidInputError(f"shift_ratio must be > 1, got {shift_ratio!r}")
        self.shift_ratio = float(shift_ratio)
        self.shift_run = check_int("shift_run", shift_run, low=0)  # 0: every timing enters the fit
        self.refit_every = refit_every
        self.min_observations = min_observations
        self.online = online
        self.use_residual = bool(residual)
        self.profile_path: Path | None = default_profile_path() if profile == "auto" else (Path(profile) if profile else None)
        self._given = {"model_config": model_config, "device": device, "dtype": dtype, "cost": cost}
        self._peak_options = {"peak_flops": peak_flops, "bandwidth": bandwidth, "probe": probe}
        self._given_params = RooflineParams(**params) if isinstance(params, dict) else params
        self._window = window
        self.cost: ModelCost | None = None
        self._count = 0
        if cost is not None or model_config is not None:
            self._setup(cost or ModelCost.from_config(model_config, dtype), torch.device(device or "cpu"))

    def bind(self, target: "Target") -> None:
        """Read the target's config, device and dtype (options given at construction win)."""
        given = self._given
        cost = given["cost"] or ModelCost.from_config(
            given["model_config"] if given["model_config"] is not None else target.config,
            given["dtype"] if given["dtype"] is not None else target.dtype,
        )
        device = torch.device(given["device"] if given["device"] is not None else target.device)
        if self.cost is None or cost.signature != self.cost.signature or device != self.device:
            self._setup(cost, device)

    def _setup(self, cost: ModelCost, device: torch.device) -> None:
        """Peaks, prior parameters and an empty observation window for ``cost`` on ``device``."""
        self.cost = cost
        self.device = device
        self.device_label = device_name(self.device)
        params = self._given_params
        saved = self._read_saved_profile() if params is None else None
        peak_flops, bandwidth = self._peak_options["peak_flops"], self._peak_options["bandwidth"]
        if peak_flops is not None or bandwidth is not None:
            base = device_peaks(self.device, _dtype_of(cost), probe=False) if (peak_flops is None or bandwidth is None) else None
            self.peaks = DevicePeaks(
                peak_flops if peak_flops is not None else base.flops_per_s,  # type: ignore[union-attr]
                bandwidth if bandwidth is not None else base.bytes_per_s,  # type: ignore[union-attr]
                name=self.device_label,
                source="given",
            )
        elif saved is not None:
            peaks = saved["peaks"]
            self.peaks = DevicePeaks(peaks["flops_per_s"], peaks["bytes_per_s"], name=self.device_label, source="profile")
        else:
            self.peaks = device_peaks(self.device, _dtype_of(cost), probe=self._peak_options["probe"])

        if params is None and saved is not None:
            params = RooflineParams(**saved["params"])
        self.prior = params if params is not None else prior_params(cost.num_layers, self.device.type)
        self.params = self.prior
        self.last_fit: FitResult | None = None
        # plain floats: a step's own observation is scalar arithmetic, sizes arrays broadcast against them
        self._coef_c = tuple(float(x) / self.peaks.flops_per_s for x in cost.flops_coeffs)  # seconds per (n, n*m)
        self._coef_m = tuple(float(x) / self.peaks.bytes_per_s for x in cost.bytes_coeffs)  # seconds per (1, n, m, n*m)
        self._lines_cache: tuple[tuple[Any, ...], tuple[list[float], ...]] | None = None

        self._x_c = np.zeros(self._window)
        self._x_m = np.zeros(self._window)
        self._t = np.zeros(self._window)
        self._seq = np.zeros(self._window)
        self._n = np.zeros(self._window)  # verified tokens per observation (residual grid)
        self._c = np.zeros(self._window)  # context length per observation (residual grid)
        self._w = np.ones(self._window)  # per-observation weight: 0 held out (an isolated outlier)
        self._l = np.ones(self._window)  # the load factor each timing ran under
        self._cells: dict[tuple[int, int], RobustLevel] = {}  # recent measured / modelled per (size, context) cell
        self._load = RobustLevel(run=max(1, self.shift_run), tolerance=self.shift_ratio - 1.0)  # measured / modelled
        self.shifts = 0  # lasting changes detected
        self.held_out = 0  # isolated outliers kept out of the fit
        self.residual = ResidualTable()
        if saved is not None and self.use_residual and saved.get("residual") is not None:
            self.residual = ResidualTable.from_dict(saved["residual"])
        self._count = 0

    def _require_bound(self) -> None:
        if self.cost is None:
            raise InvalidInputError(
                "the roofline latency model knows no model yet: pass model_config= (or cost=), or bind it to a "
                "target (a Pipeline does this)"
            )

    # ------------------------------------------------------------------ prediction
    def ideal_times(self, n_tokens: np.ndarray, context_len: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Ideal compute and memory seconds ``(x_c, x_m)`` at the device peaks; ``n_tokens`` [N] and
        ``context_len`` (a scalar or an array [N]) broadcast together."""
        self._require_bound()
        n = n_tokens if isinstance(n_tokens, float) else np.asarray(n_tokens, dtype=np.float64)  # one step: a float
        m = context_len + n
        f_n, f_nm = self._coef_c
        g0, g_n, g_m, g_nm = self._coef_m
        return n * (f_n + f_nm * m), g0 + g_n * n + m * (g_m + g_nm * n)

    def roofline_seconds(self, n_tokens: np.ndarray, context_len: int | np.ndarray) -> np.ndarray:
        """The two-line roofline alone (no residual), seconds [N]."""
        x_c, x_m = self.ideal_times(n_tokens, context_len)
        return self.params.predict(x_c, x_m)

    def _lines(self, n: np.ndarray, context_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Both branches of the corrected prediction for sizes ``n`` [N] as lines in the context ``c``:
        ``T(n, c) = max(p_c + c * q_c, p_m + c * q_m)`` (each [N]), exact within ``context_len``'s
        context bin. Ideal compute and memory times are affine in ``c`` for a fixed ``n``, and the
        residual factor (> 0, constant within a context bin) scales both branches of the max."""
        _, f_nm = self._coef_c
        _, _, g_m, g_nm = self._coef_m
        p = self.params
        scale = self.residual.factor(n, context_len) if self.use_residual else 1.0
        x_c0, x_m0 = self.ideal_times(n, 0)  # [N] each, the ideal times at c = 0
        # their slopes in c (see ideal_times): x_c grows by n f_nm per context token, x_m by g_m + g_nm n
        p_c, q_c = (p.a_c * x_c0 + p.b_c) * scale, p.a_c * f_nm * n * scale
        p_m, q_m = (p.a_m * x_m0 + p.b_m) * scale, p.a_m * (g_m + g_nm * n) * scale
        return p_c, q_c, p_m, q_m

    def _cached_lines(self, n_tokens: torch.Tensor, context_len: int) -> tuple[list[float], ...]:
        """:meth:`_lines` for a sizes tensor as host float lists, remembered while the same sizes,
        parameters, residual table and context bin come back: a controller asks for its same candidate
        sizes every step, and the per-step prediction is then two multiply-adds and a maximum per size."""
        sizes = tuple(n_tokens.tolist())  # host ints from any device, with or without autograd
        key = (sizes, self.params, self.residual, self.residual.version, self.use_residual, self.residual.context_bin(context_len))
        cached = self._lines_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        lines = tuple(x.tolist() for x in self._lines(np.array(sizes, dtype=np.float64), context_len))
        self._lines_cache = (key, lines)
        return lines

    def ideal_batch_times(self, widths: np.ndarray, context_lens: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Ideal ``(x_c, x_m)`` seconds of one batched verify: ``B = len(context_lens)`` rows, each with a
        padded block of ``widths`` [N] slots after a padded cache of ``S = max(context_lens)`` slots.
        Weights are read once per forward; tokens, KV reads and attention grow with ``B x W``. For one
        row this is :meth:`ideal_times`."""
        self._require_bound()
        return self._batch_ideal(np.asarray(widths, dtype=np.float64), float(len(context_lens)), float(max(context_lens)))

    def _batch_ideal(self, w: Any, b: float, s: float) -> tuple[Any, Any]:
        """:meth:`ideal_batch_times` for widths ``w`` (an array [N], or one float), ``b`` rows and a
        padded cache of ``s`` slots."""
        m = s + w  # keys every slot attends over (padded)
        f_n, f_nm = self._coef_c
        g0, g_n, g_m, g_nm = self._coef_m
        return b * w * (f_n + f_nm * m), g0 + b * (g_n * w + m * (g_m + g_nm * w))

    def predict_batch(self, widths: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        """Seconds of one batched verify (see :meth:`ideal_batch_times`); the residual table is read at
        ``B * W`` tokens after the longest context. One row: :meth:`predict_many`'s cached lines."""
        if len(context_lens) == 1:
            return self.predict_many(widths, int(context_lens[0]))
        w = widths.detach().cpu().numpy().astype(np.float64)
        x_c, x_m = self.ideal_batch_times(w, context_lens)
        base = self.params.predict(x_c, x_m) * self.load
        if not self.use_residual:
            return torch.from_numpy(base)
        return torch.from_numpy(base * self.residual.factor(w * len(context_lens), max(context_lens)))

    def observe_batch(self, width: int, context_lens: Sequence[int], seconds: float) -> None:
        if not _usable(seconds):
            return
        self._require_bound()
        # one width in floats, not arrays: every step records one timing
        x_c, x_m = self._batch_ideal(float(width), float(len(context_lens)), float(max(context_lens)))
        self._record(float(x_c), float(x_m), float(seconds), width * len(context_lens), max(context_lens))

    def predict(self, n_tokens: int, context_len: int) -> float:
        self._require_bound()
        p_c, q_c, p_m, q_m = self._lines(np.array([n_tokens], dtype=np.float64), context_len)
        return float(max(p_c[0] + context_len * q_c[0], p_m[0] + context_len * q_m[0])) * self.load

    def predict_many(self, n_tokens: torch.Tensor, context_len: int) -> torch.Tensor:
        """``n_tokens`` LongTensor[N] -> FloatTensor[N] (float64, CPU) seconds."""
        self._require_bound()
        c = float(context_len)
        load = self.load
        lines = zip(*self._cached_lines(n_tokens, context_len))
        # the larger branch (a NaN in either propagates, as np.maximum would); floats, not NumPy: see _cached_lines
        seconds = [(x if x > y or x != x else y) * load for x, y in ((pc + c * qc, pm + c * qm) for pc, qc, pm, qm in lines)]
        return torch.tensor(seconds, dtype=torch.float64)

    # ------------------------------------------------------------------ online calibration
    @property
    def n_observations(self) -> int:
        return 0 if self.cost is None else self._count

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        if not _usable(seconds):
            return  # a clock glitch carries no information
        x_c, x_m = self.ideal_times(float(n_tokens), context_len)
        self._record(float(x_c), float(x_m), float(seconds), n_tokens, context_len)

    @property
    def load(self) -> float:
        """The current load factor: recent measured / modelled verify time (1 before any timing). The
        fit describes the machine's shape; the load its present speed (a neighbour's work, a clock)."""
        return self._load.value if self._load else 1.0

    def _base(self, x_c: float, x_m: float, n_tokens: int, context_len: int) -> float:
        """The fitted model's seconds for one timing's ideal times, without the load factor."""
        p = self.params
        seconds = max(p.a_c * x_c + p.b_c, p.a_m * x_m + p.b_m)
        if self.use_residual:
            seconds *= self.residual.factor_one(float(n_tokens), context_len)
        return seconds

    def _record(self, x_c: float, x_m: float, seconds: float, n_tokens: int, context_len: int) -> None:
        """Store one timing with its ideal times, its residual-grid key (tokens, context) and the load
        it ran under.

        The load factor is a robust level (:class:`~bastion.utils.running.RobustLevel`) of measured /
        modelled time: the median of recent timings, so a burst of foreign load does not move it, and a
        run of ``shift_run`` timings more than ``shift_ratio`` off it on one side (a lasting change)
        restarts it from that run. A timing that far off the load while no change is under way is held
        out of the fit; the fit itself learns from load-normalised timings, so the machine's shape
        stays what calm timings say while predictions follow the load."""
        if self._count >= self.min_observations and self.shift_run > 0:
            ratio = seconds / max(self._base(x_c, x_m, n_tokens, context_len), 1e-12)
            before = self.load
            shifted = self._load.observe(ratio)
            # the cell's own recent timings: a size the fit gets wrong is wrong every time (structure the
            # fit must learn), a burst is off against those timings too
            cell_key = (int(n_tokens).bit_length(), self.residual.context_bin(context_len))
            cell = self._cells.get(cell_key)
            if cell is None:
                cell = self._cells[cell_key] = RobustLevel(window=5, run=3, tolerance=self.shift_ratio - 1.0)
            known = cell.count >= 3
            cell_before = cell.value
            cell.observe(ratio)
            off = ratio > before * self.shift_ratio or ratio * self.shift_ratio < before
            off_cell = known and (ratio > cell_before * self.shift_ratio or ratio * self.shift_ratio < cell_before)
            held = off and off_cell and not shifted and self._load.streak > 0  # isolated (so far): out of the fit
            if shifted:
                self.shifts += 1
        else:
            held = False
        i = self._count % self._t.size
        self._x_c[i], self._x_m[i], self._t[i], self._seq[i] = x_c, x_m, seconds, self._count
        self._n[i], self._c[i] = n_tokens, context_len
        self._w[i] = 0.0 if held else 1.0
        self._l[i] = self.load
        self.held_out += int(held)
        self._count += 1
        if self.online and self._due(self._count):
            self.refit()

    def _due(self, count: int) -> bool:
        if count < self.min_observations:
            return False
        since = count - self.min_observations
        return since in (0, 2, 6, 14) or since % self.refit_every == 0

    def refit(self) -> FitResult | None:
        """Fit the parameters to the stored timings now (the pipeline's observations trigger this on a
        schedule). Returns the fit, or ``None`` when there are fewer than ``min_observations`` timings."""
        if self.cost is None:
            return None
        k = min(self._count, self._t.size)
        if k < self.min_observations:
            return None
        age = (self._count - 1) - self._seq[:k]
        weights = np.exp2(-age / self.half_life) * self._w[:k]
        if not np.any(weights > 0):
            return None
        t_norm = self._t[:k] / self._l[:k]  # [k] what each timing would have been at load 1
        fit = fit_roofline(
            self._x_c[:k],
            self._x_m[:k],
            t_norm,
            weights,
            prior=self.prior,
            init=self.params,
            starts=3 if self._count <= _MANY_STARTS_UNTIL else 2,
        )
        self.params = fit.params
        self.last_fit = fit
        if self.use_residual:  # what the two lines leave over, on the same recency weights
            base = self.params.predict(self._x_c[:k], self._x_m[:k])
            self.residual.fit(self._n[:k], self._c[:k], np.log(t_norm / base), weights)
        if self.shift_run > 0:
            self._relevel(k)
        return fit

    def _relevel(self, k: int) -> None:
        """Re-read the load factor from the latest timings against the new fit (its scale may have
        moved), keeping the held-out ones out."""
        order = np.argsort(self._seq[:k])[-self._load.window :]  # [<= window] the latest timings, oldest first
        level = RobustLevel(run=self._load.run, tolerance=self._load.tolerance)
        for i in order:
            if self._w[i] > 0:
                level.observe(self._t[i] / max(self._base(self._x_c[i], self._x_m[i], int(self._n[i]), int(self._c[i])), 1e-12))
        if level:
            self._load = level

    def warmup(
        self, measure: Callable[[int, int], float], sizes: Iterable[int] = (1, 4, 16, 64), context_lens: Iterable[int] = (0,)
    ) -> FitResult | None:
        """Optional short probe: observe ``measure(n, c)`` seconds for each size and context, then fit."""
        for c in context_lens:
            for n in sizes:
                self.observe(int(n), int(c), float(measure(int(n), int(c))))
        return self.refit()

    def observations(self) -> dict[str, np.ndarray]:
        """The stored timings (oldest first): ideal compute / memory seconds and measured seconds."""
        k = min(self._count, self._t.size)
        order = np.argsort(self._seq[:k], kind="stable")
        return {"x_c": self._x_c[:k][order], "x_m": self._x_m[:k][order], "seconds": self._t[:k][order]}

    # ------------------------------------------------------------------ profiles
    def save_profile(self, path: str | Path | None = None) -> Path:
        """Save parameters and peaks under this device and model (default: the model's profile path)."""
        self._require_bound()
        assert self.cost is not None
        target = Path(path) if path is not None else (self.profile_path or default_profile_path())
        fit = self.last_fit
        load = self.load  # folded into the lines (both scale with it), so the saved profile predicts what this model does
        p = self.params
        entry = {
            "params": RooflineParams(p.a_c * load, p.b_c * load, p.a_m * load, p.b_m * load).as_dict(),
            "peaks": {"flops_per_s": self.peaks.flops_per_s, "bytes_per_s": self.peaks.bytes_per_s, "source": self.peaks.source},
            "fit": None if fit is None else {"median_rel_error": fit.median_rel_error, "n_points": fit.n_points},
            "residual": self.residual.to_dict() if self.use_residual else None,
        }
        return save_profile(target, self.device_label, self.cost.signature, entry)

    def _read_saved_profile(self) -> dict[str, Any] | None:
        if self.profile_path is None or self.cost is None:
            return None
        entry = load_profile(self.profile_path, self.device_label, self.cost.signature)
        if entry is None:
            return None
        try:  # the profile file is an optional cache: a malformed entry is ignored, never fatal
            RooflineParams(**entry["params"])
            peaks = entry["peaks"]
            if not all(isinstance(peaks[k], (int, float)) and math.isfinite(peaks[k]) and peaks[k] > 0 for k in ("flops_per_s", "bytes_per_s")):
                raise ValueError("peaks must be finite positive numbers")
        except (KeyError, TypeError, ValueError) as exc:
            warn_cache(f"latency profile for {self.device_label} in {self.profile_path} is malformed ({exc!r})")
            return None
        return entry

    def __repr__(self) -> str:
        if self.cost is None:
            return "RooflineLatency(unbound)"
        p = self.params
        return (
            f"RooflineLatency({self.cost.signature} on {self.device_label!r}, a_c={p.a_c:.3g}, b_c={p.b_c:.3g}s, "
            f"a_m={p.a_m:.3g}, b_m={p.b_m:.3g}s, observations={self._count})"
        )


def _usable(seconds: float) -> bool:
    return isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0


def _dtype_of(cost: ModelCost) -> torch.dtype:
    return {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[cost.bytes_per_param]
