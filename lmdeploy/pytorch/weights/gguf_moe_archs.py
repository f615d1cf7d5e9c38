"""GGUF architectures of MoE families whose llama.cpp files differ from their transformers checkpoints by more than
tensor names: gpt-oss (``gpt-oss``), DeepSeek-V2/V3 (``deepseek2``), GLM-4.5 (``glm4moe``), ERNIE 4.5's MoE
(``ernie4_5-moe``), Llama 4's text model (``llama4``), Hunyuan-A13B (``hunyuan-moe``), and the files of Qwen3-MoE
(``qwen3moe``; Qwen3-VL-MoE's language model ``qwen3vlmoe`` alike), MiniMax-M2 (``minimax-m2``), Qwen2-MoE
(``qwen2moe``, with a shared expert), OLMoE (``olmoe``), Mixtral (``llama`` with experts), PhiMoE (``phimoe``),
dots.llm1 (``dots1``), K-EXAONE (``exaone-moe``), Arcee Trinity (``afmoe``), MiMo-V2-Flash (``mimo2``) and
Mistral Small 4 (``mistral4``: DeepSeek's MLA, Mistral's routing), whose stacked experts
(``ffn_{gate,up,down}_exps``) are stored back one tensor per expert. Registered in ``gguf_archs.py`` as
``gguf_qwen3_next.py`` is; the state-dict steps are in ``gguf_tensors.py``.
"""
from __future__ import annotations

from typing import Any, Callable

from gguf import ExpertGatingFuncType, Keys

from .gguf_keys import Meta, glm_rope, layer_types, rope_parameters
from .gguf_rope import phi3_rope

ARCHITECTURES = {
    'gpt-oss': 'GptOssForCausalLM',
    'deepseek2': 'DeepseekV3ForCausalLM',  # DeepseekV2ForCausalLM where the router is a softmax
    'glm4moe': 'Glm4MoeForCausalLM',
    'qwen3moe': 'Qwen3MoeForCausalLM',
    'qwen2moe': 'Qwen2MoeForCausalLM',
    'ernie4_5-moe': 'Ernie4_5_MoeForCausalLM',
    'llama4': 'Llama4ForCausalLM',
    'minimax-m2': 'MiniMaxM2ForCausalLM',
    'hunyuan-moe': 'HunYuanMoEV1ForCausalLM',
    'olmoe': 'OlmoeForCausalLM',
    'phimoe': 'PhimoeForCausalLM',
    'dots1': 'Dots1ForCausalLM',
    'exaone-moe': 'ExaoneMoeForCausalLM',
    'afmoe': 'AfmoeForCausalLM',
    'mimo2': 'MiMoV2FlashForCausalLM',
    'mistral4': 'Mistral4ForCausalLM',
}

# those whose every linear layer is a projection or experts (not MLA's, not gpt-oss's biased experts)
RAW_SERVED_ARCHS = ('glm4moe', 'qwen3moe', 'qwen3vlmoe', 'qwen2moe', 'ernie4_5-moe', 'llama4', 'minimax-m2',
                    'hunyuan-moe', 'olmoe', 'phimoe', 'dots1', 'exaone-moe')

# Hunyuan's q/k norms (after the rotary), dense (``gguf_archs.py``) and MoE alike
HUNYUAN_QK_NORMS = {'attn_q_norm': 'self_attn.query_layernorm', 'attn_k_norm': 'self_attn.key_layernorm'}
_ROUTER_BIAS = {'exp_probs_b.bias': 'mlp.gate.e_score_correction_bias'}
_SHARED_EXPERTS = {'ffn_gate_shexp': 'mlp.shared_experts.gate_proj', 'ffn_up_shexp': 'mlp.shared_experts.up_proj',
                   'ffn_down_shexp': 'mlp.shared_experts.down_proj'}
