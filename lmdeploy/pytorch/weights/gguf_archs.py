"""GGUF architectures whose llama.cpp files differ from their transformers checkpoints by more than tensor
names: GLM (``chatglm``, ``glm4``), Gemma 2 and 3 (``gemma2``, ``gemma3``), gpt-oss (``gpt-oss``),
DeepSeek-V2/V3 (``deepseek2``), GLM-4.5 (``glm4moe``), Mistral Small 3.x and Ministral 3 (``mistral3``), OLMo 2/3
(``olmo2``), Granite 3 (``granite``), Seed-OSS (``seed_oss``), ERNIE 4.5 (``ernie4_5``, ``ernie4_5-moe``), Llama 4's
text model (``llama4``), Cohere2 (``cohere2``), EXAONE 4.0 (``exaone4``), Arcee (``arcee``), and the MoE files of
Qwen3-MoE (``qwen3moe``; Qwen3-VL-MoE's language model ``qwen3vlmoe`` alike), MiniMax-M2 (``minimax-m2``), Qwen2-MoE
(``qwen2moe``, with a shared expert) and Mixtral (``llama`` with experts), whose stacked experts
(``ffn_{gate,up,down}_exps``) are stored back one tensor per expert; Qwen3-Next and Qwen3.5 (``qwen3next``,
``qwen35``, ``qwen35moe``) have their own module, ``gguf_qwen3_next.py``.

Each has a config builder (the transformers config fields that llama.cpp keeps in metadata under gguf-py's
``Keys``, or fixes in its loader) and, where needed, a state-dict step in ``gguf_tensors.py`` that undoes what
convert_hf_to_gguf.py did to the tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from gguf import ExpertGatingFuncType, Keys

from . import gguf_hybrid, gguf_qwen3_next
from .gguf_rope import ROPE_FREQS

Meta = Callable[..., Any]  # (a gguf-py ``Keys`` template, default) -> that key of the file's architecture

ARCHITECTURES = {
    'chatglm': 'GlmForCausalLM',  # GLM-4-9B-chat; ChatGLM2/3 files of this architecture are refused
    'glm4': 'Glm4ForCausalLM',
    'gemma2': 'Gemma2ForCausalLM',
    'gemma3': 'Gemma3ForCausalLM',
    'gpt-oss': 'GptOssForCausalLM',
    'deepseek2': 'DeepseekV3ForCausalLM',  # DeepseekV2ForCausalLM where the router is a softmax
    'glm4moe': 'Glm4MoeForCausalLM',
    'qwen3moe': 'Qwen3MoeForCausalLM',
    'qwen2moe': 'Qwen2MoeForCausalLM',
    'mistral3': 'MistralForCausalLM',  # Mistral Small 3.x's language model; Ministral3ForCausalLM with its query scale
    'olmo2': 'Olmo2ForCausalLM',  # Olmo3ForCausalLM where the file has a sliding window
    'granite': 'GraniteForCausalLM',
    'seed_oss': 'SeedOssForCausalLM',
    'ernie4_5': 'Ernie4_5ForCausalLM',
    'ernie4_5-moe': 'Ernie4_5_MoeForCausalLM',
    'llama4': 'Llama4ForCausalLM',
    'cohere2': 'Cohere2ForCausalLM',
    'exaone4': 'Exaone4ForCausalLM',
    'arcee': 'ArceeForCausalLM',
    'minimax-m2': 'MiniMaxM2ForCausalLM',
    **gguf_qwen3_next.ARCHITECTURES,
    **gguf_hybrid.ARCHITECTURES,
}

# architectures whose every linear layer is a projection (or experts) that may be served as llama.cpp's blocks
# (llama.cpp never quantizes a router: ``ffn_gate_inp`` stays F32)
RAW_SERVED_ARCHS = ('llama', 'chatglm', 'glm4', 'glm4moe', 'gemma2', 'gemma3', 'qwen3moe', 'qwen3vlmoe',
                    'qwen2moe', 'mistral3', 'olmo2', 'granite', 'seed_oss', 'ernie4_5', 'ernie4_5-moe', 'llama4',
                    'cohere2', 'exaone4', 'arcee', 'minimax-m2', *gguf_qwen3_next.ARCHITECTURES,
                    *gguf_hybrid.ARCHITECTURES)

_ROUTER_BIAS = {'exp_probs_b.bias': 'mlp.gate.e_score_correction_bias'}
_SHARED_EXPERTS = {'ffn_gate_shexp': 'mlp.shared_experts.gate_proj', 'ffn_up_shexp': 'mlp.shared_experts.up_proj',
                   'ffn_down_shexp': 'mlp.shared_experts.down_proj'}
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
    'gpt-oss': {
        'post_attention_norm': 'post_attention_layernorm',
        'attn_sinks.weight': 'self_attn.sinks',
        'ffn_gate_inp': 'mlp.router',
        'ffn_gate_exps.weight': 'mlp.experts.gate', 'ffn_gate_exps.bias': 'mlp.experts.gate_bias',
        'ffn_up_exps.weight': 'mlp.experts.up', 'ffn_up_exps.bias': 'mlp.experts.up_bias',
        'ffn_down_exps.weight': 'mlp.experts.down', 'ffn_down_exps.bias': 'mlp.experts.down_proj_bias',
    },
    'qwen2moe': {'ffn_gate_inp_shexp': 'mlp.shared_expert_gate', 'ffn_gate_shexp': 'mlp.shared_expert.gate_proj',
                 'ffn_up_shexp': 'mlp.shared_expert.up_proj', 'ffn_down_shexp': 'mlp.shared_expert.down_proj'},
    'deepseek2': {
        'attn_q_a': 'self_attn.q_a_proj', 'attn_q_a_norm': 'self_attn.q_a_layernorm', 'attn_q_b': 'self_attn.q_b_proj',
        'attn_kv_a_mqa': 'self_attn.kv_a_proj_with_mqa', 'attn_kv_a_norm': 'self_attn.kv_a_layernorm',
        'attn_kv_b': 'self_attn.kv_b_proj', 'attn_k_b.weight': 'self_attn.k_b_proj',
        'attn_v_b.weight': 'self_attn.v_b_proj',
        'ffn_gate_inp': 'mlp.gate', **_ROUTER_BIAS, **_SHARED_EXPERTS,
    },
    # the layers' own tensors; the next-token-prediction layers' ``nextn.*`` ones have no counterpart
    'glm4moe': {'post_attention_norm': 'post_attention_layernorm', **_ROUTER_BIAS, **_SHARED_EXPERTS},
    'olmo2': _POST_NORM_NAMES,
    'exaone4': _POST_NORM_NAMES,
    'seed_oss': {'post_attention_norm': 'post_attention_layernorm'},
    'ernie4_5-moe': {'exp_probs_b.bias': 'mlp.moe_statics.e_score_correction_bias', **_SHARED_EXPERTS},
    # under the engine's ``mlp``; ``finish_state_dict`` names them ``feed_forward``, as Meta's checkpoints do
    'llama4': {'ffn_gate_inp': 'mlp.router', 'ffn_gate_shexp': 'mlp.shared_expert.gate_proj',
               'ffn_up_shexp': 'mlp.shared_expert.up_proj', 'ffn_down_shexp': 'mlp.shared_expert.down_proj'},
    'minimax-m2': _ROUTER_BIAS,
    **dict.fromkeys(gguf_qwen3_next.ARCHITECTURES, gguf_qwen3_next.LAYER_NAMES),
    **gguf_hybrid.LAYER_NAMES,
}


def unpermute_rotary(weight: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary halves) of Llama-derived models and towers."""
    dim = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, dim, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _layer_types(meta: Meta, layers: int, pattern: int) -> list[str]:
    """llama.cpp's sliding-window layers: the file's ``sliding_window_pattern`` (a step n, where the last
    layer of every n is global, or a flag per layer), else the architecture's fixed step."""
    value = meta(Keys.Attention.SLIDING_WINDOW_PATTERN, pattern)
    sliding = [bool(v) for v in value] if isinstance(value, list) else [i % value < value - 1 for i in range(layers)]
    return ['sliding_attention' if s else 'full_attention' for s in sliding]


