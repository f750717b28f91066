"""Built-in budget controllers (``bastion``, ``fixed``) and the ``roofline`` latency model."""

from bastion.controllers.budget import BastionController, BastionDecision, FixedController
from bastion.controllers.latency import ModelCost
from bastion.controllers.latency import DevicePeaks, device_peaks
from bastion.controllers.latency import FitResult, RooflineParams, fit_roofline
from bastion.controllers.latency import RooflineLatency

__all__ = [
    "BastionController",
    "BastionDecision",
    "DevicePeaks",
    "FitResult",
    "FixedController",
    "ModelCost",
    "RooflineLatency",
    "RooflineParams",
    "device_peaks",
    "fit_roofline",
]
