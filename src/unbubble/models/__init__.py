"""Decoders as pipeline stages, one file per architecture (``gpt2``, ``llama``, ``moe``), the presets of all
of them (``registry``) and the cost-balanced split into stages (``partition``)."""

from unbubble.models.gpt2 import (
    GPTConfig,
    GPTStage,
    component_seed,
    count_params,
    gpt_loss,
)
from unbubble.models.llama import LlamaConfig, LlamaStage
from unbubble.models.moe import MoEConfig, MoEStage, router_stats
from unbubble.models.partition import (
    BlockShape,
    block_shape,
    build_gpt_stages,
    build_stages,
    component_costs,
    embedding_params,
    final_norm_params,
    partition_by_cost,
    partition_layers,
    stage_costs,
)
from unbubble.models.registry import PRESETS, ModelConfig, make_config, stage_class

__all__ = [
    "PRESETS",
    "BlockShape",
    "GPTConfig",
    "GPTStage",
    "LlamaConfig",
    "LlamaStage",
    "MoEConfig",
    "MoEStage",
    "ModelConfig",
    "block_shape",
    "build_gpt_stages",
    "build_stages",
    "component_costs",
    "component_seed",
    "count_params",
    "embedding_params",
    "final_norm_params",
    "gpt_loss",
    "make_config",
    "partition_by_cost",
    "partition_layers",
    "router_stats",
    "stage_class",
    "stage_costs",
]
