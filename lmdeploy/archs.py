"""Supported architectures and backend selection."""
from __future__ import annotations

import importlib
import os
from typing import Literal

from transformers import AutoConfig, PretrainedConfig

from lmdeploy.messages import ConfigError, PytorchEngineConfig

Task = Literal['llm', 'vlm']

_VL = 'lmdeploy.pytorch.models.vision_language'
_MISTRAL3 = 'lmdeploy.pytorch.models.mistral3_vl'
_SMOLVLM = 'lmdeploy.pytorch.models.smolvlm_vl'
_QWEN3_5_VL = 'lmdeploy.pytorch.models.qwen3_5_vl:Qwen3_5ForConditionalGeneration'
_GLM4V = 'lmdeploy.pytorch.models.glm4v'
# architecture -> (task, 'module:class')
SUPPORTED_ARCHS: dict[str, tuple[Task, str]] = {
    'LlamaForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama:LlamaForCausalLM'),
    'Qwen2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama:LlamaForCausalLM'),
    'Qwen3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama:LlamaForCausalLM'),
    'MistralForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama:LlamaForCausalLM'),
    'Ministral3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama:LlamaForCausalLM'),
    'Phi3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama:LlamaForCausalLM'),
    'Gemma2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.gemma:GemmaForCausalLM'),
    'Gemma3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.gemma:GemmaForCausalLM'),
    'GlmForCausalLM': ('llm', 'lmdeploy.pytorch.models.glm:GlmForCausalLM'),
    'Glm4ForCausalLM': ('llm', 'lmdeploy.pytorch.models.glm:GlmForCausalLM'),
    'SmolLM3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.smollm3:SmolLM3ForCausalLM'),
    'SeedOssForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama:LlamaForCausalLM'),
    'Ernie4_5ForCausalLM': ('llm', 'lmdeploy.pytorch.models.ernie:Ernie4_5ForCausalLM'),
    'Ernie4_5_MoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.ernie:Ernie4_5_MoeForCausalLM'),
    'GraniteForCausalLM': ('llm', 'lmdeploy.pytorch.models.granite:GraniteForCausalLM'),
    'Olmo2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.olmo:OlmoForCausalLM'),
    'Olmo3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.olmo:OlmoForCausalLM'),
    'MixtralForCausalLM': ('llm', 'lmdeploy.pytorch.models.moe:MoEForCausalLM'),
    'Qwen2MoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.moe:MoEForCausalLM'),
    'Qwen3MoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.moe:MoEForCausalLM'),
    'DeepseekV2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.deepseek_v3:DeepseekV3ForCausalLM'),
    'DeepseekV3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.deepseek_v3:DeepseekV3ForCausalLM'),
    'Glm4MoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.glm4_moe:Glm4MoeForCausalLM'),
    'GptOssForCausalLM': ('llm', 'lmdeploy.pytorch.models.gpt_oss:GptOssForCausalLM'),
    'Llama4ForCausalLM': ('llm', 'lmdeploy.pytorch.models.llama4:Llama4ForCausalLM'),
    'Qwen3NextForCausalLM': ('llm', 'lmdeploy.pytorch.models.qwen3_next:Qwen3NextForCausalLM'),
    'Qwen3_5ForCausalLM': ('llm', 'lmdeploy.pytorch.models.qwen3_next:Qwen3NextForCausalLM'),
    'Qwen3_5MoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.qwen3_next:Qwen3NextForCausalLM'),
    'Cohere2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.cohere2:Cohere2ForCausalLM'),
    'Exaone4ForCausalLM': ('llm', 'lmdeploy.pytorch.models.exaone4:Exaone4ForCausalLM'),
    'ArceeForCausalLM': ('llm', 'lmdeploy.pytorch.models.arcee:ArceeForCausalLM'),
    'ApertusForCausalLM': ('llm', 'lmdeploy.pytorch.models.apertus:ApertusForCausalLM'),
    'MiniMaxM2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.minimax_m2:MiniMaxM2ForCausalLM'),
    'Glm4MoeLiteForCausalLM': ('llm', 'lmdeploy.pytorch.models.glm4_moe:Glm4MoeLiteForCausalLM'),
    'HunYuanMoEV1ForCausalLM': ('llm', 'lmdeploy.pytorch.models.hunyuan:HunYuanMoEV1ForCausalLM'),
    'GraniteMoeHybridForCausalLM': ('llm', 'lmdeploy.pytorch.models.granitemoehybrid:GraniteMoeHybridForCausalLM'),
    'NemotronHForCausalLM': ('llm', 'lmdeploy.pytorch.models.nemotron_h:NemotronHForCausalLM'),
    'HunYuanDenseV1ForCausalLM': ('llm', 'lmdeploy.pytorch.models.hunyuan:HunYuanDenseV1ForCausalLM'),
    'Lfm2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.lfm2:Lfm2ForCausalLM'),
    'Lfm2MoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.lfm2:Lfm2ForCausalLM'),
    'OlmoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.olmo:OlmoeForCausalLM'),
    'GraniteMoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.granite:GraniteMoeForCausalLM'),
    'Starcoder2ForCausalLM': ('llm', 'lmdeploy.pytorch.models.starcoder2:Starcoder2ForCausalLM'),
    'FalconH1ForCausalLM': ('llm', 'lmdeploy.pytorch.models.falcon_h1:FalconH1ForCausalLM'),
    'BambaForCausalLM': ('llm', 'lmdeploy.pytorch.models.granitemoehybrid:BambaForCausalLM'),
    'GraniteMoeSharedForCausalLM': ('llm', 'lmdeploy.pytorch.models.granite:GraniteMoeSharedForCausalLM'),
    'Gemma3nForCausalLM': ('llm', 'lmdeploy.pytorch.models.gemma3n:Gemma3nForCausalLM'),
    'Gemma3nForConditionalGeneration': ('llm', 'lmdeploy.pytorch.models.gemma3n:Gemma3nForCausalLM'),
    'JambaForCausalLM': ('llm', 'lmdeploy.pytorch.models.jamba:JambaForCausalLM'),
    'MambaForCausalLM': ('llm', 'lmdeploy.pytorch.models.mamba:MambaForCausalLM'),
    'FalconMambaForCausalLM': ('llm', 'lmdeploy.pytorch.models.mamba:MambaForCausalLM'),
    'PhimoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.phimoe:PhimoeForCausalLM'),
    'PhiMoEForCausalLM': ('llm', 'lmdeploy.pytorch.models.phimoe:PhimoeForCausalLM'),
    'Dots1ForCausalLM': ('llm', 'lmdeploy.pytorch.models.dots1:Dots1ForCausalLM'),
    'ExaoneMoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.exaone_moe:ExaoneMoeForCausalLM'),
    'ExaoneMoEForCausalLM': ('llm', 'lmdeploy.pytorch.models.exaone_moe:ExaoneMoeForCausalLM'),
    'AfmoeForCausalLM': ('llm', 'lmdeploy.pytorch.models.afmoe:AfmoeForCausalLM'),
    'DeepseekV32ForCausalLM': ('llm', 'lmdeploy.pytorch.models.deepseek_v32:DeepseekV32ForCausalLM'),
    'GlmMoeDsaForCausalLM': ('llm', 'lmdeploy.pytorch.models.deepseek_v32:GlmMoeDsaForCausalLM'),
    'DeepseekV4ForCausalLM': ('llm', 'lmdeploy.pytorch.models.deepseek_v4:DeepseekV4ForCausalLM'),
    'LongcatFlashForCausalLM': ('llm', 'lmdeploy.pytorch.models.longcat_flash:LongcatFlashForCausalLM'),
    'KimiLinearForCausalLM': ('llm', 'lmdeploy.pytorch.models.kimi_linear:KimiLinearForCausalLM'),
    'Lfm3ForCausalLM': ('llm', 'lmdeploy.pytorch.models.lfm2:Lfm2ForCausalLM'),
    'LagunaForCausalLM': ('llm', 'lmdeploy.pytorch.models.laguna:LagunaForCausalLM'),
    'MiMoV2FlashForCausalLM': ('llm', 'lmdeploy.pytorch.models.mimo_v2_flash:MiMoV2FlashForCausalLM'),
    'Qwen4ExpForCausalLM': ('llm', 'lmdeploy.pytorch.models.qwen4_exp:Qwen4ExpForCausalLM'),
    'Qwen4ExpForConditionalGeneration': ('llm', 'lmdeploy.pytorch.models.qwen4_exp:Qwen4ExpForCausalLM'),
    'Mistral4ForCausalLM': ('llm', 'lmdeploy.pytorch.models.deepseek_v3:Mistral4ForCausalLM'),
    'Gemma4ForCausalLM': ('llm', 'lmdeploy.pytorch.models.gemma4:Gemma4ForCausalLM'),
    'Gemma4ForConditionalGeneration': ('llm', 'lmdeploy.pytorch.models.gemma4:Gemma4ForCausalLM'),
    'Qwen2VLForConditionalGeneration': ('vlm', f'{_VL}:Qwen2VLForConditionalGeneration'),
    'Qwen2_5_VLForConditionalGeneration': ('vlm', f'{_VL}:Qwen2VLForConditionalGeneration'),
    'LlavaForConditionalGeneration': ('vlm', f'{_VL}:LlavaForConditionalGeneration'),
    'Qwen3VLForConditionalGeneration': ('vlm', f'{_VL}:Qwen3VLForConditionalGeneration'),
    'Qwen3VLMoeForConditionalGeneration': ('vlm', f'{_VL}:Qwen3VLMoeForConditionalGeneration'),
    'Qwen3_5ForConditionalGeneration': ('vlm', _QWEN3_5_VL),
    'Qwen3_5MoeForConditionalGeneration': ('vlm', _QWEN3_5_VL),
    'InternVLForConditionalGeneration': ('vlm', f'{_VL}:InternVLForConditionalGeneration'),
    'Mistral3ForConditionalGeneration': ('vlm', f'{_MISTRAL3}:Mistral3ForConditionalGeneration'),
    'Gemma3ForConditionalGeneration': ('vlm', 'lmdeploy.pytorch.models.gemma3_vl:Gemma3ForConditionalGeneration'),
    'Llama4ForConditionalGeneration': ('vlm', 'lmdeploy.pytorch.models.llama4_vl:Llama4ForConditionalGeneration'),
    'Glm4vForConditionalGeneration': ('vlm', f'{_GLM4V}:Glm4vForConditionalGeneration'),
    'Glm4vMoeForConditionalGeneration': ('vlm', f'{_GLM4V}:Glm4vMoeForConditionalGeneration'),
    'Glm46VForConditionalGeneration': ('vlm', f'{_GLM4V}:Glm46VForConditionalGeneration'),
    'SmolVLMForConditionalGeneration': ('vlm', f'{_SMOLVLM}:SmolVLMForConditionalGeneration'),
    'Idefics3ForConditionalGeneration': ('vlm', f'{_SMOLVLM}:SmolVLMForConditionalGeneration'),
    'Lfm2VlForConditionalGeneration': ('vlm', 'lmdeploy.pytorch.models.lfm2_vl:Lfm2VlForConditionalGeneration'),
}


