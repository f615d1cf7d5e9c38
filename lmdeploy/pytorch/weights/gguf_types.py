"""Which decoder projections of a GGUF file are served as llama.cpp's blocks (``nn/quant/gguf.py``) and which
are dequantized at conversion, chosen per linear layer of the engine: files of mixed types (Q4_K_M: Q4_K
with Q6_K in some ``attn_v`` and ``ffn_down``; Q8_0 with some F16) keep every layer they can as it is."""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

# Projection types kept as their blocks. Q4_0 and Q4_1 are dequantized, as the default model's Q4_1 file
# is: in bf16 its small steps rebuild the same 4-bit grid (``decode_int4``) and larger ones run bf16 GEMMs.
# Q5_K: Q5_K_M files, and Qwen3.5's ``attn_qkv`` in llama.cpp's Q4_K_M.
# MXFP4 only for gpt-oss's experts (``ffn_*_exps``), converted to an MXFP4 checkpoint's (``nn/quant/mxfp4.py``).
MXFP4 = 'MXFP4'
RAW_TYPES = frozenset({'Q4_K', 'Q5_K', 'Q6_K', 'Q8_0', MXFP4})
# Output layer types kept as their blocks too (besides the dequantized table) in a file with layers kept so.
LM_HEAD_RAW_TYPES = frozenset({'Q6_K'})
# Token embedding types kept as their blocks (each step dequantizes the rows it looks up) in such a file; a tied LM
# head reads the same blocks (``nn/quant/gguf_table.py``).
EMBEDDING_RAW_TYPES = frozenset({'Q4_K', 'Q6_K', 'Q8_0'})
# the engine's linear layers that Hugging Face projections fill, and the sets of projections that fill one:
# q/k/v and gate/up are stacked into one layer (Phi-3 and GLM-4 files hold them stacked already); StarCoder2's
# checkpoints name the down projection ``c_proj``
_ENGINE_LAYERS = {'q_proj': 'qkv_proj', 'k_proj': 'qkv_proj', 'v_proj': 'qkv_proj', 'qkv_proj': 'qkv_proj',
                  'o_proj': 'o_proj', 'gate_proj': 'gate_up_proj', 'up_proj': 'gate_up_proj',
                  'gate_up_proj': 'gate_up_proj', 'down_proj': 'down_proj', 'c_proj': 'down_proj'}
# the hybrid decoders' linear attention (``models/qwen3_next.py``) as llama.cpp's files hold it: q/k/v, the output
# gate z and the output projection each a layer of its own (their b and a projections, a row per value head, dense)
_LINEAR_ATTENTION = re.compile(r'layers\.\d+\.linear_attn')
_LINEAR_ATTENTION_LAYERS = ('in_proj_qkv', 'in_proj_z', 'out_proj')
# the Mamba-2 hybrids' mixers (Granite 4.0-H's ``mamba``; Nemotron-H's ``mixer`` of every block kind, its shared and
# routed experts, the latter stacked in the files): the Mamba-2 in and out projections, the ungated MLPs' up and down
# and the latent projections each a layer of its own; attention's q/k/v stacked as Llama's
_MIXER = re.compile(r'layers\.\d+\.(?:mamba|mixer|mixer\.shared_experts|mixer\.experts)')
_MIXER_LAYERS = ('in_proj', 'out_proj', 'up_proj', 'down_proj', 'fc1_latent_proj', 'fc2_latent_proj')
# the stacked layers whole with all their parts, and StarCoder2's down projection ``c_proj``; any other layer is whole
# as one projection of its own name
_WHOLE = ({'q_proj', 'k_proj', 'v_proj'}, {'gate_proj', 'up_proj'}, {'c_proj'})
# the projections a stacked layer holds, in its order (its parts)
_PARTS = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'), 'gate_up_proj': ('gate_proj', 'up_proj')}
# a layer's attention and MLP (or shared expert, Hunyuan's and Granite 4.0-H's shared MLP), and its experts: stacked
# (a MoE file's ``ffn_*_exps``) or one's
_OWNER = re.compile(r'(layers\.\d+\.(?:self_attn|mlp|mlp\.shared_experts?|mlp\.shared_mlp|shared_mlp))'
                    r'|(layers\.\d+\.mlp\.experts)(?:\.\d+)?')


