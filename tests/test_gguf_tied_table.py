"""A tied GGUF file's token table (no ``output.weight``) in Q8_0, Q4_K or Q6_K: one copy serves both the embedding's
lookups and the LM head, in bf16 the file's blocks (no table in the model's dtype anywhere), in fp32 the blocks
dequantized once, where the Triton kernels run the blocks retiled for their GEMMs; its rows and logits are gguf's,
and fp32 greedy tokens equal transformers' reading the file."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from test_gguf_embedding import EMBEDDING_TYPES, assert_gguf_greedy, file_table, write_file

from family_checks import assert_tp2_equals_tp1
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from transformers import AutoModelForCausalLM

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch import kernels
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS
from lmdeploy.pytorch.nn.quant import gguf_table
from lmdeploy.pytorch.nn.quant.gguf_table import TILE_ROWS, DenseTable, FileBlocks, NativeBlocks

DEVICE = os.environ.get('LMDEPLOY_TEST_DEVICE', 'cpu')


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
    if kernels.triton_runs_on(torch.empty(0, device=DEVICE)):
        pytest.skip('the Triton kernels serve the table (LMDEPLOY_TEST_DEVICE=cuda, LMDEPLOY_TEST_KERNELS=triton): '
                    'see test_engine_on_the_triton_table_gives_transformers_tokens')
    engine = make_engine(folder)
    try:
        model = engine.runner.model
        embedding = model.embed_tokens
        assert isinstance(embedding.shared, DenseTable) and embedding.qweight is None
        # one copy: the fixed-order fp32 GEMM's tiles (rows padded to 16s) where it is built, else the weight
        rows = -(-vocab // 16) * 16 if cpu.fp32_gemm() is not None else vocab
        assert torch.equal(embedding.shared.lookup(torch.arange(vocab), torch.float32), table)
        assert embedding.shared.nbytes == rows * hidden * 4
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
            pytest.skip('the native GEMVs do not serve the table (not built for this CPU, or the Triton kernels do)')
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


# the table's bytes per weight on the Triton GEMMs: Q8_0's and Q6_K's the file's, Q4_K's its grid (fp32 scales, offsets)
TRITON_BYTES = {'Q8_0': 34 / 32, 'Q6_K': 210 / 256, 'Q4_K': 0.5 + 8 / 32}
# the interpreter computes bf16 wrongly: bf16 on CUDA only
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE != 'cpu' else [])
TRITON_TOLERANCE = {torch.float32: 1e-5 if DEVICE == 'cpu' else 2e-3, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def triton_kernels():
    """The Triton kernels on this test's tensors: natively on CUDA, else in the interpreter on CPU tensors."""
    pytest.importorskip('triton')
    if DEVICE != 'cpu':
        yield
        return
    if os.environ.get('TRITON_INTERPRET') != '1':
        pytest.skip("needs Triton's interpreter")
    with kernels.triton_on_cpu():
        yield


@pytest.mark.parametrize('dtype', TRITON_DTYPES)
def test_triton_table_logits_are_the_dequantized_tables(tied, dtype, triton_kernels):
    """Where the Triton kernels run, the table is the blocks retiled once for their type's GEMM (the only copy):
    looked-up rows are gguf's exactly, logits of a decode launch (1 row, the inputs split) and of a larger one (20
    rows) are ``F.linear`` on gguf's table within the dtype's precision."""
    from lmdeploy.pytorch.nn.quant.gguf_cuda import TritonBlocks
    ggml_type, folder = tied
    table = file_table(folder)
    vocab, hidden = table.shape
    shared = gguf_table.block_table(file_blocks(folder, ggml_type).to(DEVICE), ggml_type, dtype)
    assert isinstance(shared, TritonBlocks) and shared.nbytes == vocab * hidden * TRITON_BYTES[ggml_type]
    ids = torch.tensor([0, 5, vocab - 1, 5, 130])
    rows = shared.lookup(ids.to(DEVICE), dtype)
    assert rows.dtype == dtype and torch.equal(rows.cpu(), table[ids].to(dtype))
    generator = torch.Generator().manual_seed(5)
    for steps in (1, 20):
        hidden_states = torch.randn(steps, hidden, generator=generator).to(dtype)
        expected = F.linear(hidden_states.double(), table.double()).float()
        logits = shared.logits(hidden_states.to(DEVICE)).float().cpu()
        tolerance = TRITON_TOLERANCE[dtype]
        torch.testing.assert_close(logits, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item())


@pytest.mark.parametrize('tied', ['Q8_0'], indirect=True)
def test_engine_on_the_triton_table_gives_transformers_tokens(tied, triton_kernels):
    """An fp32 engine whose tied table is on the Triton GEMM (the CUDA path; on the CPU its kernels in the
    interpreter) gives transformers' greedy tokens, batched as alone. One type (Gemma 3's): the engine's table
    calls are the same for each, and each type's GEMM is checked against gguf's table, at a decode launch's 1 row
    and at 20, in the test above (10 s a type in the interpreter)."""
    from lmdeploy.pytorch.nn.quant.gguf_cuda import TritonBlocks
    ggml_type, folder = tied
    engine = make_engine(folder)
    try:
        model = engine.runner.model
        assert isinstance(model.embed_tokens.shared, TritonBlocks) and model.embed_tokens.qweight is None
        assert_one_table(model, file_table(folder).shape[0])
        prompts = random_prompts([9, 21], seed=3, vocab=250)
        tokens = GenerationConfig(max_new_tokens=6, ignore_eos=True)
        batched = run(engine, prompts, tokens)
        assert batched == [run(engine, [prompt], tokens)[0] for prompt in prompts]
        reference = AutoModelForCausalLM.from_pretrained(str(Path(folder).parent), gguf_file='model.gguf',
                                                         dtype=torch.float32).eval()
        assert_transformers_greedy(reference, prompts, batched, tokens.max_new_tokens)
    finally:
        engine.close()


def test_tp2_equals_tp1_with_a_tied_table(tmp_path):
    """Each rank's share of the tied table's rows serves its lookups and its share of the logits."""
    folder = write_file(tmp_path, Q.Q6_K, output=None)
    assert_tp2_equals_tp1(folder, random_prompts([9, 30], seed=6, vocab=250))
