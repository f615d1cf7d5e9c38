"""The native GEMVs' fp32 outputs (``empty_output``, ``kernels/cpu/common.h``): a large one may be backed by 2 MiB
pages where the kernel's transparent huge pages are ``madvise`` (its 4 KiB pages' first touch cost Gemma 3's LM head
at 64 rows 27-35 ms of 150), and its values are those of a small one."""
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


@pytest.mark.skipif(not THP.exists() or '[never]' in THP.read_text(), reason='transparent huge pages are off')
@pytest.mark.parametrize('make_gemv', [q8_gemv, q6k_gemv], ids=['q8_0', 'q6k'])
def test_a_large_output_lies_on_huge_pages(make_gemv):
    """64 rows of 32,768 fp32 outputs (8 MiB): the pages around its middle may be huge (``THPeligible``; on fresh
    pages from mmap, as Gemma 3's logits always are, they are), and each row is the one a call of that row alone
    gives (a small output)."""
    if cpu.q8_gemv() is None or cpu.q6k_gemv() is None:
        pytest.skip('the native GEMVs need AVX512-BF16')
    g = torch.Generator().manual_seed(0)
    gemv = make_gemv(32768, 512, g)
    x = torch.randn(64, 512, generator=g).bfloat16()
    out = gemv(x)
    assert out.dtype == torch.float32 and out.shape == (64, 32768)
    assert mapping_field(out.data_ptr() + out.nbytes // 2, 'THPeligible') == 1
    assert torch.equal(out[5:6], gemv(x[5:6])) and torch.equal(out[:2], gemv(x[:2]))
