"""Built-in budget controllers (``bastion``, ``fixed``) and the ``roofline`` latency model."""

from bastion.controllers.budget import BastionController, BastionDecision, FixedController
from bastion.controllers.cost import ModelCost
from bastion.controllers.devices import DevicePeaks, device_peaks
from bastion.controllers.fit import FitResult, RooflineParams, fit_roofline
from bastion.controllers.roofline import RooflineLatency

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
