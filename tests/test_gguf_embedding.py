"""A GGUF file's token embedding kept as its blocks (Q8_0, Q4_K, Q6_K, with an output layer of its own): the
engine holds the file's uint8 blocks instead of a table in the model's dtype, looks rows up by dequantizing the
gathered blocks (exactly gguf's weights), and gives transformers' fp32 greedy tokens on the file; other types keep
the dequantized table (tied files: ``test_gguf_tied_table.py``)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM

from family_checks import assert_tp2_equals_tp1
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf_mixed import write_mixed_gguf

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS
from lmdeploy.pytorch.weights.gguf import convert_gguf

EMBEDDING_TYPES = ['Q8_0', 'Q4_K', 'Q6_K']


def write_file(tmp: Path, embedding: Q, output: Q | None = Q.Q6_K) -> str:
    """A tiny Q4_K Llama whose ``token_embd`` is ``embedding``, its output layer ``output`` (None: tied),
    converted; the folder's path (its ``model.gguf`` one level up)."""
    types = {'token_embd': embedding, 'default': Q.Q4_K} | ({} if output is None else {'output': output})
    write_mixed_gguf('llama', tmp / 'hf', tmp / 'model.gguf', types)
    if output is None:  # drop the output layer: the file's head is tied to its embeddings
        reader = GGUFReader(str(tmp / 'model.gguf'))
        assert any(t.name == 'output.weight' for t in reader.tensors)
        _rewrite_without_output(reader, tmp / 'model.gguf')
    convert_gguf(str(tmp / 'model.gguf'), str(tmp / 'served'))
    return str(tmp / 'served')


def _rewrite_without_output(reader: GGUFReader, path: Path) -> None:
    tmp = path.with_suffix('.tmp')
    writer = gguf.GGUFWriter(str(tmp), reader.fields['general.architecture'].contents())
    for name, field in reader.fields.items():
        if name.startswith('GGUF.') or name == 'general.architecture':
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name != 'output.weight':
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_shape=np.asarray(tensor.data).shape,
                              raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)


@pytest.fixture(scope='module', params=EMBEDDING_TYPES)
def served(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, write_file(tmp_path_factory.mktemp(request.param), Q[request.param])


def file_table(folder: str) -> torch.Tensor:
    """gguf's dequantization of the file's ``token_embd`` (fp32, ``[vocab, hidden]``)."""
    reader = GGUFReader(str(Path(folder).parent / 'model.gguf'))
    tensor = next(t for t in reader.tensors if t.name == 'token_embd.weight')
    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))


def test_embedding_held_as_blocks_gives_transformers_tokens(served):
    """The embedding holds the file's blocks (uint8, the file's bytes per row, no table in the model's dtype) and
    its rows are gguf's; fp32 greedy tokens equal transformers' reading the file, batched as alone, and a prompt
    sharing a cached prefix gives the same tokens."""
    ggml_type, folder = served
    config = json.loads((Path(folder) / 'config.json').read_text())
    assert config['quantization_config']['embed_tokens'] == ggml_type
    expected_rows = file_table(folder)
    vocab, hidden = expected_rows.shape
    block_inputs, block_bytes = BLOCKS[ggml_type]
    prompts = random_prompts([9, 30, 17], seed=3, vocab=250)
    engine = make_engine(folder)
    try:
        embedding = engine.runner.model.embed_tokens
        assert not hasattr(embedding, 'weight') and embedding.block_type == ggml_type
        assert embedding.qweight.dtype == torch.uint8
        assert embedding.qweight.shape == (vocab, hidden // block_inputs, block_bytes)
        assert embedding.qweight.nbytes == vocab * hidden // block_inputs * block_bytes
        assert [p.dtype for p in embedding.parameters()] == [torch.uint8]
        ids = torch.tensor([0, 5, vocab - 1, 5])
        assert torch.equal(embedding(ids), expected_rows[ids])
        assert_gguf_greedy(engine, folder, prompts)
    finally:
        engine.close()


def assert_gguf_greedy(engine, folder: str, prompts: list[list[int]]) -> None:
    """``engine`` gives the same greedy tokens batched as alone and after a prefix-cache hit, and they are
    transformers' reading the converted folder's ``model.gguf``."""
    batched = run(engine, prompts)
    assert [run(engine, [prompt])[0] for prompt in prompts] == batched
    hits = engine.block_manager.num_hits
    again = run(engine, [prompts[1] + [7, 8]])[0]
    assert engine.block_manager.num_hits > hits
    reference = AutoModelForCausalLM.from_pretrained(str(Path(folder).parent), gguf_file='model.gguf',
                                                     dtype=torch.float32).eval()
    assert_transformers_greedy(reference, prompts, batched)
    assert_transformers_greedy(reference, [prompts[1] + [7, 8]], [again])


def test_bf16_embedding_is_the_file_rows_rounded(served):
    """In bf16 the looked-up rows are gguf's fp32 rows cast to bf16."""
    ggml_type, folder = served
    engine = Engine(folder, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32, block_size=16),
                    show_progress=False)
    try:
        embedding = engine.runner.model.embed_tokens
        ids = torch.arange(0, embedding.vocab_size, 7)
        out = embedding(ids)
        assert out.dtype == torch.bfloat16 and torch.equal(out, file_table(folder)[ids].bfloat16())
        assert len(run(engine, random_prompts([12], seed=4, vocab=250))[0]) == 32
    finally:
        engine.close()


def test_other_types_keep_the_dequantized_table(tmp_path):
    folder = write_file(tmp_path, Q.Q5_K)
    config = json.loads((Path(folder) / 'config.json').read_text())
    assert 'embed_tokens' not in config['quantization_config']


def test_tp2_equals_tp1_with_embedding_blocks(tmp_path):
    """Under tensor parallelism each rank holds its share of the blocks' rows (the last padded with zero
    blocks: 263 tokens over two ranks)."""
    folder = write_file(tmp_path, Q.Q4_K)
    assert_tp2_equals_tp1(folder, random_prompts([9, 30], seed=6, vocab=250))
