"""Every model preset by name, and the architecture that builds it (``--model``)."""

from __future__ import annotations

from typing import Union

from unbubble.errors import ConfigError, did_you_mean
from unbubble.models import gpt2, llama, moe
from unbubble.models.gpt2 import GPTConfig, GPTStage
from unbubble.models.llama import LlamaConfig, LlamaStage
from unbubble.models.moe import MoEConfig, MoEStage

ModelConfig = Union[GPTConfig, LlamaConfig, MoEConfig]

#: config class -> (stage class, presets, vocabulary of the published presets when no tokenizer gives one)
_FAMILIES: dict[type, tuple[type, dict, int]] = {
    GPTConfig: (GPTStage, gpt2.PRESETS, 50_257),  # GPT-2 BPE
    LlamaConfig: (LlamaStage, llama.PRESETS, llama.PUBLISHED_VOCAB),  # Llama 3's tokenizer
    MoEConfig: (MoEStage, moe.PRESETS, 32_000),  # Mixtral's (Llama 2's) tokenizer
}
#: preset name -> config class
FAMILY_OF: dict[str, type] = {name: cls for cls, (_, presets, _) in _FAMILIES.items() for name in presets}
PRESETS: dict[str, dict] = {name: presets[name] for _, presets, _ in _FAMILIES.values() for name in presets}


def check_preset(preset: str) -> None:
    """Raises ConfigError unless ``preset`` names a model of ``PRESETS`` (with a did-you-mean)."""
    if preset not in PRESETS:
        raise ConfigError(f"model={preset!r} is invalid{did_you_mean(preset, PRESETS)}: must be one of "
                          f"{', '.join(PRESETS)} (set --model)")


def make_config(preset: str, vocab_size: int | None = None, block_size: int | None = None) -> ModelConfig:
    """The config of a named preset of any family.

    Args:
        preset: a name of ``PRESETS`` (``tiny`` … ``gpt2-xl``, ``llama-tiny`` … ``llama-8b``, ``moe-tiny``,
            ``moe-deep-cpu``, ``mixtral-8x7b``).
        vocab_size: V from the tokenizer; None takes the published model's (GPT-2 50257, Llama 3 128256,
            Mixtral 32000).
        block_size: overrides the preset's maximum sequence length T.

    Returns:
        A validated ``GPTConfig``, ``LlamaConfig`` or ``MoEConfig``.

    Raises:
        ConfigError: unknown preset (the message lists the valid names) or invalid sizes.
    """
    check_preset(preset)
    cls = FAMILY_OF[preset]
    kwargs = dict(PRESETS[preset])
    if block_size is not None:
        kwargs["block_size"] = block_size
    return cls(**kwargs, vocab_size=_FAMILIES[cls][2] if vocab_size is None else vocab_size)


def stage_class(config: ModelConfig) -> type:
    """The ``nn.Module`` class whose instances are the stages of ``config``'s architecture.

    Raises:
        ConfigError: ``config`` is not a config of a known family.
    """
    if type(config) not in _FAMILIES:
        raise ConfigError(f"config of type {type(config).__name__} is invalid: must be one of "
                          f"{', '.join(c.__name__ for c in _FAMILIES)}")
    return _FAMILIES[type(config)][0]
