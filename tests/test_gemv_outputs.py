"""The native linear kernels' outputs (``empty_output``, ``kernels/cpu/common.h``): a large one may be backed by 2 MiB
pages where the kernel's transparent huge pages are ``madvise`` (its 4 KiB pages' first touch cost Gemma 3's LM head
at 64 rows 27-35 ms of 150 on its Q8_0 blocks, 14-15 ms of its bf16 table's time), and its values are those of a small
one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.q6k_cpu import pack_q6k
from lmdeploy.pytorch.nn.quant.q8_cpu import pack_q8

THP = Path('/sys/kernel/mm/transparent_hugepage/enabled')


def mapping_field(address: int, field: str) -> int:
    """``field`` of the mapping in ``/proc/self/smaps`` that holds ``address``."""
    inside = False
    for line in Path('/proc/self/smaps').read_text().splitlines():
        head = line.split()[0]
        if '-' in head and not head.endswith(':'):
            start, end = (int(part, 16) for part in head.split('-'))
            inside = start <= address < end
        elif inside and head == f'{field}:':
            return int(line.split()[1])
    raise AssertionError(f'no mapping holds {address:#x}')


def q8_gemv(outputs: int, inputs: int, g: torch.Generator):
    codes = torch.randint(-127, 128, (outputs, inputs), generator=g, dtype=torch.int8)
    packed, scales = pack_q8(codes, (torch.rand(outputs, inputs // 32, generator=g) / 50).half())
    return lambda x: cpu.native().q8_linear(x, packed, scales)


def q6k_gemv(outputs: int, inputs: int, g: torch.Generator):
    blocks = torch.randint(0, 256, (outputs, inputs // 256, 210), generator=g, dtype=torch.uint8)
    blocks[..., 208:] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d = 2^-7: finite weights
    packed, scales = pack_q6k(blocks)
    return lambda x: cpu.native().q6k_linear(x, packed, scales)


def bf16_gemm(outputs: int, inputs: int, g: torch.Generator):
    packed = cpu.bf16_gemm().pack_bf16_weight(torch.randn(outputs, inputs, generator=g).bfloat16())
    return lambda x: cpu.bf16_gemm().bf16_linear(x, packed, None, None)


@pytest.mark.skipif(not THP.exists() or '[never]' in THP.read_text(), reason='transparent huge pages are off')
@pytest.mark.parametrize('make_gemv', [q8_gemv, q6k_gemv, bf16_gemm], ids=['q8_0', 'q6k', 'bf16'])
def test_a_large_output_lies_on_huge_pages(make_gemv):
    """64 rows of 32,768 fp32 outputs (8 MiB; bf16: 65,536 outputs): the pages around its middle may be huge (``THPeligible``; on fresh
    pages from mmap, as Gemma 3's logits always are, they are), and each row is the one a call of that row alone
    gives (a small output)."""
    if cpu.q8_gemv() is None or cpu.q6k_gemv() is None or cpu.bf16_gemm() is None:
        pytest.skip('the native GEMVs need AVX512-BF16')
    g = torch.Generator().manual_seed(0)
    outputs = 65536 if make_gemv is bf16_gemm else 32768
    gemv = make_gemv(outputs, 512, g)
    x = torch.randn(64, 512, generator=g).bfloat16()
    out = gemv(x)
    assert out.shape == (64, outputs) and out.nbytes == 8 << 20
    assert mapping_field(out.data_ptr() + out.nbytes // 2, 'THPeligible') == 1
    assert torch.equal(out[5:6], gemv(x[5:6])) and torch.equal(out[:2], gemv(x[:2]))
