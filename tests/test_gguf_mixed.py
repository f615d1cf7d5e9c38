"""GGUF files of mixed types, as llama.cpp's Q4_K_M and Q8_0 files are: each linear layer in its own format
(Q4_K, Q6_K and Q8_0 as their blocks, a stacked layer whose parts differ part by part; other types dequantized),
giving in fp32 the greedy tokens of the same file dequantized and of transformers reading the file."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from conftest import save_tiny_model
from family_checks import assert_tp2_equals_tp1
from helpers import assert_transformers_greedy, fp32_kernel, make_engine, random_prompts, run
from test_gguf import _add_tokenizer, finish, llama_permute, make_gguf

from lmdeploy.lite.smooth_quant import smooth_quant
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant.dense import DenseFormat
from lmdeploy.pytorch.nn.quant.gguf import GgufFormat, GgufPartsFormat
from lmdeploy.pytorch.nn.quant.base import LinearKernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv, Q8Kernel
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel, TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.parts import PartsKernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import Q6KGemv
from lmdeploy.pytorch.nn.quant.w4a16 import ReferenceKernel
from lmdeploy.pytorch.weights.gguf import convert_gguf
from lmdeploy.pytorch.weights.gguf_types import served_types

HIDDEN, FFN, HEAD_DIM = 256, 512, 64  # K-quant blocks span 256 inputs
# random K-quant blocks (gguf-py cannot quantize them) with small fp16 d and dmin: block bytes, scale bytes
K_QUANTS = {Q.Q4_K: (144, slice(0, 4)), Q.Q5_K: (176, slice(0, 4)), Q.Q6_K: (210, slice(208, 210))}
# A Q4_K_M-like Llama: Q6_K in layer 0's attn_v and ffn_down and the output, one attn_output Q8_0, one
# Q4_0, one ffn_down Q5_K; layer 1's gate and up of different types (layer 0's q/k/v too: kept part by part).
Q4_K_M = {'token_embd': Q.Q4_K, 'output': Q.Q6_K,
          'blk.0.attn_v': Q.Q6_K, 'blk.0.attn_output': Q.Q8_0, 'blk.0.ffn_down': Q.Q6_K,
          'blk.1.attn_output': Q.Q4_0, 'blk.1.ffn_up': Q.Q8_0, 'blk.1.ffn_down': Q.Q5_K, 'default': Q.Q4_K}
Q4_K_M_LAYERS = {'layers.0.self_attn.qkv_proj': ['Q4_K', 'Q4_K', 'Q6_K'], 'layers.0.self_attn.o_proj': 'Q8_0',
                 'layers.0.mlp.gate_up_proj': 'Q4_K', 'layers.0.mlp.down_proj': 'Q6_K',
                 'layers.1.self_attn.qkv_proj': 'Q4_K', 'layers.1.mlp.gate_up_proj': ['Q4_K', 'Q8_0'],
                 'layers.1.mlp.down_proj': 'Q5_K'}
# A Q8_0 Qwen2 (q/k/v biases) keeping an F16 attn_k, an F32 ffn_down and an F16 output.
Q8_0_F16 = {'output': Q.F16, 'blk.0.attn_k': Q.F16, 'blk.1.ffn_down': Q.F32, 'default': Q.Q8_0}
Q8_0_F16_LAYERS = {'layers.0.self_attn.o_proj': 'Q8_0', 'layers.0.mlp.gate_up_proj': 'Q8_0',
                   'layers.0.mlp.down_proj': 'Q8_0', 'layers.1.self_attn.qkv_proj': 'Q8_0',
                   'layers.1.self_attn.o_proj': 'Q8_0', 'layers.1.mlp.gate_up_proj': 'Q8_0'}
FILES = {'llama': (Q4_K_M, Q4_K_M_LAYERS), 'qwen2': (Q8_0_F16, Q8_0_F16_LAYERS)}
# the output layer's and the token embedding's types where kept as their blocks too (both files untied)
TABLES = {'llama': {'lm_head': 'Q6_K', 'embed_tokens': 'Q4_K'}, 'qwen2': {'embed_tokens': 'Q8_0'}}


# MoE kinds: their GGUF architecture, and the tiny model's expert sizes (K-quant blocks span 256 inputs)
MOE = {'qwen3_moe': (gguf.MODEL_ARCH.QWEN3MOE, dict(moe_intermediate_size=256, num_experts=4)),
       'qwen2_moe': (gguf.MODEL_ARCH.QWEN2MOE, dict(moe_intermediate_size=256, num_experts=4, mlp_only_layers=[],
                                                    shared_expert_intermediate_size=256)),
       'mixtral': (gguf.MODEL_ARCH.LLAMA, dict(intermediate_size=256, num_local_experts=4))}
ARCHS = {'llama': gguf.MODEL_ARCH.LLAMA, 'qwen2': gguf.MODEL_ARCH.QWEN2,
         **{kind: arch for kind, (arch, _) in MOE.items()}}


def decode_rows_kernel(kernel: LinearKernel) -> LinearKernel:
    """The kernel that a layer's decode rows run on: a K-quant layer's GEMV (the small kernel of its
    :class:`SmallStepInt4Kernel`), another layer's only kernel."""
    return kernel.small if isinstance(kernel, SmallStepInt4Kernel) else kernel

