"""State-dict steps that undo, per GGUF architecture, what llama.cpp's convert_hf_to_gguf.py did to the tensors
beyond renaming them (see ``gguf_archs.py``): GLM-4's fused ``attn_qkv``, Gemma's ``1 + weight`` norms, gpt-oss's
split and transposed experts (and its MXFP4 blocks), DeepSeek's split ``kv_b``, Llama 4's split and transposed
experts, the stacked experts of the MoE files, stored back one tensor per expert (Granite 3 MoE's dense ones
fused again, as its checkpoints hold them), and Qwen3-Next's and Qwen3.5's
linear attention (``gguf_qwen3_next.py``).
"""
from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import torch

from .gguf_gemma3n import FINISHERS as GEMMA3N_FINISHERS
from .gguf_hybrid import FINISHERS as MAMBA2_FINISHERS
from .gguf_lfm2 import ARCHITECTURES as LFM2_ARCHS
from .gguf_lfm2 import unsqueeze_conv
from .gguf_mamba import FINISHERS as MAMBA1_FINISHERS
from .gguf_qwen3_next import ARCHITECTURES as HYBRID_ARCHS
from .gguf_qwen3_next import finish_hybrid


def shared_tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor of its own storage without a copy, also where it is a read-only view of the mapped GGUF
    file (only read, to be written out) or one expert of a stacked array: safetensors writes tensors of distinct
    storages straight from their memory."""
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='The given NumPy array is not writable')
        return torch.from_numpy(array)


def _layer_prefixes(state_dict: dict[str, torch.Tensor], suffix: str) -> list[str]:
    return [name.removesuffix(suffix) for name in state_dict if name.endswith(suffix)]


def _split_qkv(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """A fused ``qkv_proj`` (q, k and v rows stacked: weight, bias, or the rows of a kept ``qweight``) back
    into ``q_proj``, ``k_proj`` and ``v_proj``, as ``GlmForCausalLM`` holds them."""
    rows = [heads * config['head_dim'] for heads in
            (config['num_attention_heads'], config['num_key_value_heads'], config['num_key_value_heads'])]
    for name in [name for name in state_dict if '.self_attn.qkv_proj.' in name]:
        prefix, _, kind = name.rpartition('.qkv_proj.')
        for proj, part in zip('qkv', state_dict.pop(name).split(rows)):
            state_dict[f'{prefix}.{proj}_proj.{kind}'] = part


def _gemma_norms(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """llama.cpp stores Gemma's norms as ``1 + weight``; in fp32 ``1 + (stored - 1)`` is ``stored`` again."""
    for name, value in state_dict.items():
        if name.endswith('norm.weight'):
            state_dict[name] = value - 1


