"""Discrete-event simulation of pipeline schedules (no torch)."""

from unbubble.sim.costs import UniformCosts
from unbubble.sim.engine import ActionRecord, Trace, run_policies

__all__ = ["UniformCosts", "ActionRecord", "Trace", "run_policies"]
