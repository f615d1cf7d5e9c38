"""Which decoder projections of a GGUF file are served as llama.cpp's blocks (``nn/quant/gguf.py``) and which
are dequantized at conversion, chosen per linear layer of the engine: files of mixed types (Q4_K_M: Q4_K
with Q6_K in some ``attn_v`` and ``ffn_down``; Q8_0 with some F16) keep every layer they can as it is."""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

# Projection types kept as their blocks. Q4_0 and Q4_1 are dequantized, as the default model's Q4_1 file
# is: in bf16 its small steps rebuild the same 4-bit grid (``decode_int4``) and larger ones run bf16 GEMMs.
RAW_TYPES = frozenset({'Q4_K', 'Q6_K', 'Q8_0'})
# Output layer types kept as their blocks too (besides the dequantized table) in a file with layers kept so.
LM_HEAD_RAW_TYPES = frozenset({'Q6_K'})
# the engine's linear layers that Hugging Face projections fill, and the sets of projections that fill one:
# q/k/v and gate/up are stacked into one layer (Phi-3 and GLM-4 files hold them stacked already)
_ENGINE_LAYERS = {'q_proj': 'qkv_proj', 'k_proj': 'qkv_proj', 'v_proj': 'qkv_proj', 'qkv_proj': 'qkv_proj',
                  'o_proj': 'o_proj', 'gate_proj': 'gate_up_proj', 'up_proj': 'gate_up_proj',
                  'gate_up_proj': 'gate_up_proj', 'down_proj': 'down_proj'}
_WHOLE = ({'q_proj', 'k_proj', 'v_proj'}, {'qkv_proj'}, {'o_proj'}, {'gate_proj', 'up_proj'}, {'gate_up_proj'},
          {'down_proj'})
# a layer's attention and MLP (or shared expert), and its experts: stacked (a MoE file's ``ffn_*_exps``) or one's
_OWNER = re.compile(r'(layers\.\d+\.(?:self_attn|mlp|mlp\.shared_expert))|(layers\.\d+\.mlp\.experts)(?:\.\d+)?')


def engine_layer(hf_name: str | None) -> str | None:
    """The name in the engine's model of the linear layer whose weight the Hugging Face tensor ``hf_name``
    fills (``model.layers.3.self_attn.k_proj.weight`` -> ``layers.3.self_attn.qkv_proj``), or for the experts
    of a MoE layer the projection of its ``FusedExperts`` (``model.layers.3.mlp.experts[.5].up_proj.weight`` ->
    ``layers.3.mlp.experts.gate_up_proj``); None for other tensors."""
    if hf_name is None or not hf_name.endswith('.weight'):
        return None
    owner, _, proj = hf_name.removesuffix('.weight').removeprefix('model.').rpartition('.')
    match = _OWNER.fullmatch(owner)
    if proj not in _ENGINE_LAYERS or match is None:
        return None
    return f'{match[1] or match[2]}.{_ENGINE_LAYERS[proj]}'


def served_types(tensors: Iterable[tuple[str | None, str]], raw_types: Iterable[str] = RAW_TYPES) -> dict[str, str]:
    """``{engine layer: GGML type}`` of the layers served as their blocks, from the file's ``(Hugging Face
    name, GGML type name)`` pairs: a layer whose projections are all there (q, k and v; gate and up) and all
    of one type of ``raw_types``. A stacked layer whose parts differ (a Q6_K ``v_proj`` beside Q4_K ``q_proj``
    and ``k_proj``) is dequantized whole, as are layers of other attention designs (no ``k_proj``)."""
    types: dict[str, set[str]] = defaultdict(set)
    parts: dict[str, set[str]] = defaultdict(set)
    for name, ggml_type in tensors:
        layer = engine_layer(name)
        if layer is not None:
            types[layer].add(ggml_type)
            parts[layer].add(name.removesuffix('.weight').rpartition('.')[2])
    raw = set(raw_types)
    return {layer: next(iter(kinds)) for layer, kinds in sorted(types.items())
            if len(kinds) == 1 and kinds <= raw and parts[layer] in _WHOLE}