def encode(weight: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """``weight`` quantized by gguf-py, or for a K-quant random blocks in its place; a stack of matrices
    (experts) matrix by matrix."""
    if weight.ndim == 3:
        return encode(weight.reshape(-1, weight.shape[-1]), qtype, rng).reshape(*weight.shape[:2], -1)
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(weight, qtype)
    block_bytes, scales = K_QUANTS[qtype]
    blocks = rng.integers(0, 256, (weight.shape[0], weight.shape[1] // 256, block_bytes), dtype=np.uint8)
    n_scales = (scales.stop - scales.start) // 2
    blocks[..., scales] = rng.uniform(1e-4, 1e-3, blocks.shape[:2] + (n_scales,)).astype(np.float16).view(np.uint8)
    return blocks.reshape(weight.shape[0], -1)


def file_tensors(kind: str, model: torch.nn.Module) -> dict[str, np.ndarray]:
    """``model``'s tensors under their GGUF names as llama.cpp's converter writes them: llama's q/k rows
    permuted, stacked experts split into gate and up (``ffn_{gate,up,down}_exps``)."""
    config = model.config
    names = gguf.get_tensor_name_map(ARCHS[kind], config.num_hidden_layers)
    tensors = {}
    for name, tensor in model.state_dict().items():
        data = tensor.numpy()
        if kind in ('llama', 'mixtral') and name.endswith(('q_proj.weight', 'k_proj.weight')):
            data = llama_permute(data, config.num_attention_heads if 'q_proj' in name else config.num_key_value_heads)
        parts = {name: data}
        if name.endswith('experts.gate_up_proj'):  # [E, 2I, H]: gate rows, then up rows
            gate, up = np.split(data, 2, axis=1)
            parts = {name.replace('gate_up_proj', 'gate_proj.weight'): gate,
                     name.replace('gate_up_proj', 'up_proj.weight'): up}
        elif name.endswith('experts.down_proj'):
            parts = {name + '.weight': data}
        for part, value in parts.items():
            tensors[names.get_name(part, try_suffixes=('.weight', '.bias'))] = np.ascontiguousarray(value)
    return tensors


def write_mixed_gguf(kind: str, folder: Path, path: Path, types: dict[str, Q], **sizes: int) -> None:
    """A tiny random ``kind`` (llama, qwen2, or the MoE kinds of ``MOE``; ``sizes`` overriding its config's sizes,
    heads of ``HEAD_DIM``) saved by transformers, written as
    llama.cpp writes it with each matrix (a stack of experts) of the type ``types`` gives its GGUF name
    (``blk.0.attn_v``, ``blk.1.ffn_down_exps``; else ``default``), 1-D tensors (and one-row ones: Qwen2-MoE's
    shared expert gate) and routers F32."""
    arch = ARCHS[kind]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    vocab = _add_tokenizer(writer)
    experts = MOE[kind][1] if kind in MOE else {}
    save_tiny_model(kind, str(folder), **{'hidden_size': HIDDEN, 'intermediate_size': FFN, 'head_dim': HEAD_DIM,
                                          'vocab_size': vocab, 'tie_word_embeddings': False,
                                          'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0},
                                          **experts, **sizes})
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    config = model.config
    for add, value in [(writer.add_block_count, config.num_hidden_layers), (writer.add_context_length, 1024),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads),
                       (writer.add_head_count_kv, config.num_key_value_heads),
                       (writer.add_rope_dimension_count, HEAD_DIM), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps)]:
        add(value)
    if experts:
        writer.add_key_length(HEAD_DIM)
        writer.add_expert_count(len(model.model.layers[0].mlp.experts.gate_up_proj))
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(model.model.layers[0].mlp.experts.down_proj.shape[-1])
        if 'shared_expert_intermediate_size' in experts:
            writer.add_expert_shared_feed_forward_length(experts['shared_expert_intermediate_size'])
    rng = np.random.default_rng(0)
    for gguf_name, data in file_tensors(kind, model).items():
        matrix = data.ndim > 1 and data.shape[0] > 1 and not gguf_name.endswith('ffn_gate_inp.weight')
        qtype = types.get(gguf_name.rpartition('.')[0], types['default']) if matrix else Q.F32
        stored = encode(data, qtype, rng)
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    finish(writer)


def served_mixed_gguf(kind: str, tmp: Path, types: dict[str, Q], **sizes: int) -> str:
    """``write_mixed_gguf``'s file in ``tmp`` converted as the engine serves it (its raw types kept as blocks):
    the served folder ``tmp / 'served'`` (the file is ``tmp / 'model.gguf'``)."""
    write_mixed_gguf(kind, tmp / 'hf', tmp / 'model.gguf', types, **sizes)
    convert_gguf(str(tmp / 'model.gguf'), str(tmp / 'served'))
    return str(tmp / 'served')


@pytest.fixture(scope='module', params=sorted(FILES))
def mixed_file(request, tmp_path_factory) -> tuple[str, Path]:
    kind = request.param
    tmp = tmp_path_factory.mktemp(f'mixed_{kind}')
    write_mixed_gguf(kind, tmp / 'hf', tmp / 'model.gguf', FILES[kind][0])
    convert_gguf(str(tmp / 'model.gguf'), str(tmp / 'served'))
    convert_gguf(str(tmp / 'model.gguf'), str(tmp / 'dequantized'), raw_types=())
    return kind, tmp


def linear_formats(engine: Engine) -> dict[str, str | list[str]]:
    """Each linear layer's format: its GGML type where served as blocks (its parts' where they differ), else
    ``dense``."""
    formats = {}
    for name, module in engine.runner.model.named_modules():
        if isinstance(module, Linear):
            layer_format = module.weight_format
            assert isinstance(layer_format, (GgufFormat, GgufPartsFormat, DenseFormat)), name
            formats[name] = (layer_format.ggml_type if isinstance(layer_format, GgufFormat) else
                             [part.ggml_type for part in layer_format.parts]
                             if isinstance(layer_format, GgufPartsFormat) else 'dense')
    return formats


def test_served_types_by_engine_layer():
    """Stacked layers take their parts' one type, or the list of their parts' types where they differ; a fused
    tensor (Phi-3's qkv_proj) is all the parts; layers the engine may not stack so are dequantized. A shared
    expert's projections (GLM-4.5's and DeepSeek's ``shared_experts``) are listed like an MLP's (DeepSeek's files
    keep only their routed experts, ``gguf_config``)."""
    tensors = [('model.layers.0.self_attn.q_proj.weight', 'Q4_K'), ('model.layers.0.self_attn.k_proj.weight', 'Q4_K'),
               ('model.layers.0.self_attn.v_proj.weight', 'Q6_K'), ('model.layers.0.self_attn.q_proj.bias', 'F32'),
               ('model.layers.0.mlp.gate_proj.weight', 'Q8_0'), ('model.layers.0.mlp.up_proj.weight', 'Q8_0'),
               ('model.layers.0.mlp.down_proj.weight', 'Q4_0'), ('model.layers.1.self_attn.qkv_proj.weight', 'Q4_K'),
               ('model.layers.1.mlp.gate_up_proj.weight', 'Q8_0'), ('lm_head.weight', 'Q8_0'),
               ('model.embed_tokens.weight', 'Q4_K'), (None, 'Q4_K'),
               ('model.layers.2.self_attn.q_proj.weight', 'Q8_0'),  # no k_proj or v_proj: another attention
               ('model.layers.2.mlp.shared_experts.down_proj.weight', 'Q8_0')]
    assert served_types(tensors) == {'layers.0.self_attn.qkv_proj': ['Q4_K', 'Q4_K', 'Q6_K'],
                                     'layers.0.mlp.gate_up_proj': 'Q8_0', 'layers.1.self_attn.qkv_proj': 'Q4_K',
                                     'layers.1.mlp.gate_up_proj': 'Q8_0',
                                     'layers.2.mlp.shared_experts.down_proj': 'Q8_0'}
    assert served_types(tensors, raw_types=()) == {}


def test_mixed_file_matches_dequantized_and_transformers(mixed_file):
    """Raw layers where expected; fp32 greedy tokens equal the engine's on the dequantized file and
    transformers' reading the GGUF; a prompt's tokens are the same batched and alone."""
    kind, tmp = mixed_file
    layers = FILES[kind][1]
    config = json.loads((tmp / 'served' / 'config.json').read_text())
    assert config['quantization_config'] == {'quant_method': 'gguf', 'ggml_types': layers} | TABLES[kind]
    assert 'quantization_config' not in json.loads((tmp / 'dequantized' / 'config.json').read_text())
    prompts = random_prompts([6, 19, 40], seed=4, vocab=250)
    engine = make_engine(str(tmp / 'served'))
    try:
        formats = linear_formats(engine)
        assert {name: kind for name, kind in formats.items() if kind != 'dense'} == layers
        assert len(formats) == 8
        batched = run(engine, prompts)
        solo = [run(engine, [prompt])[0] for prompt in prompts]
    finally:
        engine.close()
    assert batched == solo
    engine = make_engine(str(tmp / 'dequantized'))
    try:
        assert set(linear_formats(engine).values()) == {'dense'}
        assert run(engine, prompts) == batched
    finally:
        engine.close()
    reference = AutoModelForCausalLM.from_pretrained(str(tmp), gguf_file='model.gguf', dtype=torch.float32).eval()
    assert_transformers_greedy(reference, prompts, batched)


def test_bf16_mixed_file_runs_each_layer_on_its_kernel(mixed_file):
    """bf16 on the CPU: Q4_K layers on the Q4_K GEMV for small steps (dequantized per call above), Q8_0 on the
    native 8-bit GEMV, Q6_K on the Q6_K GEMV for small steps (dequantized per call above), a layer whose parts
    differ each part
    so, the others on bf16 GEMMs; the logits stay within 5% of fp32's."""
    kind, tmp = mixed_file
    if os.environ.get('LMDEPLOY_TEST_DEVICE', 'cpu') != 'cpu':
        pytest.skip('CPU kernels')

    def check_kernels(engine: Engine) -> None:
        expected = {'Q4_K': TorchInt4Kernel if cpu.int4_gemv() is None else Q4KGemv,
                    'Q6_K': Q8Kernel if cpu.q6k_gemv() is None else Q6KGemv,
                    'Q8_0': Q8Kernel if cpu.q8_gemv() is None else Q8_0Gemv,
                    'Q5_K': ReferenceKernel if cpu.q5k_gemv() is None else Q5KGemv}
        for name, layer_type in FILES[kind][1].items():
            kernel = engine.runner.model.get_submodule(name).kernel
            if isinstance(layer_type, list):
                assert isinstance(kernel, PartsKernel), name
                assert [type(decode_rows_kernel(part)) for part in kernel.parts] == [expected[t] for t in layer_type]
            else:
                assert isinstance(decode_rows_kernel(kernel), expected[layer_type]), name

    def check_fp32_kernels(engine: Engine) -> None:  # every layer's blocks (each part's) dequantized once
        for name in FILES[kind][1]:
            assert isinstance(engine.runner.model.get_submodule(name).kernel, fp32_kernel()), name

    error = bf16_logit_error(tmp / 'served', check_kernels, check_fp32_kernels)
    assert error < 0.05, error


def bf16_logit_error(served: Path, check_bf16: Callable[[Engine], None],
                     check_fp32: Callable[[Engine], None] | None = None) -> float:
    """How far the bf16 engine's first-step logits on one prompt lie from the fp32 engine's (relative norm), the
    bf16 engine first handed to ``check_bf16`` (and the fp32 one to ``check_fp32``)."""
    prompt = random_prompts([13], seed=2, vocab=250)[0]
    logits = {}
    for dtype in ('float32', 'bfloat16'):
        engine = Engine(str(served), PytorchEngineConfig(dtype=dtype, num_gpu_blocks=64, block_size=16),
                        show_progress=False)
        try:
            if dtype == 'bfloat16':
                check_bf16(engine)
            elif check_fp32 is not None:
                check_fp32(engine)
            logits[dtype] = engine.get_logits(prompt).float()
        finally:
            engine.close()
    return float((logits['bfloat16'] - logits['float32']).norm() / logits['float32'].norm())


def test_fused_file_projections_are_served_raw(tmp_path: Path):
    """Phi-3 stores q/k/v and gate/up fused: each fused Q4_K tensor fills one engine layer as its blocks, and
    the tokens equal those of the file dequantized."""
    src = tmp_path / 'phi3.gguf'
    stored = make_gguf(src, 'phi3', head_dim=HEAD_DIM, hidden=HIDDEN, projections=Q.Q4_K)
    convert_gguf(str(src), str(tmp_path / 'served'))
    convert_gguf(str(src), str(tmp_path / 'dequantized'), raw_types=())
    layers = json.loads((tmp_path / 'served' / 'config.json').read_text())['quantization_config']['ggml_types']
    qkv = {f'layers.{i}.self_attn.qkv_proj': stored[f'blk.{i}.attn_qkv.weight'][1].name for i in range(2)}
    expected = {f'layers.{i}.{name}': 'Q4_K' for i in range(2) for name in ('self_attn.o_proj', 'mlp.gate_up_proj',
                                                                           'mlp.down_proj')}
    expected |= {name: qtype for name, qtype in qkv.items() if qtype in ('Q4_K', 'Q8_0')}  # make_gguf's cycle
    assert layers == expected and 'layers.0.mlp.gate_up_proj' in layers
    prompts = random_prompts([7, 21], seed=1, vocab=250)
    outs = []
    for folder in ('served', 'dequantized'):
        engine = make_engine(str(tmp_path / folder))
        try:
            outs.append(run(engine, prompts))
        finally:
            engine.close()
    assert outs[0] == outs[1]


def test_smooth_quant_calibrates_on_the_file_dequantized(mixed_file, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``lmdeploy lite smooth_quant`` reads a mixed file through transformers: from its dequantized copy."""
    kind, tmp = mixed_file
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    smooth_quant(str(tmp / 'model.gguf'), str(tmp_path / 'w8a8'), calib_tokens=64, seq_len=32)
    config = json.loads((tmp_path / 'w8a8' / 'config.json').read_text())
    assert config['quantization_config']['quant_method'] == 'smooth_quant'
    engine = make_engine(str(tmp_path / 'w8a8'))
    try:
        assert len(run(engine, random_prompts([5], vocab=250))[0]) == 32
    finally:
        engine.close()


def test_tp2_matches_tp1(mixed_file):
    """Each rank builds its layers in their own formats and slices their blocks as tp=1 holds them whole."""
    _, tmp = mixed_file
    prompts = random_prompts([5, 17], seed=3, vocab=250)
    assert_tp2_equals_tp1(str(tmp / 'served'), prompts)


def test_tp2_keeps_whole_block_shares_and_dequantizes_a_share_that_splits_blocks(tmp_path: Path):
    """At tp=2 a down_proj of 768 inputs (three Q4_K blocks) gives the ranks 512 and 256 (whole blocks, kept);
    an o_proj of 256 inputs gives each rank its heads' 128: its blocks are dequantized as they load; the
    stacked layers keep theirs (their rows split), and the tokens are tp=1's."""
    src = tmp_path / 'tiny.gguf'
    make_gguf(src, 'llama', head_dim=HEAD_DIM, hidden=HIDDEN, ffn=768, projections=Q.Q4_K)
    convert_gguf(str(src), str(tmp_path / 'served'))
    prompts = random_prompts([5, 17], seed=3, vocab=250)
    outs = {}
    for tp in (1, 2):
        engine = make_engine(str(tmp_path / 'served'), tp=tp)
        try:
            formats = linear_formats(engine)
            assert formats['layers.0.self_attn.o_proj'] == ('Q4_K' if tp == 1 else 'dense')
            assert formats['layers.0.mlp.down_proj'] == formats['layers.0.mlp.gate_up_proj'] == 'Q4_K'
            assert formats['layers.0.self_attn.qkv_proj'] == 'Q4_K'
            outs[tp] = run(engine, prompts)
        finally:
            engine.close()
    assert outs[1] == outs[2]