# as ``gguf_archs.LAYER_NAMES``: ``mlp.experts.{gate,up}`` and ``self_attn.{k,v}_b_proj`` are merged by
# ``finish_state_dict``
LAYER_NAMES: dict[str, dict[str, str]] = {
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
    'ernie4_5-moe': {'exp_probs_b.bias': 'mlp.moe_statics.e_score_correction_bias', **_SHARED_EXPERTS},
    # under the engine's ``mlp``; ``finish_state_dict`` names them ``feed_forward``, as Meta's checkpoints do
    'llama4': {'ffn_gate_inp': 'mlp.router', 'ffn_gate_shexp': 'mlp.shared_expert.gate_proj',
               'ffn_up_shexp': 'mlp.shared_expert.up_proj', 'ffn_down_shexp': 'mlp.shared_expert.down_proj'},
    'minimax-m2': _ROUTER_BIAS,
    'dots1': {**_ROUTER_BIAS, **_SHARED_EXPERTS},
    # the router's correction bias under the hub checkpoints' name
    'exaone-moe': {'exp_probs_b.bias': 'mlp.e_score_correction_bias', **_SHARED_EXPERTS},
    'afmoe': {'post_attention_norm': 'post_attention_layernorm', 'ffn_norm': 'pre_mlp_layernorm',
              'post_ffw_norm': 'post_mlp_layernorm', 'attn_gate': 'self_attn.gate_proj',
              'ffn_gate_inp': 'mlp.router.gate', 'exp_probs_b.bias': 'mlp.expert_bias', **_SHARED_EXPERTS},
    'hunyuan-moe': {**HUNYUAN_QK_NORMS, 'ffn_gate_inp': 'mlp.gate.wg', 'ffn_gate_shexp': 'mlp.shared_mlp.gate_proj',
                    'ffn_up_shexp': 'mlp.shared_mlp.up_proj', 'ffn_down_shexp': 'mlp.shared_mlp.down_proj'},
    'mimo2': {'attn_sinks.weight': 'self_attn.attention_sink_bias', **_ROUTER_BIAS},
}
# Mistral 4: ``deepseek2``'s names, its experts' gate and up stacked in one tensor (split by ``finish_state_dict``)
LAYER_NAMES['mistral4'] = {**LAYER_NAMES['deepseek2'], 'ffn_gate_up_exps': 'mlp.experts.gate_up_proj'}


