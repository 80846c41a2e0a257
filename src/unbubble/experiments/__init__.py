"""Experiments that reproduce the seed papers' claims at small scale (``unbubble experiment NAME``)."""

from unbubble.experiments import studies, overhead, horizon, pays, clip, paci, moe  # noqa: F401,I001 - registration order = listing order
from unbubble.experiments.common import (EXPERIMENTS, ExperimentOutput, get_experiment, publish, update_results,
                                         write_section)

__all__ = ["EXPERIMENTS", "ExperimentOutput", "get_experiment", "publish", "update_results", "write_section"]
