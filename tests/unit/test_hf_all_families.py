"""Every causal-LM family the installed transformers registers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``),
as a tiny random-init model with its distinctive features switched on (``unbubble.models.hf_zoo``), has
the verdict the table below records:

* ``exact``: split_model splits it, and 1F1B-flush on 2 and 4 stages (the emulator, 2 updates × 2
  micro-batches, a padding mask) ends with the very losses and weights of the *unsplit* model's own
  training loop (``hf_zoo.train_unsplit``: ``model(**batch).logits``, torch's cross-entropy, one
  AdamW; nothing of unbubble); PACI (a=2) on 4 stages attains its drift bound ⌈(N−i)/a⌉; and every
  feature listed changes the logits when switched off (so the equality is not vacuous);
* ``refused``: split_model refuses it with this one line;
* ``cannot run unsplit``: the unsplit model's own forward/backward fails on the CPU in fp32 (this error);
* ``not a decoder``: encoder-decoders and composite (multimodal) configs, classified, not trained.

A new transformers that registers another family fails the first test until the table names it
(``python benchmarks/hf_families.py --update-test`` regenerates the table; review its diff).
"""

import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")  # the [hf] extra; CI installs it

from unbubble.models import hf_zoo  # noqa: E402

# --- verdicts: begin (benchmarks/hf_families.py --update-test) ---
VERDICTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    'afmoe': ('refused', "model_type 'afmoe' (AfmoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'apertus': ('refused', "model_type 'apertus' (ApertusForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'apertus1p5_text': ('refused', "model_type 'apertus1p5_text' (Apertus1p5TextForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'arcee': ('refused', "model_type 'arcee' (ArceeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'aria_text': ('refused', "model_type 'aria_text' (AriaTextForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'axk1': ('refused', "model_type 'axk1' (AXK1ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'axk2': ('refused', "model_type 'axk2' (AXK2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'bailing_hybrid': ('refused', "model_type 'bailing_hybrid' (BailingHybridForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'bamba': ('refused', "model_type 'bamba' (BambaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'bart': ('not a decoder', 'encoder-decoder', ()),
    'beam': ('refused', "model_type 'beam' (BeamForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'bert': ('refused', "model_type 'bert' (BertLMHeadModel) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'bert-generation': ('refused', "model_type 'bert-generation' (BertGenerationDecoder) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'big_bird': ('refused', "model_type 'big_bird' (BigBirdForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'bigbird_pegasus': ('not a decoder', 'encoder-decoder', ()),
    'biogpt': ('refused', "model_type 'biogpt' (BioGptForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'bitnet': ('refused', "model_type 'bitnet' (BitNetForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'blenderbot': ('not a decoder', 'encoder-decoder', ()),
    'blenderbot-small': ('not a decoder', 'encoder-decoder', ()),
    'bloom': ('refused', "model_type 'bloom' (BloomForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'blt': ('not a decoder', 'multimodal composite (decoder_config, encoder_config, global_config, patcher_config)', ()),
    'camembert': ('refused', "model_type 'camembert' (CamembertForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'codegen': ('refused', "model_type 'codegen' (CodeGenForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'cohere': ('refused', "model_type 'cohere' (CohereForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'cohere2': ('refused', "model_type 'cohere2' (Cohere2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'cohere2_moe': ('refused', "model_type 'cohere2_moe' (Cohere2MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'cohere_compass_text': ('refused', "model_type 'cohere_compass_text' (CohereCompassForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'cpmant': ('refused', "model_type 'cpmant' (CpmAntForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'ctrl': ('refused', "model_type 'ctrl' (CTRLLMHeadModel) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'cwm': ('refused', "model_type 'cwm' (CwmForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'data2vec-text': ('refused', "model_type 'data2vec-text' (Data2VecTextForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'dbrx': ('refused', "model_type 'dbrx' (DbrxForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'deepseek_v2': ('refused', "model_type 'deepseek_v2' (DeepseekV2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'deepseek_v3': ('refused', "model_type 'deepseek_v3' (DeepseekV3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'deepseek_v32': ('refused', "model_type 'deepseek_v32' (DeepseekV32ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'deepseek_v4': ('refused', "model_type 'deepseek_v4' (DeepseekV4ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'diffllama': ('refused', "model_type 'diffllama' (DiffLlamaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'doge': ('refused', "model_type 'doge' (DogeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'dory': ('refused', "model_type 'dory' (DoryForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'dots1': ('refused', "model_type 'dots1' (Dots1ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'dots3_note': ('not a decoder', 'composite config: its text decoder is dots3_note_text', ()),
    'dots3_note_text': ('refused', "model_type 'dots3_note_text' (Dots3NoteForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'electra': ('refused', "model_type 'electra' (ElectraForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'emu3': ('not a decoder', 'multimodal composite (text_config, vq_config)', ()),
    'ergo': ('refused', "model_type 'ergo' (ErgoForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'ernie': ('refused', "model_type 'ernie' (ErnieForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'ernie4_5': ('refused', "model_type 'ernie4_5' (Ernie4_5ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'ernie4_5_moe': ('refused', "model_type 'ernie4_5_moe' (Ernie4_5_MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'exaone': ('refused', "model_type 'exaone' (LlamaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'exaone4': ('refused', "model_type 'exaone4' (Exaone4ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'exaone_moe': ('refused', "model_type 'exaone_moe' (ExaoneMoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'falcon': ('refused', "model_type 'falcon' (FalconForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'falcon_h1': ('refused', "model_type 'falcon_h1' (FalconH1ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'falcon_mamba': ('refused', "model_type 'falcon_mamba' (FalconMambaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'flex_olmo': ('refused', "model_type 'flex_olmo' (FlexOlmoForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'flint': ('refused', "model_type 'flint' (FlintForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'fuyu': ('not a decoder', 'multimodal (image patches into a Persimmon decoder)', ()),
    'gemma': ('exact', '', ()),
    'gemma2': ('exact', '', ('sliding window', 'final-logit soft-cap', 'query scalar', 'layer_types: sliding_attention/full_attention')),
    'gemma3': ('not a decoder', 'composite config: its text decoder is gemma3_text', ()),
    'gemma3_text': ('refused', "model_type 'gemma3_text' (Gemma3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gemma3n': ('not a decoder', 'composite config: its text decoder is gemma3n_text', ()),
    'gemma3n_text': ('refused', "model_type 'gemma3n_text' (Gemma3nForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gemma4': ('not a decoder', 'composite config: its text decoder is gemma4_text', ()),
    'gemma4_assistant': ('not a decoder', "speculative-decoding drafter (reads the target model's hidden states)", ()),
    'gemma4_text': ('refused', "model_type 'gemma4_text' (Gemma4ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gemma4_unified': ('not a decoder', 'composite config: its text decoder is gemma4_unified_text', ()),
    'gemma4_unified_assistant': ('not a decoder', "speculative-decoding drafter (reads the target model's hidden states)", ()),
    'gemma4_unified_text': ('refused', "model_type 'gemma4_unified_text' (Gemma4UnifiedForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'git': ('not a decoder', 'multimodal composite (vision_config)', ()),
    'glm': ('refused', "model_type 'glm' (GlmForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'glm4': ('refused', "model_type 'glm4' (Glm4ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'glm4_moe': ('refused', "model_type 'glm4_moe' (Glm4MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'glm4_moe_lite': ('refused', "model_type 'glm4_moe_lite' (Glm4MoeLiteForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'glm_moe_dsa': ('refused', "model_type 'glm_moe_dsa' (GlmMoeDsaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'got_ocr2': ('not a decoder', 'multimodal composite (text_config, vision_config)', ()),
    'gpt-sw3': ('differs', 'N=2: 8.89e-06, N=4: 8.89e-06', ()),
    'gpt2': ('differs', 'N=2: 8.89e-06, N=4: 8.89e-06', ()),
    'gpt_bigcode': ('refused', "model_type 'gpt_bigcode' (GPTBigCodeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gpt_neo': ('refused', "model_type 'gpt_neo' (GPTNeoForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gpt_neox': ('refused', "model_type 'gpt_neox' (GPTNeoXForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gpt_neox_japanese': ('refused', "model_type 'gpt_neox_japanese' (GPTNeoXJapaneseForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gpt_oss': ('refused', "model_type 'gpt_oss' (GptOssForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'gptj': ('refused', "model_type 'gptj' (GPTJForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'granite': ('refused', "model_type 'granite' (GraniteForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'granite_swa': ('refused', "model_type 'granite_swa' (GraniteSWAForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'granitemoe': ('refused', "model_type 'granitemoe' (GraniteMoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'granitemoe_swa': ('refused', "model_type 'granitemoe_swa' (GraniteMoeSWAForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'granitemoehybrid': ('refused', "model_type 'granitemoehybrid' (GraniteMoeHybridForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'granitemoeshared': ('refused', "model_type 'granitemoeshared' (GraniteMoeSharedForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'helium': ('refused', "model_type 'helium' (HeliumForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'hrm_text': ('refused', "model_type 'hrm_text' (HrmTextForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'hunyuan_v1_dense': ('refused', "model_type 'hunyuan_v1_dense' (HunYuanDenseV1ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'hunyuan_v1_moe': ('refused', "model_type 'hunyuan_v1_moe' (HunYuanMoEV1ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'hy_v3': ('refused', "model_type 'hy_v3' (HYV3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'hy_v4': ('refused', "model_type 'hy_v4' (HYV4ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'hyperclovax': ('refused', "model_type 'hyperclovax' (HyperCLOVAXForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'inkling2_loop_text': ('refused', "model_type 'inkling2_loop_text' (Inkling2LoopForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'inkling2_text': ('refused', "model_type 'inkling2_text' (Inkling2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'inkling_text': ('refused', "model_type 'inkling_text' (InklingForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'internlm3': ('refused', "model_type 'internlm3' (LlamaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'iquestcoder': ('refused', "model_type 'iquestcoder' (LlamaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'jais2': ('refused', "model_type 'jais2' (Jais2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'jamba': ('refused', "model_type 'jamba' (JambaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'jetmoe': ('refused', "model_type 'jetmoe' (JetMoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'kimi_linear': ('refused', "model_type 'kimi_linear' (KimiLinearForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'kolibri1': ('refused', "model_type 'kolibri1' (Kolibri1ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'kolibri1_1': ('refused', "model_type 'kolibri1_1' (Kolibri1_1ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'laguna': ('refused', "model_type 'laguna' (LagunaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'lara_mini': ('refused', "model_type 'lara_mini' (LaraMiniForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'lfm2': ('refused', "model_type 'lfm2' (Lfm2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'lfm2_moe': ('refused', "model_type 'lfm2_moe' (Lfm2MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'lfm3': ('refused', "model_type 'lfm3' (Lfm3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'llama': ('exact', '', ()),
    'llama4': ('not a decoder', 'composite config: its text decoder is llama4_text', ()),
    'llama4_text': ('refused', "model_type 'llama4_text' (Llama4ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'longcat_flash': ('refused', "model_type 'longcat_flash' (LongcatFlashForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'mamba': ('refused', "model_type 'mamba' (MambaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'mamba2': ('refused', "model_type 'mamba2' (Mamba2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'marian': ('not a decoder', 'encoder-decoder', ()),
    'mbart': ('not a decoder', 'encoder-decoder', ()),
    'megatron-bert': ('refused', "model_type 'megatron-bert' (MegatronBertForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'mellum': ('refused', "model_type 'mellum' (MellumForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'mimo_v2_flash': ('refused', "model_type 'mimo_v2_flash' (MiMoV2FlashForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'minicpm3': ('refused', "model_type 'minicpm3' (MiniCPM3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'minicpm5_moe': ('refused', "model_type 'minicpm5_moe' (MiniCPM5MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'minimax': ('refused', "model_type 'minimax' (MiniMaxForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'minimax_m2': ('refused', "model_type 'minimax_m2' (MiniMaxM2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'minimax_m3_vl_text': ('refused', "model_type 'minimax_m3_vl_text' (MiniMaxM3VLForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'ministral': ('refused', "model_type 'ministral' (MinistralForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'ministral3': ('refused', "model_type 'ministral3' (Ministral3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'mistral': ('exact', '', ('sliding window',)),
    'mixtral': ('exact', '', ('sliding window', 'MoE (2 of 4 experts)')),
    'mllama': ('not a decoder', 'multimodal composite (text_config, vision_config)', ()),
    'modernbert-decoder': ('refused', "model_type 'modernbert-decoder' (ModernBertDecoderForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'moshi': ('not a decoder', 'multimodal composite (audio_encoder_config, depth_decoder_config)', ()),
    'moss_transcribe_diarize': ('not a decoder', 'multimodal composite (audio_config, text_config)', ()),
    'mpt': ('refused', "model_type 'mpt' (MptForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'musicgen': ('not a decoder', 'encoder-decoder', ()),
    'musicgen_melody': ('not a decoder', 'encoder-decoder', ()),
    'mvp': ('not a decoder', 'encoder-decoder', ()),
    'nanochat': ('refused', "model_type 'nanochat' (NanoChatForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'nemotron': ('refused', "model_type 'nemotron' (NemotronForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'nemotron_h': ('refused', "model_type 'nemotron_h' (NemotronHForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'olmo': ('refused', "model_type 'olmo' (OlmoForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'olmo2': ('refused', "model_type 'olmo2' (Olmo2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'olmo3': ('refused', "model_type 'olmo3' (Olmo3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'olmo_hybrid': ('refused', "model_type 'olmo_hybrid' (OlmoHybridForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'olmoe': ('refused', "model_type 'olmoe' (OlmoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'openai-gpt': ('refused', "model_type 'openai-gpt' (OpenAIGPTLMHeadModel) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'opt': ('refused', "model_type 'opt' (OPTForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'param2moe': ('refused', "model_type 'param2moe' (Glm4MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'pegasus': ('not a decoder', 'encoder-decoder', ()),
    'persimmon': ('refused', "model_type 'persimmon' (PersimmonForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'phi': ('refused', "model_type 'phi' (PhiForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'phi3': ('exact', '', ('sliding window',)),
    'phi4_multimodal': ('not a decoder', 'multimodal composite (audio_config, vision_config)', ()),
    'phimoe': ('refused', "model_type 'phimoe' (PhimoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'plbart': ('not a decoder', 'encoder-decoder', ()),
    'prophetnet': ('not a decoder', 'encoder-decoder', ()),
    'qwen2': ('exact', '', ('sliding window', 'layer_types: full_attention/sliding_attention')),
    'qwen2_moe': ('exact', '', ('sliding window', 'layer_types: sliding_attention/full_attention', 'MoE (2 of 4 experts)')),
    'qwen3': ('exact', '', ('sliding window', 'layer_types: full_attention/sliding_attention')),
    'qwen3_5': ('not a decoder', 'composite config: its text decoder is qwen3_5_text', ()),
    'qwen3_5_moe': ('not a decoder', 'composite config: its text decoder is qwen3_5_moe_text', ()),
    'qwen3_5_moe_text': ('refused', "model_type 'qwen3_5_moe_text' (Qwen3_5MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'qwen3_5_text': ('refused', "model_type 'qwen3_5_text' (Qwen3_5ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'qwen3_moe': ('refused', "model_type 'qwen3_moe' (Qwen3MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'qwen3_next': ('refused', "model_type 'qwen3_next' (Qwen3NextForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'qwen4_exp': ('not a decoder', 'composite config: its text decoder is qwen4_exp_text', ()),
    'qwen4_exp_text': ('refused', "model_type 'qwen4_exp_text' (Qwen4ExpForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'recurrent_gemma': ('refused', "model_type 'recurrent_gemma' (RecurrentGemmaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'reformer': ('refused', "model_type 'reformer' (ReformerModelWithLMHead) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'rembert': ('refused', "model_type 'rembert' (RemBertForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'roberta': ('refused', "model_type 'roberta' (RobertaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'roberta-prelayernorm': ('refused', "model_type 'roberta-prelayernorm' (RobertaPreLayerNormForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'roc_bert': ('refused', "model_type 'roc_bert' (RoCBertForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'roformer': ('refused', "model_type 'roformer' (RoFormerForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'rwkv': ('refused', "model_type 'rwkv' (RwkvForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'sarvam_mla': ('refused', "model_type 'sarvam_mla' (DeepseekV3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'sarvam_moe': ('refused', "model_type 'sarvam_moe' (Glm4MoeForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'seed_oss': ('refused', "model_type 'seed_oss' (SeedOssForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'smollm3': ('refused', "model_type 'smollm3' (SmolLM3ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'solar_open': ('refused', "model_type 'solar_open' (SolarOpenForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'stablelm': ('refused', "model_type 'stablelm' (StableLmForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'starcoder2': ('refused', "model_type 'starcoder2' (Starcoder2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'trocr': ('refused', "model_type 'trocr' (TrOCRForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'vaultgemma': ('refused', "model_type 'vaultgemma' (VaultGemmaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'whisper': ('not a decoder', 'encoder-decoder', ()),
    'xglm': ('refused', "model_type 'xglm' (XGLMForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'xlm': ('refused', "model_type 'xlm' (XLMWithLMHeadModel) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'xlm-roberta': ('refused', "model_type 'xlm-roberta' (XLMRobertaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'xlm-roberta-xl': ('refused', "model_type 'xlm-roberta-xl' (XLMRobertaXLForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'xlnet': ('refused', "model_type 'xlnet' (XLNetLMHeadModel) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'xlstm': ('cannot run unsplit', 'RuntimeError: one of the variables needed for gradient computation has been modified by an inplace operation: [torch.FloatTensor [2, 8, 8]], which is output 0 of torch::autograd::CopyBackwards, is at version 1; expected version 0 instead. Hint: enable anomaly detection to find the operation that failed to compute its gradient, with torch.autograd.set_detect_anomaly(True, check_nan=False).', ()),
    'xmod': ('refused', "model_type 'xmod' (XmodForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'youtu': ('refused', "model_type 'youtu' (YoutuForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'zamba': ('refused', "model_type 'zamba' (ZambaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'zamba2': ('refused', "model_type 'zamba2' (Zamba2ForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
    'zaya': ('refused', "model_type 'zaya' (ZayaForCausalLM) is not a family unbubble splits: gemma, gemma2, gpt2, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3 (decoder-only causal LMs whose forward it mirrors)", ()),
}
# --- verdicts: end ---


def _numbers_blurred(line: str) -> str:
    """A line with its measured numbers (a probe's difference) blurred: they move with round-off."""
    return re.sub(r"\d+\.\d+(e-?\d+)?|\d+e-?\d+", "#", line)


@pytest.fixture(autouse=True)
def _quiet():
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config notes
        yield
    torch.set_num_threads(threads)


def test_the_table_names_every_causal_lm_the_installed_transformers_registers():
    assert sorted(VERDICTS) == hf_zoo.causal_lm_types()


@pytest.mark.parametrize("family", sorted(VERDICTS))
def test_each_family_has_its_verdict(family):
    kind, line, changing = VERDICTS[family]
    v = hf_zoo.verdict(family, check_features=kind == "exact")
    assert (v.kind, _numbers_blurred(v.detail)) == (kind, _numbers_blurred(line))
    if kind == "exact":
        assert v.diffs == {2: 0.0, 4: 0.0}
        assert v.drift == v.bound == [2, 1, 1, 0]
        for name in changing:  # each feature matters: a split that dropped it would differ
            assert v.changed[name] > 1e-4, (name, v.changed[name])


@pytest.mark.parametrize("family, off", [("mistral", {"sliding_window": 64}), ("gemma2", {"final_logit_softcapping": None}),
                                         ("qwen2_moe", {"num_experts_per_tok": 1})])
def test_a_split_that_drops_the_feature_is_caught_by_the_comparison(family, off):
    """The harness's power: stages of the same weights without the feature (unverified) train differently
    from the unsplit model with it, and the verdict says so."""
    from unbubble.models.split import split_model

    def wrong(model, n):
        plain = hf_zoo.tiny_model(family, **off)
        plain.load_state_dict(model.state_dict())
        return split_model(plain, n, verify=False)

    v = hf_zoo.verdict(family, stages=(2,), paci=False, check_features=False, split_fn=wrong)
    assert v.kind == "differs" and v.diffs[2] > 1e-4, v
