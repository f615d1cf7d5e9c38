"""A tied GGUF file's token table (no ``output.weight``) in Q8_0, Q4_K or Q6_K: one copy serves both the embedding's
lookups and the LM head, in bf16 the file's blocks (no table in the model's dtype anywhere), in fp32 the blocks
dequantized once; its rows and logits are gguf's, and fp32 greedy tokens equal transformers' reading the file."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from test_gguf_embedding import EMBEDDING_TYPES, assert_gguf_greedy, file_table, write_file

from family_checks import assert_tp2_equals_tp1
from helpers import make_engine, random_prompts, run

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS
from lmdeploy.pytorch.nn.quant import gguf_table
from lmdeploy.pytorch.nn.quant.gguf_table import TILE_ROWS, DenseTable, FileBlocks, NativeBlocks


@pytest.fixture(scope='module', params=EMBEDDING_TYPES)
def tied(request, tmp_path_factory) -> tuple[str, str]:
    return request.param, write_file(tmp_path_factory.mktemp(request.param), Q[request.param], output=None)


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def assert_one_table(model: torch.nn.Module, vocab: int) -> None:
    """The LM head holds nothing of its own, and no parameter or buffer is a table of a row per token."""
    lm_head = model.lm_head
    assert not model_tensors(lm_head) and (lm_head.packed, lm_head.q8, lm_head.fp16) == (None, None, None)
    assert not [t.shape for t in model_tensors(model) if t.is_floating_point() and vocab in t.shape]


def test_tied_table_in_fp32_gives_transformers_tokens(tied):
    """fp32: the embedding's blocks dequantized once (as every layer of an fp32 model) are the one table of the
    embedding and the LM head, exactly gguf's; greedy tokens equal transformers', batched as alone, after a
    prefix-cache hit."""
    ggml_type, folder = tied
    config = json.loads((Path(folder) / 'config.json').read_text())
    assert config['tie_word_embeddings'] and config['quantization_config']['embed_tokens'] == ggml_type
    table = file_table(folder)
    vocab, hidden = table.shape
    prompts = random_prompts([9, 30, 17], seed=3, vocab=250)
    engine = make_engine(folder)
    try:
        model = engine.runner.model
        embedding = model.embed_tokens
        assert isinstance(embedding.shared, DenseTable) and embedding.qweight is None
        assert torch.equal(embedding.shared.weight, table) and embedding.shared.nbytes == vocab * hidden * 4
        assert_one_table(model, vocab)
        ids = torch.tensor([0, 5, vocab - 1, 5])
        assert torch.equal(embedding(ids), table[ids])
        hidden_states = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0))
        logits = model.lm_head(hidden_states)
        assert logits.dtype == torch.float32
        torch.testing.assert_close(logits, hidden_states @ table.T, rtol=1e-5, atol=1e-5)
        assert_gguf_greedy(engine, folder, prompts)
    finally:
        engine.close()


def test_tied_table_on_the_native_gemv_in_bf16(tied):
    """bf16 on the CPU: the blocks retiled once for their type's GEMV (the rows padded to whole tiles) are the only
    copy; looked-up rows are gguf's rounded to bf16, logits of small steps (the GEMV) and large ones (dequantized a
    slice at a time) are the file table's to bf16's precision, in fp32; batched equals alone."""
    ggml_type, folder = tied
    table = file_table(folder)
    vocab, hidden = table.shape
    block_inputs, block_bytes = BLOCKS[ggml_type]
    engine = Engine(folder, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32, block_size=16),
                    show_progress=False)
    try:
        model = engine.runner.model
        embedding = model.embed_tokens
        shared = embedding.shared
        if not isinstance(shared, NativeBlocks):
            pytest.skip('the native GEMVs are not built for this CPU')
        assert embedding.qweight is None and [t.dtype for t in model_tensors(embedding)] == [torch.bfloat16]
        padded = -(-vocab // TILE_ROWS) * TILE_ROWS
        assert shared.nbytes == padded * hidden // block_inputs * block_bytes
        assert_one_table(model, vocab)
        ids = torch.cat([torch.arange(0, vocab, 7), torch.tensor([vocab - 1, 3, 3])])
        rows = embedding(ids)
        assert rows.dtype == torch.bfloat16 and torch.equal(rows, table[ids].bfloat16())
        generator = torch.Generator().manual_seed(1)
        for steps in (1, shared.max_gemv_rows + 1):
            hidden_states = torch.randn(steps, hidden, generator=generator).bfloat16()
            logits = model.lm_head(hidden_states)
            expected = hidden_states.float() @ table.T
            assert logits.dtype == torch.float32 and logits.shape == (steps, vocab)
            torch.testing.assert_close(logits, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())
        prompts = random_prompts([12, 5, 20], seed=4, vocab=250)
        batched = run(engine, prompts)
        assert batched == [run(engine, [prompt])[0] for prompt in prompts]
        assert all(len(tokens) == 32 for tokens in batched)
    finally:
        engine.close()


def file_blocks(folder: str, ggml_type: str) -> torch.Tensor:
    """The file's ``token_embd`` blocks, ``uint8 [vocab, hidden / B, bytes]``."""
    reader = GGUFReader(str(Path(folder).parent / 'model.gguf'))
    data = np.asarray(next(t for t in reader.tensors if t.name == 'token_embd.weight').data)
    return torch.from_numpy(data.copy()).view(data.shape[0], -1, BLOCKS[ggml_type][1])


def test_file_blocks_logits_a_slice_at_a_time(tied, monkeypatch):
    """The blocks as they are (CUDA, CPUs without the GEMVs): logits dequantize a few rows at a time, gguf's table's
    in fp32; rows are gguf's."""
    ggml_type, folder = tied
    table = file_table(folder)
    monkeypatch.setattr(gguf_table, 'TABLE_SLICE_WEIGHTS', 50 * table.shape[1])  # 6 slices of 263 rows
    blocks = FileBlocks(file_blocks(folder, ggml_type), ggml_type)
    hidden_states = torch.randn(4, table.shape[1], generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(blocks.logits(hidden_states), hidden_states @ table.T, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([3, 0, table.shape[0] - 1])
    assert torch.equal(blocks.lookup(ids, torch.float32), table[ids])


def test_tp2_equals_tp1_with_a_tied_table(tmp_path):
    """Each rank's share of the tied table's rows serves its lookups and its share of the logits."""
    folder = write_file(tmp_path, Q.Q6_K, output=None)
    assert_tp2_equals_tp1(folder, random_prompts([9, 30], seed=6, vocab=250))
