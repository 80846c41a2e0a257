"""GPT-2 as pipeline stages (``gpt2``) and the cost-balanced split into stages (``partition``)."""

from unbubble.models.gpt2 import (
    PRESETS,
    GPTConfig,
    GPTStage,
    component_seed,
    count_params,
    gpt_loss,
    make_config,
)
from unbubble.models.partition import (
    build_gpt_stages,
    component_costs,
    partition_by_cost,
    partition_layers,
    stage_costs,
)

__all__ = [
    "PRESETS",
    "GPTConfig",
    "GPTStage",
    "build_gpt_stages",
    "component_costs",
    "component_seed",
    "count_params",
    "gpt_loss",
    "make_config",
    "partition_by_cost",
    "partition_layers",
    "stage_costs",
]