def load_hf_config(model_dir: str) -> PretrainedConfig:
    """Reads ``config.json`` and checks the architecture is supported; a config.json that is not JSON, names
    an architecture not served or that transformers cannot read raises :class:`ConfigError`."""
    from lmdeploy.pytorch.weights.file_checks import read_config_json
    path = os.path.join(model_dir, 'config.json')
    arch = (read_config_json(model_dir).get('architectures') or [None])[0]
    if arch is None:
        raise ConfigError(f'{path} names no architecture (its "architectures" list is missing or empty); '
                          f'lmdeploy serves: {", ".join(SUPPORTED_ARCHS)}')
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f'{path}: architecture {arch!r} is not supported; supported: {", ".join(SUPPORTED_ARCHS)}')
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, TypeError, OSError) as err:
        reason = ' '.join(str(err).split())
        raise ConfigError(f'{path}: transformers cannot read it ({type(err).__name__}: {reason})') from err


def get_task(architecture: str) -> Task:
    """'vlm' for models that take images, else 'llm'."""
    return SUPPORTED_ARCHS[architecture][0]


def get_model_class(architecture: str) -> type:
    module, _, name = SUPPORTED_ARCHS[architecture][1].partition(':')
    return getattr(importlib.import_module(module), name)


def autoget_backend_config(model_path: str,
                           backend_config: PytorchEngineConfig | None = None) -> tuple[str, PytorchEngineConfig]:
    """Returns ``('pytorch', config)``: the in-tree PyTorch engine serves every supported model."""
    from lmdeploy.model_source import resolve_model_path
    load_hf_config(resolve_model_path(model_path))
    return 'pytorch', backend_config or PytorchEngineConfig()
