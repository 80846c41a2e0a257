"""Discrete-event simulation of pipeline schedules (importing it never imports torch)."""

from unbubble.sim.costs import PipelineCosts, StageCosts, Straggler, UniformCosts
from unbubble.sim.engine import ActionRecord, Trace, run_policies

__all__ = ["UniformCosts", "PipelineCosts", "StageCosts", "Straggler", "ActionRecord", "Trace", "run_policies"]
