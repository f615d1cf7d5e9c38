"""Triton GEMMs on GGUF Q6_K and Q8_0 weights (``kernels/cuda/gguf_linear.py``) against ``gguf``'s own
dequantization and a matmul (interpreter on CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_env import DEVICE, DTYPES

gguf = pytest.importorskip('gguf')
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_gguf import _encode  # noqa: E402

from lmdeploy.pytorch.kernels import moe  # noqa: E402
from lmdeploy.pytorch.kernels.cuda.fused_moe import MOE_CONFIGS, fused_moe_with  # noqa: E402
from lmdeploy.pytorch.kernels.cuda.gguf_linear import (GgufLaunch, Q6KExperts, Q8Experts, gguf_launch,  # noqa: E402
                                                       q6k_linear, q8_0_block_k, q8_0_linear)
from lmdeploy.pytorch.nn.quant import gguf_cuda  # noqa: E402
from lmdeploy.pytorch.nn.quant.gguf_cuda import TritonQ6KKernel, TritonQ8Kernel, pack_q6k, pack_q8_0  # noqa: E402

pytestmark = pytest.mark.triton
TOL = {torch.float32: 2e-3 if DEVICE == 'cuda' else 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BLOCK_BYTES = {Q.Q6_K: 210, Q.Q8_0: 34}


def gguf_weight(qtype: Q, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``qtype`` blocks ``uint8 [N, K / B, bytes]`` and gguf's fp32 dequantization ``[N, K]``."""
    rng = np.random.default_rng(seed)
    data = _encode(rng.standard_normal((n, k)).astype(np.float32), qtype, rng)
    weight = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
    return torch.from_numpy(data).view(n, -1, BLOCK_BYTES[qtype]), weight


def run_kernel(qtype: Q, blocks: torch.Tensor, x: torch.Tensor, launch: GgufLaunch | None = None) -> torch.Tensor:
    if qtype == Q.Q6_K:
        return q6k_linear(x, *(t.to(DEVICE) for t in pack_q6k(blocks)), launch=launch)
    return q8_0_linear(x, *(t.to(DEVICE) for t in pack_q8_0(blocks)), launch=launch)


def assert_matches(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> None:
    expected = x.float().cpu() @ weight.T
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float().cpu(), expected, rtol=TOL[dtype], atol=TOL[dtype] * expected.abs().max())


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('rows', [1, 3, 16, 70])
@pytest.mark.parametrize('qtype,n,k', [(Q.Q6_K, 80, 512), (Q.Q6_K, 16, 256), (Q.Q8_0, 80, 256), (Q.Q8_0, 48, 96)],
                         ids=['q6k-80x512', 'q6k-16x256', 'q8_0-80x256', 'q8_0-48x96'])
