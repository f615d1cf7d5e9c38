"""GGUF architectures whose llama.cpp files differ from their transformers checkpoints by more than tensor
names: GLM (``chatglm``, ``glm4``), Gemma 2 and 3 (``gemma2``, ``gemma3``), Mistral Small 3.x and Ministral 3
(``mistral3``), OLMo 2/3 (``olmo2``), Granite 3 (``granite``), Seed-OSS (``seed_oss``), ERNIE 4.5 (``ernie4_5``),
Cohere2 (``cohere2``), EXAONE 4.0 (``exaone4``), Arcee (``arcee``), the dense Hunyuan (``hunyuan-dense``), Apertus
(``apertus``), StarCoder2 (``starcoder2``), Granite 3 MoE (``granitemoe``: Granite 3's keys with stacked experts, stored
back one tensor per expert or fused as its checkpoints hold them); the other MoE families have their own module,
``gguf_moe_archs.py``, Qwen3-Next and Qwen3.5 (``qwen3next``, ``qwen35``, ``qwen35moe``) theirs,
``gguf_qwen3_next.py``, LFM2 and LFM2-MoE (``lfm2``, ``lfm2moe``) theirs, ``gguf_lfm2.py``, Gemma 3n
(``gemma3n``) its own, ``gguf_gemma3n.py``, Mamba and Falcon Mamba (``mamba``) theirs, ``gguf_mamba.py``,
GLM-5 (``glm-dsa``) its own, ``gguf_dsa.py``, Kimi-Linear (``kimi-linear``) its own, ``gguf_kimi_linear.py``, and
Gemma 4 (``gemma4``) its own, ``gguf_gemma4.py``, merged in here.

Each has a config builder (the transformers config fields that llama.cpp keeps in metadata under gguf-py's
``Keys``, or fixes in its loader) and, where needed, a state-dict step in ``gguf_tensors.py`` that undoes what
convert_hf_to_gguf.py did to the tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from gguf import Keys

from . import (gguf_dsa, gguf_gemma3n, gguf_gemma4, gguf_hybrid, gguf_kimi_linear, gguf_lfm2, gguf_mamba,
               gguf_moe_archs, gguf_qwen3_next)
from .gguf_keys import Meta
from .gguf_keys import glm_rope as _glm_rope
from .gguf_keys import layer_types as _layer_types
from .gguf_keys import rope_parameters as _rope
from .gguf_rope import ROPE_FREQS

ARCHITECTURES = {
    'chatglm': 'GlmForCausalLM',  # GLM-4-9B-chat; ChatGLM2/3 files of this architecture are refused
    'glm4': 'Glm4ForCausalLM',
    'gemma2': 'Gemma2ForCausalLM',
    'gemma3': 'Gemma3ForCausalLM',
    'mistral3': 'MistralForCausalLM',  # Mistral Small 3.x's language model; Ministral3ForCausalLM with its query scale
    'olmo2': 'Olmo2ForCausalLM',  # Olmo3ForCausalLM where the file has a sliding window
    'granite': 'GraniteForCausalLM',
    'seed_oss': 'SeedOssForCausalLM',
    'ernie4_5': 'Ernie4_5ForCausalLM',
    'cohere2': 'Cohere2ForCausalLM',
    'exaone4': 'Exaone4ForCausalLM',
    'arcee': 'ArceeForCausalLM',
    'hunyuan-dense': 'HunYuanDenseV1ForCausalLM',
    'apertus': 'ApertusForCausalLM',
    'starcoder2': 'Starcoder2ForCausalLM',
    'granitemoe': 'GraniteMoeForCausalLM',
    **gguf_moe_archs.ARCHITECTURES,
    **gguf_qwen3_next.ARCHITECTURES,
    **gguf_lfm2.ARCHITECTURES,
    **gguf_hybrid.ARCHITECTURES,
    **gguf_gemma3n.ARCHITECTURES,
    **gguf_mamba.ARCHITECTURES,
    **gguf_dsa.ARCHITECTURES,
    **gguf_kimi_linear.ARCHITECTURES,
    **gguf_gemma4.ARCHITECTURES,
}

# architectures whose every linear layer is a projection (or experts) that may be served as llama.cpp's blocks
# (llama.cpp never quantizes a router: ``ffn_gate_inp`` stays F32)
RAW_SERVED_ARCHS = ('llama', 'chatglm', 'glm4', 'gemma2', 'gemma3', 'mistral3', 'olmo2', 'granite', 'seed_oss',
                    'ernie4_5', 'cohere2', 'exaone4', 'arcee',
                    'hunyuan-dense', 'apertus', 'starcoder2', 'granitemoe',
                    *gguf_moe_archs.RAW_SERVED_ARCHS,
                    *gguf_qwen3_next.ARCHITECTURES, *gguf_lfm2.ARCHITECTURES, *gguf_hybrid.ARCHITECTURES)

_POST_NORM_NAMES = {'post_attention_norm': 'post_attention_layernorm', 'post_ffw_norm': 'post_feedforward_layernorm'}
_GEMMA_NAMES = {'ffn_norm': 'pre_feedforward_layernorm', 'post_attention_norm': 'post_attention_layernorm',
                'post_ffw_norm': 'post_feedforward_layernorm'}
# layer tensor names by ``module`` (the kind, weight or bias, appended) or by ``module.kind`` (as written);
# ``self_attn.qkv_proj`` (GLM) is split, ``mlp.experts.{gate,up}`` and ``self_attn.{k,v}_b_proj`` are merged by
# ``finish_state_dict``; GLM keeps gate and up fused, as its Hugging Face checkpoints do (gate rows first)
LAYER_NAMES: dict[str, dict[str, str]] = {
    'chatglm': {'attn_qkv': 'self_attn.qkv_proj', 'ffn_up': 'mlp.gate_up_proj'},
    'glm4': {'ffn_up': 'mlp.gate_up_proj', 'post_attention_norm': 'post_self_attn_layernorm',
             'post_ffw_norm': 'post_mlp_layernorm'},
    'gemma2': _GEMMA_NAMES,
    'gemma3': _GEMMA_NAMES,
    'olmo2': _POST_NORM_NAMES,
    'exaone4': _POST_NORM_NAMES,
    'seed_oss': {'post_attention_norm': 'post_attention_layernorm'},
    'hunyuan-dense': gguf_moe_archs.HUNYUAN_QK_NORMS,
    'apertus': {'attn_norm': 'attention_layernorm', 'ffn_norm': 'feedforward_layernorm'},
    # the MLP's names in StarCoder2's checkpoints (the engine loads them as its ungated MLP's up and down)
    'starcoder2': {'ffn_up': 'mlp.c_fc', 'ffn_down': 'mlp.c_proj'},
    # GraniteMoeShared's shared MLP under the engine's MoE block (``gguf_tensors.py`` names it as the checkpoint
    # where it is dense)
    'granitemoe': {'ffn_gate_shexp': 'mlp.shared_mlp.gate_proj', 'ffn_up_shexp': 'mlp.shared_mlp.up_proj',
                   'ffn_down_shexp': 'mlp.shared_mlp.down_proj'},
    **gguf_moe_archs.LAYER_NAMES,
    **dict.fromkeys(gguf_qwen3_next.ARCHITECTURES, gguf_qwen3_next.LAYER_NAMES),
    **dict.fromkeys(gguf_lfm2.ARCHITECTURES, gguf_lfm2.LAYER_NAMES),
    **gguf_hybrid.LAYER_NAMES,
    **dict.fromkeys(gguf_gemma3n.ARCHITECTURES, gguf_gemma3n.LAYER_NAMES),
    **gguf_mamba.LAYER_NAMES,
    **gguf_dsa.LAYER_NAMES,
    **gguf_kimi_linear.LAYER_NAMES,
    **dict.fromkeys(gguf_gemma4.ARCHITECTURES, gguf_gemma4.LAYER_NAMES),
}
# tensors outside the layers, by architecture, beyond the embedding, final norm and output every one has
GLOBAL_NAMES: dict[str, dict[str, str]] = {
    **dict.fromkeys(gguf_gemma3n.ARCHITECTURES, gguf_gemma3n.GLOBAL_NAMES),
    **dict.fromkeys(gguf_gemma4.ARCHITECTURES, gguf_gemma4.GLOBAL_NAMES),
}


def unpermute_rotary(weight: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary halves) of Llama-derived models and towers."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _gemma_query_scalar(config: dict[str, Any], layers_of_27b: int) -> int:
    """llama.cpp scales Gemma's queries by 1/sqrt(head_dim), and the 27B models' by 1/sqrt(hidden/heads)
    (it knows them by their layer count; the files carry no key for it)."""
    if config['num_hidden_layers'] == layers_of_27b:
        return config['hidden_size'] // config['num_attention_heads']
    return config['head_dim']


def _glm4(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """GLM-4-0414's rotary; GLM-4.1V's language model adds its M-RoPE bands (``rope.dimension_sections``), by which
    ``gguf_tensors.py`` knows its q/k rotary rows are in halves."""
    rope = _glm_rope(meta, config)
    sections = meta(Keys.Rope.DIMENSION_SECTIONS)
    return {'rope_parameters': rope if sections is None else rope | {'mrope_section': list(sections[:3])}}


def _chatglm(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """ChatGLMModel's files: q/k/v fused (GLM-4-9B-chat's own checkpoints) or apart (``GlmForCausalLM``
    ones), with biases, never permuted; llama.cpp turns neighbouring pairs, as GLM does. ChatGLM2/3 files
    (a SentencePiece vocabulary) are refused: their tokenizer is not verified here."""
    if meta(Keys.Tokenizer.MODEL) != 'gpt2':
        raise ValueError(f'a chatglm file with a {meta(Keys.Tokenizer.MODEL)!r} tokenizer (ChatGLM2/3) is not '
                         f'supported, only GLM-4 (gpt2)')
    return {'model_type': 'glm', 'rope_parameters': _glm_rope(meta, config),
            'attention_bias': 'blk.0.attn_qkv.bias' in tensors or 'blk.0.attn_q.bias' in tensors}


def _gemma2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's defaults where the file has no key (Gemma 2's own values)
    return {'model_type': 'gemma2', 'query_pre_attn_scalar': _gemma_query_scalar(config, 46),
            'sliding_window': meta(Keys.Attention.SLIDING_WINDOW, 4096),
            'layer_types': _layer_types(meta, config['num_hidden_layers'], 2),
            'attn_logit_softcapping': meta(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, 50.0),
            'final_logit_softcapping': meta(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, 30.0),
            'rope_parameters': {'rope_type': 'default', 'rope_theta': config['rope_theta']}}


def _gemma3(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Local layers turn by ``rope.freq_base_swa`` (llama.cpp's fixed 10000 where absent) without scaling,
    global ones by ``rope.freq_base`` with the file's scaling."""
    window, layers = meta(Keys.Attention.SLIDING_WINDOW), config['num_hidden_layers']
    local = {'rope_type': 'default', 'rope_theta': meta(Keys.Rope.FREQ_BASE_SWA, 10000.0)}
    return {'model_type': 'gemma3_text', 'query_pre_attn_scalar': _gemma_query_scalar(config, 62),
            'sliding_window': window,
            'layer_types': _layer_types(meta, layers, 6) if window else ['full_attention'] * layers,
            'final_logit_softcapping': meta(Keys.LLM.FINAL_LOGIT_SOFTCAPPING),
            'rope_parameters': {'full_attention': _rope(meta, config['rope_theta']), 'sliding_attention': local}}


