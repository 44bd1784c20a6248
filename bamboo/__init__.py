"""Bamboo: pipeline-parallel training that survives spot-instance preemptions."""
__version__ = "0.1.0"