def _gemma_query_scalar(config: dict[str, Any], layers_of_27b: int) -> int:
    """llama.cpp scales Gemma's queries by 1/sqrt(head_dim), and the 27B models' by 1/sqrt(hidden/heads)
    (it knows them by their layer count; the files carry no key for it)."""
    if config['num_hidden_layers'] == layers_of_27b:
        return config['hidden_size'] // config['num_attention_heads']
    return config['head_dim']


def _yarn(meta: Meta, theta: float) -> dict[str, Any]:
    params = {'rope_type': 'yarn', 'rope_theta': theta, 'factor': meta(Keys.Rope.SCALING_FACTOR),
              'original_max_position_embeddings': meta(Keys.Rope.SCALING_ORIG_CTX_LEN),
              'beta_fast': meta(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0),
              'beta_slow': meta(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)}
    if meta(Keys.Rope.SCALING_YARN_ATTN_FACTOR) is not None:
        params['attention_factor'] = meta(Keys.Rope.SCALING_YARN_ATTN_FACTOR)
    return params


def _rope(meta: Meta, theta: float) -> dict[str, Any]:
    """The rotary of the file's ``rope.scaling.type``: none, linear or YaRN."""
    kind = meta(Keys.Rope.SCALING_TYPE, 'none')
    if kind == 'yarn':
        return _yarn(meta, theta)
    if kind == 'linear':
        return {'rope_type': 'linear', 'rope_theta': theta, 'factor': meta(Keys.Rope.SCALING_FACTOR)}
    if kind != 'none':
        raise ValueError(f'unsupported GGUF rope scaling type {kind!r}')
    return {'rope_type': 'default', 'rope_theta': theta}


