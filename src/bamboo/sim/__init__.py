"""Trace-driven simulator of training on preemptible instances (``bamboo simulate``); torch-free."""

from bamboo.traces.trace import Trace, TraceError, generate_synthetic, load_trace

from .core import RunResult, SimConfig
from .cost_presets import SIM_MODELS, SimModel, get_preset
from .costs import StepCosts, load_costs

__all__ = [
    "RunResult",
    "SimConfig",
    "StepCosts",
    "load_costs",
    "SIM_MODELS",
    "SimModel",
    "get_preset",
    "Trace",
    "TraceError",
    "generate_synthetic",
    "load_trace",
]