def _mistral3(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ``mistral3``: Ministral 3 where the file scales queries by position (``attention.temperature_scale``,
    its ``llama_4_scaling_beta``; the step is YaRN's original context), with its YaRN, whose ``mscale_all_dim`` the file
    holds as ``rope.scaling.yarn_log_multiplier`` (``mscale`` 1, as llama.cpp takes it); else Mistral Small 3.x's
    language model, Mistral's layers without a sliding window."""
    rope = _rope(meta, config['rope_theta'])
    beta = meta(Keys.Attention.TEMPERATURE_SCALE)
    if not beta:
        return {'model_type': 'mistral', 'rope_parameters': rope, 'sliding_window': None}
    if rope['rope_type'] != 'yarn' or not rope['original_max_position_embeddings']:
        raise ValueError('a mistral3 file whose queries are scaled by position (attention.temperature_scale) needs '
                         'YaRN rope scaling with its original context length (rope.scaling.original_context_length)')
    log_mul = meta(Keys.Rope.SCALING_YARN_LOG_MUL)
    if log_mul:
        rope |= {'mscale': 1.0, 'mscale_all_dim': log_mul}
    return {'model_type': 'ministral3', 'architectures': ['Ministral3ForCausalLM'],
            'rope_parameters': rope | {'llama_4_scaling_beta': beta}}


def _olmo2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """OLMo 2, or OLMo 3 where the file has a sliding window: its local layers turn by the plain rope of
    ``rope.freq_base_swa`` (the global base where absent), as llama.cpp turns them without the file's scaling."""
    rope = _rope(meta, config['rope_theta'])
    window = meta(Keys.Attention.SLIDING_WINDOW)
    if not window:
        return {'model_type': 'olmo2', 'rope_parameters': rope}
    local = {'rope_type': 'default', 'rope_theta': meta(Keys.Rope.FREQ_BASE_SWA, config['rope_theta'])}
    return {'model_type': 'olmo3', 'architectures': ['Olmo3ForCausalLM'], 'sliding_window': window,
            'layer_types': _layer_types(meta, config['num_hidden_layers'], 4),
            'rope_parameters': {'full_attention': rope, 'sliding_attention': local}}


def _granite(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The multipliers llama.cpp keeps as scales (its defaults where absent: no scaling, ``head_dim ** -0.5``)."""
    return {'model_type': 'granite', 'rope_parameters': _rope(meta, config['rope_theta']),
            'attention_multiplier': meta(Keys.Attention.SCALE) or config['head_dim']**-0.5,
            'embedding_multiplier': meta(Keys.LLM.EMBEDDING_SCALE) or 1.0,
            'residual_multiplier': meta(Keys.LLM.RESIDUAL_SCALE) or 1.0,
            'logits_scaling': meta(Keys.LLM.LOGIT_SCALE) or 1.0, 'mlp_bias': 'blk.0.ffn_up.bias' in tensors}


def _seed_oss(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return {'model_type': 'seed_oss', 'rope_parameters': _rope(meta, config['rope_theta']),
            'attention_out_bias': 'blk.0.attn_output.bias' in tensors, 'mlp_bias': 'blk.0.ffn_up.bias' in tensors}


def _ernie4_5(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """ERNIE's one ``use_bias``; llama.cpp turns neighbouring pairs, as ERNIE does (the converter leaves q/k
    unpermuted)."""
    return {'model_type': 'ernie4_5', 'rope_parameters': _rope(meta, config['rope_theta']),
            'use_bias': 'blk.0.attn_q.bias' in tensors}


def _cohere2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Command R7B and Command A: sliding-window layers by llama.cpp's fixed step of 4 (the file's pattern where it
    has one), its LayerNorm epsilon and logit scale; q/k rows as the checkpoint holds them (llama.cpp turns
    neighbouring pairs, as Cohere2 does)."""
    return {'model_type': 'cohere2', 'layer_norm_eps': meta(Keys.Attention.LAYERNORM_EPS, 1e-5),
            'logit_scale': meta(Keys.LLM.LOGIT_SCALE, 1.0), 'sliding_window': meta(Keys.Attention.SLIDING_WINDOW),
            'layer_types': _layer_types(meta, config['num_hidden_layers'], 4),
            'rope_parameters': {'rope_type': 'default', 'rope_theta': config['rope_theta']}}


def _exaone4(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.0: with a sliding window its layers per the file's ``sliding_window_pattern`` (a step of 4 where
    absent), else every layer full; its llama3 rotary, where it has one, from ``rope_freqs``; q/k rows unpermuted."""
    window, layers = meta(Keys.Attention.SLIDING_WINDOW), config['num_hidden_layers']
    return {'model_type': 'exaone4', 'sliding_window': window or None,
            'layer_types': _layer_types(meta, layers, 4) if window else ['full_attention'] * layers,
            **_rope_unless_freqs(meta, tensors, config)}


def _arcee(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """AFM-4.5B: Llama's keys (q/k rows permuted as Llama's, put back) with its YaRN."""
    return {'model_type': 'arcee', **_rope_unless_freqs(meta, tensors, config)}


def _rope_unless_freqs(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The rotary of the file's keys, unless it has ``rope_freqs`` (a llama3 rotary, found from them)."""
    return {} if ROPE_FREQS in tensors else {'rope_parameters': _rope(meta, config['rope_theta'])}


def _hunyuan_dense(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The dense Hunyuan: q/k rows unpermuted; NTK-alpha's stretched base written as ``rope.freq_base`` with no
    scaling (as ``hunyuan-moe``'s, ``gguf_moe_archs.py``)."""
    return {'model_type': 'hunyuan_v1_dense', 'rope_parameters': _rope(meta, config['rope_theta'])}


def _apertus(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Apertus: Llama's keys, q/k rows unpermuted (its converter leaves them), the llama3 rotary from ``rope_freqs``;
    the xIELU parameters, kept as metadata, are checked here and become tensors in :func:`xielu_tensors`."""
    _xielu_values(meta)
    return {'model_type': 'apertus', 'hidden_act': 'xielu', **_rope_unless_freqs(meta, tensors, config)}


_XIELU_KEYS = {'alpha_p': Keys.xIELU.ALPHA_P, 'alpha_n': Keys.xIELU.ALPHA_N, 'beta': Keys.xIELU.BETA,
              'eps': Keys.xIELU.EPS}


def _xielu_values(meta: Meta) -> dict[str, list[float]]:
    """Each layer's xIELU parameters as the checkpoint holds them (``alpha_p`` and ``alpha_n`` before their
    softplus), by name: the file's arrays (a value a layer), or one value for every layer."""
    layers = meta(Keys.LLM.BLOCK_COUNT)
    values = {name: meta(key) for name, key in _XIELU_KEYS.items()}
    missing = [key for name, key in _XIELU_KEYS.items() if values[name] is None]
    if missing:
        raise ValueError(f'missing GGUF metadata: {", ".join(missing)}')
    values = {name: value if isinstance(value, list) else [value] * layers for name, value in values.items()}
    wrong = [f'{_XIELU_KEYS[name]} ({len(value)})' for name, value in values.items() if len(value) != layers]
    if wrong:
        raise ValueError(f'GGUF metadata {", ".join(wrong)} should hold one value per layer ({layers})')
    return values


def xielu_tensors(meta: Meta, layer: int) -> dict[str, torch.Tensor]:
    """Apertus's xIELU parameters of layer ``layer`` as the checkpoint's tensors (``alpha_p``/``alpha_n`` of one
    element, ``beta``/``eps`` scalars)."""
    return {f'model.layers.{layer}.mlp.act_fn.{name}': torch.tensor(
        [values[layer]] if name.startswith('alpha') else values[layer], dtype=torch.float32)
        for name, values in _xielu_values(meta).items()}


# per architecture, the tensors of a layer that llama.cpp keeps as metadata: ``(meta, layer) -> {name: tensor}``
METADATA_TENSORS: dict[str, Callable[[Meta, int], dict[str, torch.Tensor]]] = {'apertus': xielu_tensors}


def _granitemoe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Granite 3 MoE: Granite's multipliers and q/k rows (see :func:`_granite`), every layer's experts split from the
    checkpoints' fused ``input_linear`` into ``ffn_gate_exps`` and ``ffn_up_exps``, a softmax over the top-k logits.
    GraniteMoeShared converts to it too, its shared MLP's ``input_linear`` split into ``ffn_gate_shexp`` and
    ``ffn_up_shexp`` (``output_linear`` as ``ffn_down_shexp``), of ``expert_shared_feed_forward_length`` features
    (the tensors' where the key is absent)."""
    fields = {**_granite(meta, tensors, config), 'model_type': 'granitemoe',
              'num_local_experts': meta(Keys.LLM.EXPERT_COUNT),
              'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
              'intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, config['intermediate_size'])}
    shared = tensors.get('blk.0.ffn_up_shexp.weight')
    if shared is None:
        return fields
    return fields | {'model_type': 'granitemoeshared', 'architectures': ['GraniteMoeSharedForCausalLM'],
                     'shared_intermediate_size': meta(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH,
                                                      int(shared.shape[-1]))}


def _starcoder2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """StarCoder2: LayerNorms with biases of the file's epsilon, biases on the projections where the file has them,
    q/k rows unpermuted. llama.cpp attends over the whole context (it reads no sliding window for it), and so does the
    engine on these files."""
    return {'model_type': 'starcoder2', 'rope_parameters': _rope(meta, config['rope_theta']),
            'norm_epsilon': meta(Keys.Attention.LAYERNORM_EPS, 1e-5), 'use_bias': 'blk.0.attn_q.bias' in tensors,
            'sliding_window': None}


CONFIG_BUILDERS: dict[str, Callable[[Meta, dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    'chatglm': _chatglm, 'glm4': _glm4, 'gemma2': _gemma2, 'gemma3': _gemma3, 'mistral3': _mistral3, 'olmo2': _olmo2,
    'granite': _granite, 'seed_oss': _seed_oss, 'ernie4_5': _ernie4_5, 'cohere2': _cohere2, 'exaone4': _exaone4,
    'arcee': _arcee, 'hunyuan-dense': _hunyuan_dense, 'apertus': _apertus, 'starcoder2': _starcoder2,
    'granitemoe': _granitemoe,
    **gguf_moe_archs.CONFIG_BUILDERS,
    **gguf_qwen3_next.CONFIG_BUILDERS, **gguf_lfm2.CONFIG_BUILDERS, **gguf_hybrid.CONFIG_BUILDERS,
    **gguf_gemma3n.CONFIG_BUILDERS, **gguf_mamba.CONFIG_BUILDERS, **gguf_dsa.CONFIG_BUILDERS,
    **gguf_kimi_linear.CONFIG_BUILDERS,
    **gguf_gemma4.CONFIG_BUILDERS}