def _glm_rope(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    """GLM's rotary over the first ``rope.dimension_count`` features of each head (half where absent)."""
    rotary = meta(Keys.Rope.DIMENSION_COUNT) or config['head_dim'] // 2
    return {'rope_type': 'default', 'rope_theta': config['rope_theta'],
            'partial_rotary_factor': rotary / config['head_dim']}


def _glm4(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return {'rope_parameters': _glm_rope(meta, config)}


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


def _gpt_oss(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    rope = _rope(meta, config['rope_theta'])
    if rope['rope_type'] == 'yarn':
        rope['truncate'] = False  # gpt-oss's YaRN keeps its correction range unrounded
    return {'model_type': 'gpt_oss', 'intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            'num_local_experts': meta(Keys.LLM.EXPERT_COUNT), 'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'sliding_window': meta(Keys.Attention.SLIDING_WINDOW),
            'layer_types': _layer_types(meta, config['num_hidden_layers'], 2), 'rope_parameters': rope}


def _deepseek2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp runs MLA as multi-query attention over the latent: ``key_length``/``value_length`` are the
    latent's, the per-head sizes are ``*_length_mla`` (older files: the plain keys, with an unsplit kv_b). GLM-4.7-Flash
    converts to it, its ``nextn_predict_layers`` layers appended past the decoder's (not the decoder's)."""
    rope_dim = meta(Keys.Rope.DIMENSION_COUNT)
    if meta(Keys.Attention.KEY_LENGTH_MLA) is not None:
        key_dim, value_dim = meta(Keys.Attention.KEY_LENGTH_MLA), meta(Keys.Attention.VALUE_LENGTH_MLA)
    else:
        key_dim, value_dim = meta(Keys.Attention.KEY_LENGTH), meta(Keys.Attention.VALUE_LENGTH)
    rope = _rope(meta, config['rope_theta'])
    if rope['rope_type'] == 'yarn' and meta(Keys.Rope.SCALING_YARN_LOG_MUL) is not None:
        # the converter writes 0.1 * mscale_all_dim (in float32); llama.cpp's rotary assumes mscale equal to it
        rope['mscale'] = rope['mscale_all_dim'] = round(meta(Keys.Rope.SCALING_YARN_LOG_MUL) / 0.1, 6)
    sigmoid = meta(Keys.LLM.EXPERT_GATING_FUNC) == ExpertGatingFuncType.SIGMOID
    groups = meta(Keys.LLM.EXPERT_GROUP_COUNT, 1)
    fields = {
        'model_type': 'deepseek_v3' if sigmoid else 'deepseek_v2',
        'architectures': ['DeepseekV3ForCausalLM' if sigmoid else 'DeepseekV2ForCausalLM'],
        'num_hidden_layers': config['num_hidden_layers'] - meta(Keys.LLM.NEXTN_PREDICT_LAYERS, 0),
        'num_key_value_heads': config['num_attention_heads'], 'head_dim': rope_dim,
        'q_lora_rank': meta(Keys.Attention.Q_LORA_RANK) if 'blk.0.attn_q_a.weight' in tensors else None,
        'kv_lora_rank': meta(Keys.Attention.KV_LORA_RANK), 'qk_rope_head_dim': rope_dim,
        'qk_nope_head_dim': key_dim - rope_dim, 'v_head_dim': value_dim,
        'first_k_dense_replace': meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
        'n_routed_experts': meta(Keys.LLM.EXPERT_COUNT), 'n_shared_experts': meta(Keys.LLM.EXPERT_SHARED_COUNT, 0),
        'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT), 'n_group': groups,
        'topk_group': meta(Keys.LLM.EXPERT_GROUP_USED_COUNT, 1),
        'routed_scaling_factor': meta(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
        'norm_topk_prob': bool(meta(Keys.LLM.EXPERT_WEIGHTS_NORM, False)), 'rope_parameters': rope,
    }
    if not sigmoid:
        fields['topk_method'] = 'group_limited_greedy' if groups > 1 else 'greedy'
    return fields


def _glm4moe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's routing keys, GLM's partial rotary (in halves: the converter leaves q/k unpermuted); the
    ``nextn_predict_layers`` layers that the converter appends past the decoder's are not the decoder's."""
    return {'model_type': 'glm4_moe', 'rope_parameters': _glm_rope(meta, config),
            'num_hidden_layers': config['num_hidden_layers'] - meta(Keys.LLM.NEXTN_PREDICT_LAYERS, 0),
            'use_qk_norm': 'blk.0.attn_q_norm.weight' in tensors,
            'first_k_dense_replace': meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
            'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            'n_routed_experts': meta(Keys.LLM.EXPERT_COUNT), 'n_shared_experts': meta(Keys.LLM.EXPERT_SHARED_COUNT, 0),
            'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT), 'n_group': meta(Keys.LLM.EXPERT_GROUP_COUNT, 1),
            'topk_group': meta(Keys.LLM.EXPERT_GROUP_USED_COUNT, 1),
            'routed_scaling_factor': meta(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
            'norm_topk_prob': bool(meta(Keys.LLM.EXPERT_WEIGHTS_NORM, False))}


def _experts(meta: Meta, config: dict[str, Any], renormalize: bool = True) -> dict[str, Any]:
    """The routing of a MoE file: llama.cpp renormalizes the top-k weights of Qwen3-MoE and Mixtral, not
    Qwen2-MoE's, unless the file says (``expert_weights_norm``)."""
    return {'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, config['intermediate_size']),
            'norm_topk_prob': bool(meta(Keys.LLM.EXPERT_WEIGHTS_NORM, renormalize))}


def _qwen3moe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return {'model_type': 'qwen3_moe', 'num_experts': meta(Keys.LLM.EXPERT_COUNT), **_experts(meta, config)}


def _qwen2moe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Every layer sparse, with a shared expert where the file has one (llama.cpp's fixed layout)."""
    shared = meta(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH) if 'blk.0.ffn_gate_shexp.weight' in tensors else None
    return {'model_type': 'qwen2_moe', 'num_experts': meta(Keys.LLM.EXPERT_COUNT), 'decoder_sparse_step': 1,
            'mlp_only_layers': [], 'shared_expert_intermediate_size': shared,
            **_experts(meta, config, renormalize=False)}


def _llama(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A ``llama`` file with experts is a Mixtral (their stacked ``ffn_*_exps``; older files' tensors per
    expert are not read)."""
    if not meta(Keys.LLM.EXPERT_COUNT):
        return {}
    if 'blk.0.ffn_gate_exps.weight' not in tensors:
        raise ValueError('a llama file with experts needs them stacked (ffn_gate_exps): convert it again with a '
                         'current llama.cpp')
    fields = _experts(meta, config)
    return {'model_type': 'mixtral', 'architectures': ['MixtralForCausalLM'],
            'num_local_experts': meta(Keys.LLM.EXPERT_COUNT), 'intermediate_size': fields.pop('moe_intermediate_size'),
            **fields}


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


def _ernie4_5_moe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The sparse layers from ``leading_dense_block_count`` on, every ``interleave_moe_layer_step``-th."""
    has_shared = any(name.endswith('ffn_gate_shexp.weight') for name in tensors)
    shared = meta(Keys.LLM.EXPERT_SHARED_COUNT, 0) if has_shared else 0
    return {**_ernie4_5(meta, tensors, config), 'model_type': 'ernie4_5_moe',
            'moe_num_experts': meta(Keys.LLM.EXPERT_COUNT), 'moe_k': meta(Keys.LLM.EXPERT_USED_COUNT),
            'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), 'moe_num_shared_experts': shared,
            'moe_layer_start_index': meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
            'moe_layer_interval': meta(Keys.LLM.INTERLEAVE_MOE_LAYER_STEP, 1), 'moe_layer_end_index': -1}


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


# What llama.cpp's loader fixes for ``llama4`` files with chunked attention (it reads no key for them): chunks of
# 8192 positions on the rope layers, a NoPE layer every 4th, and those layers' query temperature (floor 8192, scale
# 0.1): Scout's and Maverick's values, and transformers' ``Llama4TextConfig`` defaults. It leaves the q/k L2 norm
# out of the 128-expert model (Maverick, whose config turns it off) only.
LLAMA4_CHUNK, LLAMA4_NO_ROPE_STEP, LLAMA4_TEMPERATURE = 8192, 4, {'floor_scale': 8192, 'attn_scale': 0.1}
LLAMA4_WITHOUT_QK_NORM_EXPERTS = 128


def _llama4(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Llama 4's text model: every ``interleave_moe_layer_step``-th layer MoE (none in a file without experts), the
    dense layers' MLP of ``feed_forward_length``; chunked attention with NoPE layers unless the file's sliding
    window is 0 (MobileLLM-R1's files: every layer rotates, none is chunked). Llama 4's llama3 rotary comes from
    its ``rope_freqs`` divisors."""
    step = meta(Keys.LLM.INTERLEAVE_MOE_LAYER_STEP)
    if not step:
        raise ValueError('missing GGUF metadata: llama4.interleave_moe_layer_step')
    layers, experts = config['num_hidden_layers'], meta(Keys.LLM.EXPERT_COUNT, 0)
    chunked = meta(Keys.Attention.SLIDING_WINDOW) != 0
    rotates = [int(not chunked or (i + 1) % LLAMA4_NO_ROPE_STEP != 0) for i in range(layers)]
    return {'model_type': 'llama4_text', 'intermediate_size_mlp': config['intermediate_size'],
            'intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, config['intermediate_size']),
            'num_local_experts': experts, 'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT, 1),
            'interleave_moe_layer_step': step, 'moe_layers': list(range(step - 1, layers, step)) if experts else [],
            'use_qk_norm': experts != LLAMA4_WITHOUT_QK_NORM_EXPERTS, 'no_rope_layers': rotates,
            'attention_chunk_size': LLAMA4_CHUNK if chunked else None,
            'layer_types': ['chunked_attention' if chunked and rope else 'full_attention' for rope in rotates],
            'attn_temperature_tuning': chunked, **LLAMA4_TEMPERATURE}


def _minimax_m2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Every layer sparse, routed by sigmoid with the correction bias (llama.cpp's fixed routing for it); the rotary
    over ``rope.dimension_count`` (the config's ``rotary_dim``) of each head's features."""
    rope = {**_rope(meta, config['rope_theta']),
            'partial_rotary_factor': meta(Keys.Rope.DIMENSION_COUNT) / config['head_dim']}
    return {'model_type': 'minimax_m2', 'num_local_experts': meta(Keys.LLM.EXPERT_COUNT),
            'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), 'rope_parameters': rope}


CONFIG_BUILDERS: dict[str, Callable[[Meta, dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    'llama': _llama, 'chatglm': _chatglm, 'glm4': _glm4, 'gemma2': _gemma2, 'gemma3': _gemma3, 'gpt-oss': _gpt_oss,
    'deepseek2': _deepseek2, 'glm4moe': _glm4moe, 'qwen3moe': _qwen3moe, 'qwen3vlmoe': _qwen3moe, 'qwen2moe': _qwen2moe,
    'mistral3': _mistral3, 'olmo2': _olmo2, 'granite': _granite, 'seed_oss': _seed_oss, 'ernie4_5': _ernie4_5,
    'ernie4_5-moe': _ernie4_5_moe, 'llama4': _llama4, 'cohere2': _cohere2, 'exaone4': _exaone4,
    'arcee': _arcee, 'minimax-m2': _minimax_m2,
    **gguf_qwen3_next.CONFIG_BUILDERS, **gguf_hybrid.CONFIG_BUILDERS}