def mxfp4_from_ggml(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's MXFP4 blocks ``uint8 [..., K / 32 * 17]`` (an e8m0 scale byte, then 16 bytes whose low nibbles
    hold the e2m1 codes of inputs 0-15 and high nibbles those of 16-31) as an MXFP4 checkpoint's ``blocks [...,
    K / 32, 16]`` (inputs ``2j`` and ``2j + 1`` in byte ``j``, low nibble first) and ``scales [..., K / 32]``: the
    same codes and scales (llama.cpp doubles its table and halves its scales: the same values)."""
    raw = torch.from_numpy(np.array(data, dtype=np.uint8))
    raw = raw.view(*raw.shape[:-1], -1, 17)
    packed = raw[..., 1:]
    codes = torch.cat((packed & 15, packed >> 4), dim=-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), raw[..., 0].contiguous()


def _gpt_oss_experts(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Gate and up ``[E, I, H]`` back into transformers' ``gate_up_proj [E, H, 2I]`` (gate and up columns
    alternating), down ``[E, H, I]`` into ``down_proj [E, I, H]``; MXFP4 ones (``_blocks [E, out, in / 32, 16]``
    and ``_scales``) into ``gate_up_proj_blocks [E, 2I, ...]`` (gate and up rows alternating) and
    ``down_proj_blocks``, as OpenAI's checkpoints hold them."""
    for prefix in _layer_prefixes(state_dict, 'experts.gate_bias'):
        gate, up = state_dict.pop(prefix + 'experts.gate_bias'), state_dict.pop(prefix + 'experts.up_bias')
        state_dict[prefix + 'experts.gate_up_proj_bias'] = torch.stack((gate, up), 2).flatten(1)
    for prefix in _layer_prefixes(state_dict, 'experts.gate'):
        gate, up = state_dict.pop(prefix + 'experts.gate'), state_dict.pop(prefix + 'experts.up')
        state_dict[prefix + 'experts.gate_up_proj'] = torch.stack((gate, up), 2).flatten(1, 2).transpose(1, 2)
        state_dict[prefix + 'experts.down_proj'] = state_dict.pop(prefix + 'experts.down').transpose(1, 2)
    for prefix in _layer_prefixes(state_dict, 'experts.gate_blocks'):
        for kind in ('blocks', 'scales'):
            gate, up = state_dict.pop(f'{prefix}experts.gate_{kind}'), state_dict.pop(f'{prefix}experts.up_{kind}')
            state_dict[f'{prefix}experts.gate_up_proj_{kind}'] = torch.stack((gate, up), 2).flatten(1, 2)
            state_dict[f'{prefix}experts.down_proj_{kind}'] = state_dict.pop(f'{prefix}experts.down_{kind}')


_STACKED_EXPERTS = re.compile(r'model\.layers\.\d+\.mlp\.experts\.(gate|up|down)_proj\.q?weight')


