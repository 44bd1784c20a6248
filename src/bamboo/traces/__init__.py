"""Preemption traces: loading and generating them (`trace`) and replaying one on a run
(`replay`); torch-free."""
from bamboo.traces.trace import Trace, TraceError, generate_synthetic, load_trace

__all__ = ["Trace", "TraceError", "generate_synthetic", "load_trace"]