def _gpt_oss(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    rope = rope_parameters(meta, config['rope_theta'])
    if rope['rope_type'] == 'yarn':
        rope['truncate'] = False  # gpt-oss's YaRN keeps its correction range unrounded
    return {'model_type': 'gpt_oss', 'intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            'num_local_experts': meta(Keys.LLM.EXPERT_COUNT), 'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'sliding_window': meta(Keys.Attention.SLIDING_WINDOW),
            'layer_types': layer_types(meta, config['num_hidden_layers'], 2), 'rope_parameters': rope}


def _deepseek2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp runs MLA as multi-query attention over the latent: ``key_length``/``value_length`` are the
    latent's, the per-head sizes are ``*_length_mla`` (older files: the plain keys, with an unsplit kv_b). GLM-4.7-Flash
    converts to it, its ``nextn_predict_layers`` layers appended past the decoder's (not the decoder's)."""
    rope_dim = meta(Keys.Rope.DIMENSION_COUNT)
    if meta(Keys.Attention.KEY_LENGTH_MLA) is not None:
        key_dim, value_dim = meta(Keys.Attention.KEY_LENGTH_MLA), meta(Keys.Attention.VALUE_LENGTH_MLA)
    else:
        key_dim, value_dim = meta(Keys.Attention.KEY_LENGTH), meta(Keys.Attention.VALUE_LENGTH)
    rope = rope_parameters(meta, config['rope_theta'])
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
    return {'model_type': 'glm4_moe', 'rope_parameters': glm_rope(meta, config),
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


def _ernie4_5_moe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5's fields (``gguf_archs.py``), its sparse layers from ``leading_dense_block_count`` on, every
    ``interleave_moe_layer_step``-th."""
    has_shared = any(name.endswith('ffn_gate_shexp.weight') for name in tensors)
    shared = meta(Keys.LLM.EXPERT_SHARED_COUNT, 0) if has_shared else 0
    return {'model_type': 'ernie4_5_moe', 'rope_parameters': rope_parameters(meta, config['rope_theta']),
            'use_bias': 'blk.0.attn_q.bias' in tensors,
            'moe_num_experts': meta(Keys.LLM.EXPERT_COUNT), 'moe_k': meta(Keys.LLM.EXPERT_USED_COUNT),
            'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), 'moe_num_shared_experts': shared,
            'moe_layer_start_index': meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
            'moe_layer_interval': meta(Keys.LLM.INTERLEAVE_MOE_LAYER_STEP, 1), 'moe_layer_end_index': -1}


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
    rope = {**rope_parameters(meta, config['rope_theta']),
            'partial_rotary_factor': meta(Keys.Rope.DIMENSION_COUNT) / config['head_dim']}
    return {'model_type': 'minimax_m2', 'num_local_experts': meta(Keys.LLM.EXPERT_COUNT),
            'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH), 'rope_parameters': rope}


def _hunyuan_moe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan-A13B: every layer's experts of ``feed_forward_length`` (llama.cpp's sizes for them) and its shared
    MLP of ``expert_shared_feed_forward_length`` (the same in transformers' model: another is refused); the
    converter writes NTK-alpha's stretched base, ``rope_theta * alpha ** (d / (d - 2))``, as ``rope.freq_base``
    with no scaling: a plain rotary of that base."""
    shared = meta(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, config['intermediate_size'])
    if shared != config['intermediate_size']:
        raise ValueError(f'a hunyuan-moe file whose shared MLP ({shared} features) differs from its experts '
                         f'({config["intermediate_size"]}) is not supported')
    return {'model_type': 'hunyuan_v1_moe', 'num_experts': meta(Keys.LLM.EXPERT_COUNT),
            'moe_topk': meta(Keys.LLM.EXPERT_USED_COUNT),
            'rope_parameters': rope_parameters(meta, config['rope_theta'])}

def _olmoe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """OLMoE: every layer sparse, the top-k weights left as the softmax gives them (llama.cpp's fixed routing for it,
    unless the file says); q/k rows unpermuted, their norms over all heads; no ``clip_qkv`` (the converter writes
    none for OLMoE)."""
    fields = _experts(meta, config, renormalize=False)
    return {'model_type': 'olmoe', 'rope_parameters': rope_parameters(meta, config['rope_theta']),
            'num_experts': meta(Keys.LLM.EXPERT_COUNT), 'intermediate_size': fields.pop('moe_intermediate_size'),
            **fields}


def _phimoe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """PhiMoE: Phi-3's rope keys and LongRoPE factors, with the one ``rope.scaling.attn_factor`` the converter
    computes from the context lengths as both cos/sin factors (``short_mscale``, ``long_mscale``: the file keeps no
    other); every layer's experts of ``feed_forward_length``; an LM head bias where the file has ``output.bias``.
    The sparsemixer's ``router_jitter_noise`` is not kept: transformers' default, the hub checkpoints' 0.01."""
    fields = phi3_rope(lambda name: meta(f'{{arch}}.{name}'), tensors, config['head_dim'], 'the file')
    rope = fields['rope_parameters']
    if rope.get('rope_type') == 'longrope':
        rope['short_mscale'] = rope['long_mscale'] = rope.pop('attention_factor', 1.0)
    return {**fields, 'model_type': 'phimoe', 'sliding_window': fields['sliding_window'] or None,
            'num_local_experts': meta(Keys.LLM.EXPERT_COUNT), 'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'lm_head_bias': 'output.bias' in tensors}


def _dots1(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """dots.llm1: DeepSeek-V3's routing keys in one group (llama.cpp's fixed routing for it: sigmoid with the
    correction bias), q/k rows unpermuted with their per-head norms; every layer full attention, as llama.cpp runs
    it (the converter writes no window)."""
    return {'model_type': 'dots1', 'rope_parameters': rope_parameters(meta, config['rope_theta']),
            'sliding_window': None, 'layer_types': ['full_attention'] * config['num_hidden_layers'],
            'first_k_dense_replace': meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
            'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            'n_routed_experts': meta(Keys.LLM.EXPERT_COUNT), 'n_shared_experts': meta(Keys.LLM.EXPERT_SHARED_COUNT, 0),
            'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT), 'n_group': 1, 'topk_group': 1,
            'routed_scaling_factor': meta(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
            'norm_topk_prob': bool(meta(Keys.LLM.EXPERT_WEIGHTS_NORM, False))}


def _exaone_moe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """K-EXAONE: EXAONE 4's attention keys (with a sliding window its layers per the file's
    ``sliding_window_pattern``, a step of 4 where absent; q/k rows unpermuted) and DeepSeek-V3's routing in one group
    (llama.cpp's: sigmoid with the correction bias; the converter writes no group count), the leading dense layers
    Llama's MLP; the ``nextn_predict_layers`` layers appended past the decoder's are not the decoder's."""
    layers = config['num_hidden_layers'] - meta(Keys.LLM.NEXTN_PREDICT_LAYERS, 0)
    window, dense = meta(Keys.Attention.SLIDING_WINDOW), meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    return {'model_type': 'exaone_moe', 'num_hidden_layers': layers, 'sliding_window': window or None,
            'layer_types': layer_types(meta, layers, 4) if window else ['full_attention'] * layers,
            'rope_parameters': rope_parameters(meta, config['rope_theta']),
            'mlp_layer_types': ['dense' if i < dense else 'sparse' for i in range(layers)],
            'first_k_dense_replace': dense, 'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            'num_experts': meta(Keys.LLM.EXPERT_COUNT), 'num_shared_experts': meta(Keys.LLM.EXPERT_SHARED_COUNT, 0),
            'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT), 'n_group': 1, 'topk_group': 1,
            'routed_scaling_factor': meta(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
            'norm_topk_prob': bool(meta(Keys.LLM.EXPERT_WEIGHTS_NORM, False))}


# llama.cpp's fixed layout of ``afmoe`` files: a global layer every 4th (the hub's ``global_attn_every_n_layers``)
AFMOE_GLOBAL_STEP = 4


def _afmoe(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Arcee Trinity: local layers by llama.cpp's fixed step (a global one every 4th) over the file's window, the
    embeddings scaled by muP (llama.cpp always scales them), DeepSeek-V3's routing in one group scaled by
    ``expert_weights_scale``; q/k rows unpermuted (the converter bypasses Llama's permutation)."""
    layers = config['num_hidden_layers']
    return {'model_type': 'afmoe', 'rope_parameters': rope_parameters(meta, config['rope_theta']),
            'sliding_window': meta(Keys.Attention.SLIDING_WINDOW), 'global_attn_every_n_layers': AFMOE_GLOBAL_STEP,
            'layer_types': layer_types(meta, layers, AFMOE_GLOBAL_STEP), 'mup_enabled': True,
            'num_dense_layers': meta(Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0),
            'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            'num_experts': meta(Keys.LLM.EXPERT_COUNT), 'num_shared_experts': meta(Keys.LLM.EXPERT_SHARED_COUNT, 0),
            'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'route_scale': meta(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0)}


def _mimo2(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """MiMo-V2-Flash: the sliding layers by the file's ``sliding_window_pattern`` (a flag per layer), of twice the
    full layers' KV heads (``head_count_kv`` per layer: transformers' model doubles them, another ratio is refused);
    the window the hub's ``sliding_window_size``, which transformers widens by the query itself; a rope per layer
    type (``rope.freq_base`` and ``rope.freq_base_swa``) over ``rope.dimension_count`` features of ``key_length``,
    values of ``value_length``; dense layers where the file has no router. The converter writes no
    ``attention_value_scale``: transformers' (the hub's) 0.707 stands."""
    layers = config['num_hidden_layers']
    kinds = layer_types(meta, layers, layers)
    kv_heads = meta(Keys.Attention.HEAD_COUNT_KV)
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    full = {kv for kv, kind in zip(kv_heads, kinds) if kind == 'full_attention'}
    sliding = {kv // 2 for kv, kind in zip(kv_heads, kinds) if kind == 'sliding_attention'}
    if len(full | sliding) != 1 or any(kv % 2 for kv, kind in zip(kv_heads, kinds) if kind == 'sliding_attention'):
        raise ValueError(f'a mimo2 file whose sliding layers have other than twice the full layers\' KV heads '
                         f'(head_count_kv {kv_heads}) is not supported')
    head_dim = config['head_dim']
    # the fraction whose int(head_dim * fraction) transformers takes back to the file's rotary features
    rotary = (meta(Keys.Rope.DIMENSION_COUNT) + 0.5) / head_dim
    rope = {'full_attention': {'rope_type': 'default', 'rope_theta': config['rope_theta'],
                               'partial_rotary_factor': rotary},
            'sliding_attention': {'rope_type': 'default', 'rope_theta': meta(Keys.Rope.FREQ_BASE_SWA, 10000.0),
                                  'partial_rotary_factor': rotary}}
    return {'model_type': 'mimo_v2_flash', 'num_key_value_heads': (full | sliding).pop(), 'layer_types': kinds,
            'sliding_window': meta(Keys.Attention.SLIDING_WINDOW) + 1, 'rope_parameters': rope,
            'v_head_dim': meta(Keys.Attention.VALUE_LENGTH, head_dim),
            'mlp_layer_types': ['sparse' if f'blk.{i}.ffn_gate_inp.weight' in tensors else 'dense'
                                for i in range(layers)],
            'moe_intermediate_size': meta(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
            'n_routed_experts': meta(Keys.LLM.EXPERT_COUNT), 'num_experts_per_tok': meta(Keys.LLM.EXPERT_USED_COUNT),
            'n_group': 1, 'topk_group': 1, 'routed_scaling_factor': meta(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0),
            'norm_topk_prob': bool(meta(Keys.LLM.EXPERT_WEIGHTS_NORM, True))}


def _mistral4(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Mistral Small 4's language model, as convert_hf_to_gguf.py's ``Mistral4Model`` (its ``DeepseekV2Model``)
    writes it: ``deepseek2``'s fields, routed by softmax whatever ``expert_gating_func`` says; the queries scaled by
    position where the file says (``attention.temperature_scale``, the step ``attention.temperature_length`` or
    YaRN's original context), as llama.cpp scales them."""
    fields = _deepseek2(meta, tensors, config)
    fields.pop('topk_method', None)
    # transformers' Mistral 4 turns the rotary part as a share of whole heads (DeepSeek's config: of a rotary head)
    head_dim = fields['qk_nope_head_dim'] + fields['qk_rope_head_dim']
    rope = fields['rope_parameters'] | {'partial_rotary_factor': fields['qk_rope_head_dim'] / head_dim}
    beta = meta(Keys.Attention.TEMPERATURE_SCALE)
    if beta:
        period = meta(Keys.Attention.TEMPERATURE_LENGTH) or rope.get('original_max_position_embeddings')
        if not period:
            raise ValueError('a mistral4 file whose queries are scaled by position (attention.temperature_scale) '
                             'needs its step: attention.temperature_length or YaRN\'s original context length')
        rope |= {'llama_4_scaling_beta': beta, 'original_max_position_embeddings': period}
    return fields | {'model_type': 'mistral4', 'architectures': [ARCHITECTURES['mistral4']], 'head_dim': head_dim,
                     'rope_parameters': rope}


CONFIG_BUILDERS: dict[str, Callable[[Meta, dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    'llama': _llama, 'gpt-oss': _gpt_oss, 'deepseek2': _deepseek2, 'glm4moe': _glm4moe, 'qwen3moe': _qwen3moe,
    'qwen3vlmoe': _qwen3moe, 'qwen2moe': _qwen2moe, 'ernie4_5-moe': _ernie4_5_moe, 'llama4': _llama4,
    'minimax-m2': _minimax_m2, 'hunyuan-moe': _hunyuan_moe, 'olmoe': _olmoe, 'phimoe': _phimoe,
    'dots1': _dots1, 'exaone-moe': _exaone_moe,
    'afmoe': _afmoe,
    'mimo2': _mimo2,
    'mistral4': _mistral4}
