"""Built-in budget controllers (``bastion``, ``fixed``), acceptance calibration, the speculation gate and
the ``roofline`` latency model."""

from bastion.controllers.budget import BastionController, BastionDecision, FixedController
from bastion.controllers.calibration import AcceptanceCalibrator, CalibrationTable, sampling_key
from bastion.controllers.gate import SpeculationGate
from bastion.controllers.latency import ModelCost
from bastion.controllers.latency import DevicePeaks, device_peaks
from bastion.controllers.latency import FitResult, RooflineParams, fit_roofline
from bastion.controllers.latency import RooflineLatency

__all__ = [
    "AcceptanceCalibrator",
    "BastionController",
    "BastionDecision",
    "CalibrationTable",
    "DevicePeaks",
    "FitResult",
    "FixedController",
    "ModelCost",
    "RooflineLatency",
    "RooflineParams",
    "SpeculationGate",
    "device_peaks",
    "fit_roofline",
    "sampling_key",
]