def test_gemm_matches_gguf_dequantization(qtype, n, k, rows, dtype):
    """Decode steps (split over the inputs, 16-row tiles) and larger ones (32, 128 rows, no split); outputs that
    do not fill a 64-column tile; Q8_0 in steps of 128 and of 32 inputs."""
    blocks, weight = gguf_weight(qtype, n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(DEVICE, dtype)
    assert_matches(run_kernel(qtype, blocks, x), x, weight, dtype)


@pytest.mark.parametrize('qtype,k', [(Q.Q6_K, 768), (Q.Q8_0, 320)], ids=['q6k', 'q8_0'])
@pytest.mark.parametrize('split_k', [1, 2, 3])
def test_every_split_of_the_inputs(qtype, k, split_k):
    """A split that leaves the last program fewer steps (3 of Q6_K's 3 blocks, Q8_0's 5 steps of 64), and none."""
    dtype = DTYPES[-1]
    blocks, weight = gguf_weight(qtype, 64, k, seed=split_k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    assert_matches(run_kernel(qtype, blocks, x, GgufLaunch(16, 32, split_k, 4, 2)), x, weight, dtype)


def test_launch_table():
    """Decode steps split the inputs until about 256 programs run (Llama-3-8B's Q6_K ``v_proj``: 16 column tiles,
    16 blocks, so one block each; ``down_proj``: 64 tiles, 4 splits of 14 blocks); larger steps never split."""
    assert gguf_launch(1, 1024, 16) == GgufLaunch(16, 64, 16, 4, 2)
    assert gguf_launch(16, 4096, 56) == GgufLaunch(16, 64, 4, 4, 2)
    assert gguf_launch(1, 64, 3).split_k == 3  # no more splits than steps
    assert gguf_launch(1, 64, 6).split_k == 6  # 256 wanted: 6 single steps
    assert gguf_launch(1, 4096, 7).split_k == 4  # 7 steps in splits of 2: the last has one
    assert gguf_launch(33, 4096, 56) == GgufLaunch(64, 64, 1, 4, 2)
    assert gguf_launch(512, 4096, 56) == GgufLaunch(128, 64, 1, 8, 2)
    assert [q8_0_block_k(k) for k in (4096, 14336, 320, 96)] == [128, 128, 64, 32]


@pytest.mark.parametrize('kernel,qtype', [(TritonQ6KKernel, Q.Q6_K), (TritonQ8Kernel, Q.Q8_0)], ids=['q6k', 'q8_0'])
def test_layer_kernels_add_the_bias_and_refuse_other_widths(kernel, qtype):
    blocks, weight = gguf_weight(qtype, 32, 256)
    layer = kernel(blocks.to(DEVICE))
    x = torch.randn(2, 256).to(DEVICE)
    bias = torch.randn(32).to(DEVICE)
    torch.testing.assert_close(layer(x, bias).cpu(), x.cpu() @ weight.T + bias.cpu(), rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match='inputs'):
        layer(torch.randn(2, 224).to(DEVICE), None)


def test_q6k_retiling_keeps_the_file_bits(monkeypatch):
    """Each field of the retiled words is the file's code: rebuilt in torch, the weights are gguf's (retiled three
    rows at a time)."""
    monkeypatch.setattr(gguf_cuda, 'PACK_ROWS', 3)
    blocks, weight = gguf_weight(Q.Q6_K, 8, 512)
    ql, qh, sc, d = pack_q6k(blocks)
    words = torch.arange(8, dtype=torch.int32)
    low = (ql.view(8, 2, 1, 32) >> (4 * words).view(1, 1, 8, 1)) & 15  # [row, block, field i, word j]
    top = (qh.view(8, 2, 1, 16) >> (2 * torch.arange(16, dtype=torch.int32)).view(1, 1, 16, 1)) & 3
    codes = low.reshape(8, 2, 256) | (top.reshape(8, 2, 256) << 4)
    scales = d.float().repeat_interleave(16, dim=1) * sc.float()
    rebuilt = ((codes.reshape(8, 512) - 32).float().view(8, 32, 16) * scales[..., None]).view(8, 512)
    assert ql.dtype == qh.dtype == torch.int32 and (ql.numel() * 4 + qh.numel() * 4 + sc.numel() + d.numel() * 2
                                                     == blocks.numel())
    assert torch.equal(rebuilt, weight)


@pytest.mark.skipif(DEVICE != 'cuda', reason='the CUDA path of the GGUF formats')
@pytest.mark.parametrize('qtype,kernel', [(Q.Q6_K, TritonQ6KKernel), (Q.Q8_0, TritonQ8Kernel)], ids=['q6k', 'q8_0'])
def test_gguf_layers_take_the_triton_kernels_on_cuda(qtype, kernel):
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.quant import LinearOptions, use_weight_format
    from lmdeploy.pytorch.nn.quant.gguf import GgufFormat
    blocks, weight = gguf_weight(qtype, 64, 512)
    with use_weight_format(GgufFormat(qtype.name)):
        layer = Linear(512, 64)
    layer.qweight.copy_(blocks)
    layer.to(DEVICE).finalize(LinearOptions(dtype=torch.bfloat16))
    assert isinstance(layer.kernel, kernel) and layer.qweight is None
    x = torch.randn(4, 512, device=DEVICE, dtype=torch.bfloat16)
    assert_matches(layer(x), x, weight, torch.bfloat16)


@pytest.mark.skipif(DEVICE != 'cuda', reason='the CUDA path of a GGUF output layer')
def test_q6k_output_layer_runs_on_its_blocks_on_cuda():
    """A Q6_K output layer's blocks run every step of the LM head on CUDA; a vocab-parallel share keeps its table."""
    from lmdeploy.pytorch.nn.quant.gguf import GgufFileFormat
    blocks, weight = gguf_weight(Q.Q6_K, 90, 256)
    weight_format = GgufFileFormat({}, lm_head='Q6_K')
    (_, table), = weight_format.convert_checkpoint([('lm_head.qweight', blocks)])
    head = weight_format.lm_head_kernel(table.to(DEVICE, torch.bfloat16))
    assert isinstance(head, TritonQ6KKernel) and weight_format.lm_head_blocks is None
    for rows in (1, 40):
        x = torch.randn(rows, 256, device=DEVICE, dtype=torch.bfloat16)
        assert_matches(head(x, None), x, weight, torch.bfloat16)
    list(weight_format.convert_checkpoint([('lm_head.qweight', blocks)]))
    assert weight_format.lm_head_kernel(table[:45].to(DEVICE)) is None and weight_format.lm_head_blocks is None


@pytest.mark.parametrize('row', range(len(MOE_CONFIGS)))
def test_fused_moe_on_gguf_experts_at_every_tile_row(row):
    """The fused MoE's grouped GEMMs on Q6_K gate-and-up and Q8_0 down experts, both biased, at every row of the
    tile table (M-blocks of 16 to 128 slots, unused tail blocks), against the torch twin on gguf's weights."""
    dtype = DTYPES[-1]
    num_experts, hidden_size, inter = 4, 256, 128
    parts = [gguf_weight(Q.Q6_K, 2 * inter, hidden_size, seed=e) for e in range(num_experts)]
    gate_up = Q6KExperts(*(torch.stack(p).to(DEVICE) for p in zip(*(pack_q6k(b) for b, _ in parts))))
    downs = [gguf_weight(Q.Q8_0, hidden_size, inter, seed=10 + e) for e in range(num_experts)]
    down = Q8Experts(*(torch.stack(p).to(DEVICE) for p in zip(*(pack_q8_0(b) for b, _ in downs))))
    assert gate_up.shape == (num_experts, 2 * inter, hidden_size) and down.shape == (num_experts, hidden_size, inter)
    g = torch.Generator().manual_seed(row)
    hidden = torch.randn(45, hidden_size, generator=g) * 0.1
    biases = torch.randn(num_experts, 2 * inter, generator=g), torch.randn(num_experts, hidden_size, generator=g)
    weights, ids = moe.moe_routing(torch.randn(45, num_experts, generator=g), 3, True)
    out = fused_moe_with(hidden.to(DEVICE, dtype), gate_up, down, weights.to(DEVICE), ids.to(DEVICE),
                         MOE_CONFIGS[row][1], *(b.to(DEVICE, dtype) for b in biases))
    expected = moe.fused_moe(hidden, torch.stack([w for _, w in parts]), torch.stack([w for _, w in downs]), weights,
                             ids, *biases)
    torch.testing.assert_close(out.float().cpu(), expected, rtol=TOL[dtype], atol=TOL[dtype] * expected.abs().max())
