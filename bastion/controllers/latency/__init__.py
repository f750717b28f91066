"""Latency modelling: the ``roofline`` latency model, its cost model, device peaks, fitting,
calibration and saved profiles."""

from bastion.controllers.latency.cost import ModelCost
from bastion.controllers.latency.devices import DevicePeaks, device_peaks
from bastion.controllers.latency.fit import FitResult, RooflineParams, fit_roofline
from bastion.controllers.latency.roofline import RooflineLatency

__all__ = ["DevicePeaks", "FitResult", "ModelCost", "RooflineLatency", "RooflineParams", "device_peaks", "fit_roofline"]