def _split_experts(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """The stacked experts (``mlp.experts.gate_proj.weight [E, I, H]``, or its blocks ``qweight [E, I, blocks,
    bytes]``) back into one tensor per expert, as Hugging Face checkpoints of Qwen-MoE and Mixtral hold them;
    a shared expert's gate (``[H]`` in some files) as its one row."""
    for name in [name for name in state_dict if _STACKED_EXPERTS.fullmatch(name)]:
        prefix, _, tail = name.rpartition('.experts.')
        for expert, part in enumerate(state_dict.pop(name).numpy()):
            state_dict[f'{prefix}.experts.{expert}.{tail}'] = shared_tensor(part)
    for name in [name for name in state_dict if name.endswith('shared_expert_gate.weight')]:
        state_dict[name] = state_dict[name].reshape(1, -1)


def _deepseek2_merge(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """``k_b [H, kv_lora, nope]`` (transposed by the converter) and ``v_b [H, v, kv_lora]`` back into
    ``kv_b_proj [H * (nope + v), kv_lora]``; the stacked experts back into one tensor per expert and
    projection, as DeepSeek's checkpoints hold them."""
    for prefix in _layer_prefixes(state_dict, 'self_attn.k_b_proj'):
        k_b, v_b = state_dict.pop(prefix + 'self_attn.k_b_proj'), state_dict.pop(prefix + 'self_attn.v_b_proj')
        state_dict[prefix + 'self_attn.kv_b_proj.weight'] = torch.cat((k_b.transpose(1, 2), v_b), 1).flatten(0, 1)
    _split_experts(state_dict, config)


def _mistral4_merge(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """As :func:`_deepseek2_merge`, the experts' stacked ``gate_up [E, 2I, H]`` (transformers' layout, which the
    converter keeps) split into gate and up first."""
    for prefix in _layer_prefixes(state_dict, 'mlp.experts.gate_up_proj.weight'):
        gate, up = state_dict.pop(prefix + 'mlp.experts.gate_up_proj.weight').chunk(2, dim=1)
        state_dict[prefix + 'mlp.experts.gate_proj.weight'] = gate
        state_dict[prefix + 'mlp.experts.up_proj.weight'] = up
    _deepseek2_merge(state_dict, config)


def _ernie4_5_experts(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """The stacked experts back into one tensor per expert; the router's correction bias as ``[1, E]``, as ERNIE's
    checkpoints hold it."""
    for name in [name for name in state_dict if name.endswith('e_score_correction_bias')]:
        state_dict[name] = state_dict[name].reshape(1, -1)
    _split_experts(state_dict, config)


def _llama4_checkpoint(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Meta's checkpoint of Llama 4: gate and up ``[E, I, H]`` back into ``gate_up_proj [E, H, 2I]`` (gate columns,
    then up), down ``[E, H, I]`` into ``down_proj [E, I, H]``; experts kept as blocks one tensor per expert; each
    layer's ``mlp`` named ``feed_forward``."""
    for prefix in _layer_prefixes(state_dict, 'mlp.experts.gate_proj.weight'):
        gate, up = (state_dict.pop(f'{prefix}mlp.experts.{proj}_proj.weight') for proj in ('gate', 'up'))
        state_dict[prefix + 'mlp.experts.gate_up_proj'] = torch.cat((gate, up), 1).transpose(1, 2)
    for prefix in _layer_prefixes(state_dict, 'mlp.experts.down_proj.weight'):
        down = state_dict.pop(prefix + 'mlp.experts.down_proj.weight')
        state_dict[prefix + 'mlp.experts.down_proj'] = down.transpose(1, 2)
    _split_experts(state_dict, config)
    for name in [name for name in state_dict if '.mlp.' in name]:
        state_dict[name.replace('.mlp.', '.feed_forward.')] = state_dict.pop(name)


# the engine's expert projection -> PhiMoE's checkpoint name
_PHIMOE_EXPERT_NAMES = {'gate_proj': 'w1', 'up_proj': 'w3', 'down_proj': 'w2'}


def _phimoe_checkpoint(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """PhiMoE's checkpoint: the stacked experts back into one tensor per expert, named as the hub's checkpoints
    (``block_sparse_moe.experts.{e}.w1``/``w3``/``w2``, the router ``block_sparse_moe.gate``)."""
    _split_experts(state_dict, config)
    for name in [name for name in state_dict if '.mlp.' in name]:
        new = name.replace('.mlp.', '.block_sparse_moe.')
        for proj, checkpoint_name in _PHIMOE_EXPERT_NAMES.items():
            new = new.replace(f'.{proj}.', f'.{checkpoint_name}.')
        state_dict[new] = state_dict.pop(name)


def _granitemoe_checkpoint(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Granite 3 MoE's checkpoint where the experts are dense: gate and up ``[E, I, H]`` back into
    ``block_sparse_moe.input_linear [E, 2I, H]`` (gate rows first), down into ``output_linear``, the router into
    ``router.layer``; experts kept as blocks one tensor per expert under the engine's names (``mlp.experts.*``)."""
    for prefix in _layer_prefixes(state_dict, 'mlp.experts.gate_proj.weight'):
        gate, up = (state_dict.pop(f'{prefix}mlp.experts.{proj}_proj.weight') for proj in ('gate', 'up'))
        state_dict[prefix + 'block_sparse_moe.input_linear.weight'] = torch.cat((gate, up), 1)
        state_dict[prefix + 'block_sparse_moe.router.layer.weight'] = state_dict.pop(prefix + 'mlp.gate.weight')
        if prefix + 'mlp.experts.down_proj.weight' in state_dict:
            state_dict[prefix + 'block_sparse_moe.output_linear.weight'] = state_dict.pop(
                prefix + 'mlp.experts.down_proj.weight')
    _granitemoe_shared_mlp(state_dict)
    _split_experts(state_dict, config)


def _granitemoe_shared_mlp(state_dict: dict[str, torch.Tensor]) -> None:
    """GraniteMoeShared's dense shared MLP as its checkpoints hold it: gate and up back into the layer's
    ``shared_mlp.input_linear [2I, H]`` (gate rows first), down as ``shared_mlp.output_linear``; one kept as blocks
    stays under the engine's names."""
    for prefix in _layer_prefixes(state_dict, 'mlp.shared_mlp.gate_proj.weight'):
        if prefix + 'mlp.shared_mlp.up_proj.weight' in state_dict:
            gate, up = (state_dict.pop(f'{prefix}mlp.shared_mlp.{proj}_proj.weight') for proj in ('gate', 'up'))
            state_dict[prefix + 'shared_mlp.input_linear.weight'] = torch.cat((gate, up))
    for prefix in _layer_prefixes(state_dict, 'mlp.shared_mlp.down_proj.weight'):
        state_dict[prefix + 'shared_mlp.output_linear.weight'] = state_dict.pop(
            prefix + 'mlp.shared_mlp.down_proj.weight')


def _hybrid_checkpoint(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Qwen3-Next's and Qwen3.5's linear attention and norms as their checkpoints hold them (``gguf_qwen3_next.py``),
    the stacked experts one tensor per expert."""
    finish_hybrid(state_dict, config)
    _split_experts(state_dict, config)


def _lfm2_checkpoint(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """LFM2's convolutions as its checkpoints hold them (``gguf_lfm2.py``), the stacked experts one tensor per
    expert."""
    unsqueeze_conv(state_dict)
    _split_experts(state_dict, config)


def _glm4_checkpoint(state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """GLM-4.1V's language model (an ``mrope_section`` in its rope): the converter reorders each head's rotary q/k rows
    from GLM's neighbouring pairs into halves (``Glm4Model.normal_to_neox``, for llama.cpp's M-RoPE); back into pairs,
    the rows of blocks kept as they are (``qweight``) too. GLM-4-0414's files are as its checkpoints."""
    rope = config['rope_parameters']
    if 'mrope_section' not in rope:
        return
    head_dim = config['head_dim']
    rotary = int(head_dim * rope['partial_rotary_factor'])
    for name, value in state_dict.items():
        if '.self_attn.q_proj.' in name or '.self_attn.k_proj.' in name:
            heads = value.reshape(-1, head_dim, *value.shape[1:])
            pairs = heads[:, :rotary].unflatten(1, (2, rotary // 2)).transpose(1, 2).flatten(1, 2)
            state_dict[name] = torch.cat((pairs, heads[:, rotary:]), dim=1).reshape(value.shape)


_FINISHERS = {'llama': _split_experts, 'qwen3moe': _split_experts, 'qwen3vlmoe': _split_experts,
              'qwen2moe': _split_experts, 'glm4moe': _split_experts, 'chatglm': _split_qkv, 'glm4': _glm4_checkpoint,
              'gemma2': _gemma_norms, 'gemma3': _gemma_norms, 'gpt-oss': _gpt_oss_experts,
              'deepseek2': _deepseek2_merge, 'glm-dsa': _deepseek2_merge, 'ernie4_5-moe': _ernie4_5_experts,
              'llama4': _llama4_checkpoint,
              'minimax-m2': _split_experts, 'hunyuan-moe': _split_experts, 'olmoe': _split_experts,
              'granitemoe': _granitemoe_checkpoint, 'phimoe': _phimoe_checkpoint,
              'dots1': _split_experts, 'exaone-moe': _split_experts,
              'afmoe': _split_experts,
              'mimo2': _split_experts,
              'mistral4': _mistral4_merge,
              **dict.fromkeys(HYBRID_ARCHS, _hybrid_checkpoint), **dict.fromkeys(LFM2_ARCHS, _lfm2_checkpoint),
              **MAMBA2_FINISHERS, **GEMMA3N_FINISHERS,
              **MAMBA1_FINISHERS}


def finish_state_dict(arch: str, state_dict: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Undo, in place, what llama.cpp's converter did to ``arch``'s tensors beyond renaming them."""
    if arch in _FINISHERS:
        _FINISHERS[arch](state_dict, config)
    for name, value in state_dict.items():
        state_dict[name] = value.contiguous()
