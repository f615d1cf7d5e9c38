"""Quantized vision-language GGUF pairs: the language model's Q8_0 / Q4_K / Q6_K projections stay their blocks as
a text GGUF's do (the vision tower and projector dequantized), and give the greedy tokens of the same pair fully
dequantized on text and image prompts; in bf16 on the CPU the kept layers run in the native decoder stack."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from helpers import make_engine, run
from test_decoder_stack import check_every_step
from test_gguf_mixed import encode, linear_formats
from test_gguf_vl import IMAGES, PROMPTS, write_mmproj, write_qwen2vl_gguf
from test_vl_families import make_processor
from vl_models import QWEN25_VISION, QWEN_VISION, TEXT, save_tiny_vl_model

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8_0Gemv
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import gemv_max_rows
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf

HIDDEN, FFN, HEADS = 256, 512, 16  # K-quant blocks span 256 inputs; 16 heads keep the tiny model's head_dim of 16
PROJECTIONS = ('attn_q', 'attn_k', 'attn_v', 'attn_output', 'ffn_gate', 'ffn_up', 'ffn_down')
# llama.cpp's Q8_0 (gguf-py's quantization of the model's weights) and Q4_K_M: Q4_K with Q6_K in layer 0's
# attn_v and ffn_down (its q/k/v kept part by part) and in the output layer (kept as blocks too), a Q4_K token
# embedding (dequantized)
FILES = {'Q8_0': ('qwen2_5_vl', {'default': Q.Q8_0}),
         'Q4_K_M': ('qwen2_vl', {'token_embd': Q.Q4_K, 'output': Q.Q6_K, 'blk.0.attn_v': Q.Q6_K,
                                 'blk.0.ffn_down': Q.Q6_K, 'default': Q.Q4_K})}
LAYERS = {
    'Q8_0': {f'layers.{i}.{name}': 'Q8_0' for i in range(2)
             for name in ('self_attn.qkv_proj', 'self_attn.o_proj', 'mlp.gate_up_proj', 'mlp.down_proj')},
    'Q4_K_M': {'layers.0.self_attn.qkv_proj': ['Q4_K', 'Q4_K', 'Q6_K'], 'layers.0.self_attn.o_proj': 'Q4_K',
               'layers.0.mlp.gate_up_proj': 'Q4_K', 'layers.0.mlp.down_proj': 'Q6_K',
               'layers.1.self_attn.qkv_proj': 'Q4_K', 'layers.1.self_attn.o_proj': 'Q4_K',
               'layers.1.mlp.gate_up_proj': 'Q4_K', 'layers.1.mlp.down_proj': 'Q4_K'},
}
LM_HEAD = {'Q8_0': {}, 'Q4_K_M': {'lm_head': 'Q6_K'}}  # Qwen2.5-VL's tiny model ties its embeddings
QWEIGHTS = {'Q8_0': 14, 'Q4_K_M': 15}  # the projections (and output layer) kept as blocks


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


def write_quantized_pair(kind: str, types: dict[str, Q], folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The language model of ``kind`` written as llama.cpp's converter writes it, each projection (and the token
    embedding) of the type ``types`` gives its GGUF name, and its mmproj in float32; returns the model's file."""
    model_dir = str(folder / 'hf')
    rng = np.random.default_rng(0)
    add_tensor = gguf.GGUFWriter.add_tensor

    def quantized(writer, name, tensor, *args, **kwargs):
        stem = name.removesuffix('.weight')
        qtype = types.get(stem, types['default']) if stem.rpartition('.')[2] in PROJECTIONS else types.get(stem)
        if qtype is None or not name.endswith('.weight'):
            return add_tensor(writer, name, tensor, *args, **kwargs)
        stored = encode(tensor, qtype, rng) if qtype != Q.F16 else tensor.astype(np.float16)
        return add_tensor(writer, name, stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)

    with monkeypatch.context() as patch:
        for table, key, value in [(TEXT, 'hidden_size', HIDDEN), (TEXT, 'intermediate_size', FFN),
                                  (TEXT, 'num_attention_heads', HEADS), (TEXT, 'num_key_value_heads', HEADS // 2),
                                  (QWEN_VISION, 'hidden_size', HIDDEN), (QWEN25_VISION, 'out_hidden_size', HIDDEN),
                                  (QWEN_VISION, 'depth', 3), (QWEN25_VISION, 'depth', 3),
                                  (QWEN25_VISION, 'window_size', 112)]:
            patch.setitem(table, key, value)
        save_tiny_vl_model(kind, model_dir)
        write_mmproj(model_dir, folder / 'mmproj-tiny-F32.gguf')
        patch.setattr(gguf.GGUFWriter, 'add_tensor', quantized)
        write_qwen2vl_gguf(model_dir, folder / 'tiny.gguf')
    return folder / 'tiny.gguf'


@pytest.fixture(scope='module', params=sorted(FILES))
def quantized_pair(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(file kind, the pair as served, the pair fully dequantized), converted into a module-wide cache."""
    folder = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as patch:
        model = write_quantized_pair(*FILES[request.param], folder, patch)
        patch.setenv('LMDEPLOY_CACHE_DIR', str(folder / 'cache'))
        served = Path(resolve_gguf(str(model)))
    dequantized = folder / 'dequantized'
    convert_gguf(str(model), str(dequantized), raw_types=())
    return request.param, served, dequantized


def test_pair_keeps_the_language_model_blocks(quantized_pair, capsys):
    """The served folder lists the language model's kept layers at the top of its config and holds their blocks
    (the tower in float32); the engine builds those layers in their formats, the tower's dense, and its fp32
    greedy tokens on text and image prompts equal those of the pair dequantized, batched and alone."""
    name, served, dequantized = quantized_pair
    config = json.loads((served / 'config.json').read_text())
    assert config['quantization_config'] == {'quant_method': 'gguf', 'ggml_types': LAYERS[name]} | LM_HEAD[name]
    assert 'quantization_config' not in config['text_config']
    assert 'quantization_config' not in json.loads((dequantized / 'config.json').read_text())
    dtypes = {}
    for shard in served.glob('*.safetensors'):
        with safe_open(str(shard), 'pt') as f:
            dtypes |= {key: f.get_slice(key).get_dtype() for key in f.keys()}
    assert {dtype for key, dtype in dtypes.items() if key.startswith('visual.')} == {'F32'}
    assert sum(key.endswith('.qweight') for key in dtypes) == QWEIGHTS[name]
    with capsys.disabled():
        print(f'\n{name}: served folder {folder_bytes(served) / 2**20:.2f} MiB, '
              f'dequantized {folder_bytes(dequantized) / 2**20:.2f} MiB')
    prompts = [make_processor(str(served)).process(prompt) for prompt in PROMPTS]
    engine = make_engine(str(served))
    try:
        formats = linear_formats(engine)
        assert {layer: kind for layer, kind in formats.items() if kind != 'dense'} == LAYERS[name]
        assert not any(isinstance(m, Linear) for m in engine.runner.model.visual.modules())
        outs = run(engine, prompts)
        assert [run(engine, [prompt])[0] for prompt in prompts] == outs
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    engine = make_engine(str(dequantized))
    try:
        assert set(linear_formats(engine).values()) == {'dense'}
        assert run(engine, prompts) == outs
    finally:
        engine.close()
    assert outs[1] != outs[2], 'the images must change the answer'


def test_bf16_pair_runs_its_blocks_as_a_text_file_does(quantized_pair, native_gemms, monkeypatch):
    """bf16 on the CPU, image prompts included: the Q4_K_M pair's Q4_K layers on the Q4_K GEMV for decode rows
    (prefill rows dequantized per call), its Q6_K output layer's small steps on its blocks and every layer in the
    native decoder stack (decode rows in its small stack), each step equal to the layers' own forward; the Q8_0
    pair's layers likewise on the native 8-bit GEMV for decode rows, in the stack too."""
    name, served, _ = quantized_pair
    if cpu.int4_gemv() is None or cpu.q6k_gemv() is None or cpu.q8_gemv() is None:
        pytest.skip('the native Q4_K, Q6_K and 8-bit GEMVs need AVX512-BF16')
    engine = Engine(str(served), PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    try:
        model = engine.runner.model
        qkv = model.get_submodule('layers.1.self_attn.qkv_proj').kernel
        assert model.native_stack is not None and model.native_stack.small is not None
        assert isinstance(qkv, SmallStepInt4Kernel)
        if name == 'Q8_0':
            assert isinstance(qkv.small, Q8_0Gemv)
        else:
            assert isinstance(qkv.small, Q4KGemv) and isinstance(model.lm_head.packed, SmallStepInt4Kernel)
        steps = check_every_step(engine, monkeypatch)
        # a long text prompt (about 400 tokens): a step larger than the GEMVs' bounds on any CPU (192 at most)
        processor = make_processor(str(served))
        prompts = [processor.process(prompt) for prompt in [('describe', IMAGES[0]), 'plain text ' * 40]]
        outs = run(engine, prompts, GenerationConfig(max_new_tokens=6, ignore_eos=True))
        assert [len(out) for out in outs] == [6, 6]
        # decode and prefill steps ran, each equal to the layers'
        max_rows = gemv_max_rows('q8_0' if name == 'Q8_0' else 'q4k')
        assert {rows <= max_rows for _, rows in steps} == {True, False}
    finally:
        engine.close()