def engine_layer(hf_name: str | None) -> str | None:
    """The name in the engine's model of the linear layer whose weight the Hugging Face tensor ``hf_name``
    fills (``model.layers.3.self_attn.k_proj.weight`` -> ``layers.3.self_attn.qkv_proj``), or for the experts
    of a MoE layer the projection of its ``FusedExperts`` (``model.layers.3.mlp.experts[.5].up_proj.weight`` ->
    ``layers.3.mlp.experts.gate_up_proj``), for a hybrid decoder's linear attention or Mamba-2 mixer the projection
    itself (``layers.0.linear_attn.out_proj``, ``layers.0.mamba.in_proj``, ``layers.2.mixer.up_proj``); None for
    other tensors."""
    if hf_name is None or not hf_name.endswith('.weight'):
        return None
    owner, _, proj = hf_name.removesuffix('.weight').removeprefix('model.').rpartition('.')
    if _LINEAR_ATTENTION.fullmatch(owner):
        return f'{owner}.{proj}' if proj in _LINEAR_ATTENTION_LAYERS else None
    if _MIXER.fullmatch(owner):
        if proj in _MIXER_LAYERS:
            return f'{owner}.{proj}'
        return f'{owner}.{_ENGINE_LAYERS[proj]}' if proj in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else None
    match = _OWNER.fullmatch(owner)
    if proj not in _ENGINE_LAYERS or match is None:
        return None
    return f'{match[1] or match[2]}.{_ENGINE_LAYERS[proj]}'


def part_index(hf_name: str) -> int | None:
    """Which part of its stacked engine layer the Hugging Face tensor ``hf_name`` fills (``v_proj``: 2 of
    ``qkv_proj``); None for a tensor that fills a whole layer."""
    layer = engine_layer(hf_name)
    proj = hf_name.removesuffix('.weight').rpartition('.')[2]
    parts = _PARTS.get(layer.rpartition('.')[2], ()) if layer is not None else ()
    return parts.index(proj) if proj in parts else None


def served_types(tensors: Iterable[tuple[str | None, str]],
                 raw_types: Iterable[str] = RAW_TYPES) -> dict[str, str | list[str]]:
    """``{engine layer: GGML type}`` of the layers served as their blocks, from the file's ``(Hugging Face
    name, GGML type name)`` pairs: a layer whose projections are all there (q, k and v; gate and up) and all
    of ``raw_types``. A stacked layer whose parts differ in type (a Q6_K ``v_proj`` beside Q4_K ``q_proj`` and
    ``k_proj``) gets the list of its parts' types, in its order; experts whose gate and up differ in type, and
    layers of other attention designs (no ``k_proj``), are dequantized."""
    types: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, ggml_type in tensors:
        layer = engine_layer(name)
        if layer is not None:
            types[layer][name.removesuffix('.weight').rpartition('.')[2]].add(ggml_type)
    raw = set(raw_types)
    served: dict[str, str | list[str]] = {}
    for layer, by_part in sorted(types.items()):
        kinds = set().union(*by_part.values())
        whole = set(by_part) in _WHOLE or set(by_part) == {layer.rpartition('.')[2]}
        if not kinds <= raw or not whole or any(len(k) > 1 for k in by_part.values()):
            continue
        if len(kinds) == 1:
            served[layer] = kinds.pop()
        elif '.experts.' not in layer:
            served[layer] = [next(iter(by_part[part])) for part in _PARTS[layer.rpartition('.')[2]]]
    return served
