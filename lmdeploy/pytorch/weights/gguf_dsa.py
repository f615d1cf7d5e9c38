"""GLM-5's llama.cpp files (``glm-dsa``): convert_hf_to_gguf.py's ``GlmMoeDsaModel`` is its ``DeepseekV2Model``
(``deepseek2``'s keys and tensors: MLA's ``kv_b`` split into ``k_b``/``v_b``, the experts stacked, nothing permuted)
plus the DeepSeek Sparse Attention indexer: its ``attention.indexer.{head_count,key_length,top_k}`` keys and each
layer's ``indexer.{attn_q_b,attn_k,k_norm,proj}`` tensors, named back as the checkpoint's ``wq_b``, ``wk``,
``k_norm`` and ``weights_proj``. The next-token-prediction layers it appends past the decoder's
(``nextn_predict_layers``) are not the decoder's. Registered in ``gguf_archs.py``; the state-dict step is
``deepseek2``'s (``gguf_tensors.py``)."""
from __future__ import annotations

from typing import Any

from gguf import Keys

from . import gguf_moe_archs
from .gguf_keys import Meta, required

ARCHITECTURES = {'glm-dsa': 'GlmMoeDsaForCausalLM'}
INDEXER_TYPES = '{arch}.attention.indexer.types'  # not among gguf 0.19's ``Keys``; llama.cpp's converter writes it

_INDEXER_NAMES = {'indexer.attn_q_b': 'self_attn.indexer.wq_b', 'indexer.attn_k': 'self_attn.indexer.wk',
                  'indexer.k_norm': 'self_attn.indexer.k_norm', 'indexer.proj': 'self_attn.indexer.weights_proj'}
LAYER_NAMES = {'glm-dsa': {**gguf_moe_archs.LAYER_NAMES['deepseek2'], **_INDEXER_NAMES}}


def _glm_dsa(meta: Meta, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``deepseek2``'s fields with GLM-5's routing (sigmoid, with the correction bias) and the indexer's keys; a
    rotary narrower than ``qk_rope_head_dim`` (the converter's ``partial_rotary_factor``) is refused."""
    heads, key_dim, top_k = required(meta, Keys.Attention.Indexer.HEAD_COUNT, Keys.Attention.Indexer.KEY_LENGTH,
                                     Keys.Attention.Indexer.TOP_K)
    fields = gguf_moe_archs.CONFIG_BUILDERS['deepseek2'](meta, tensors, config)
    fields.pop('topk_method', None)  # GLM-5 routes by sigmoid whatever the file's ``expert_gating_func``
    kv_a = tensors.get('blk.0.attn_kv_a_mqa.weight')
    if kv_a is not None and int(kv_a.shape[-1]) != fields['kv_lora_rank'] + fields['qk_rope_head_dim']:
        raise ValueError(f'blk.0.attn_kv_a_mqa.weight has {int(kv_a.shape[-1])} rows, not kv_lora_rank '
                         f'({fields["kv_lora_rank"]}) + rope.dimension_count ({fields["qk_rope_head_dim"]}): '
                         'a partial rotary (partial_rotary_factor below 1) is not supported')
    return fields | {'model_type': 'glm_moe_dsa', 'architectures': [ARCHITECTURES['glm-dsa']],
                     'index_n_heads': heads, 'index_head_dim': key_dim, 'index_topk': top_k,
                     'indexer_types': _indexer_types(meta, tensors, fields['num_hidden_layers'])}


def _indexer_types(meta: Meta, tensors: dict[str, Any], layers: int) -> list[str]:
    """Each decoder layer's ``full`` or ``shared``: the file's ``attention.indexer.types`` (a flag a layer, true for
    ``full``, as current converters write it), else ``full`` where the layer has indexer tensors (older converters
    write no key; GLM-5's checkpoints leave a ``shared`` layer's indexer out)."""
    has_indexer = [f'blk.{i}.indexer.attn_k.weight' in tensors for i in range(layers)]
    flags = meta(INDEXER_TYPES)
    if flags is None:
        flags = has_indexer
    elif len(flags) != layers:
        raise ValueError(f'attention.indexer.types has {len(flags)} flags, not one for each of the {layers} decoder '
                         'layers')
    lacking = [i for i, (full, has) in enumerate(zip(flags, has_indexer)) if full and not has]
    if lacking:
        raise ValueError(f'attention.indexer.types marks layer {lacking[0]} full, but the file has no '
                         f'blk.{lacking[0]}.indexer tensors; the file is incomplete: re-download it')
    return ['full' if full else 'shared' for full in flags]


CONFIG_BUILDERS = {'glm-dsa': _glm_dsa}
