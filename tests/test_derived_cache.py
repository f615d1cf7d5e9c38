"""The derived-weight cache (``weights/derived_cache.py``) behind ``decode_int4``'s 4-bit grid and a GGUF token
table's native tiles: a later start reads the same bits the fit or retiling gives, another weight never finds an
entry, an edit of the deriving code misses, an unreadable entry is derived again; and the KV cache's lazily zeroed
memory."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmdeploy.pytorch.device import lazily_zeroed
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant import gguf_table, int4_cpu
from lmdeploy.pytorch.nn.quant.gguf_table import NATIVE_TYPES, NativeBlocks
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.weights import derived_cache

needs_gemv = pytest.mark.skipif(cpu.int4_gemv() is None, reason='the native int4 GEMV is not built for this CPU')
needs_q8_gemv = pytest.mark.skipif(cpu.q8_gemv() is None, reason='the native Q8_0 GEMV is not built for this CPU')


def weight(seed: int, rows: int = 512, cols: int = 512) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=generator).to(torch.bfloat16)


def fresh(w: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return int4_cpu.pack_int4(*int4_cpu.least_squares_grid(w), gate_up)


def packed(w: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    small = SmallStepInt4Kernel.of(w, gate_up).small
    return small.packed, small.scales


def entries(cache: Path) -> list[Path]:
    return sorted((cache / 'derived').glob('*.safetensors')) if (cache / 'derived').is_dir() else []


def assert_bitwise(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    assert all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=True))


@needs_gemv
def test_a_second_start_reads_the_fitted_grid(tmp_gguf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight(0)
    first = packed(w)
    assert_bitwise(first, fresh(w))
    assert len(entries(tmp_gguf_cache)) == 1
    monkeypatch.setattr(int4_cpu, 'least_squares_grid', lambda _: pytest.fail('fitted again'))
    assert_bitwise(packed(w.clone()), first)


@needs_gemv
def test_another_weight_or_layout_never_finds_the_entry(tmp_gguf_cache: Path) -> None:
    w = weight(1)
    packed(w)
    changed = w.clone()
    changed[7, 300] += 1
    assert_bitwise(packed(changed), fresh(changed))
    assert_bitwise(packed(w, gate_up=True), fresh(w, gate_up=True))
    reshaped = w.view(256, 1024)  # the same bytes as another shape
    assert_bitwise(packed(reshaped), fresh(reshaped))
    assert len(entries(tmp_gguf_cache)) == 4


@needs_gemv
def test_an_edit_of_the_fitting_code_misses(tmp_gguf_cache: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight(2)
    source = tmp_path / 'int4_cpu.py'
    source.write_text(Path(int4_cpu.__file__).read_text())
    monkeypatch.setattr(int4_cpu, '__file__', str(source))
    packed(w)
    source.write_text(source.read_text() + '\n# edited\n')
    packed(w)
    assert len(entries(tmp_gguf_cache)) == 2


@needs_gemv
def test_an_unreadable_entry_is_fitted_again(tmp_gguf_cache: Path) -> None:
    w = weight(3)
    packed(w)
    [entry] = entries(tmp_gguf_cache)
    entry.write_bytes(entry.read_bytes()[:100])
    assert_bitwise(packed(w), fresh(w))
    assert_bitwise(packed(w), fresh(w))  # rewritten whole
    assert entry.stat().st_size > 100


def q8_0_table(seed: int, rows: int = 1000, hidden: int = 256) -> torch.Tensor:
    """Q8_0 blocks ``[rows, hidden / 32, 34]`` of random codes and scales (1000 rows: not a multiple of the tiles)."""
    generator = torch.Generator().manual_seed(seed)
    scales = (torch.rand(rows, hidden // 32, 1, generator=generator) / 64).half().view(torch.uint8)
    codes = torch.randint(-127, 128, (rows, hidden // 32, 32), generator=generator, dtype=torch.int8)
    return torch.cat((scales, codes.view(torch.uint8)), dim=-1)


def retiled(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    table = NativeBlocks(blocks, 'Q8_0')
    return table.packed, table.scales


@needs_q8_gemv
def test_a_second_start_reads_the_retiled_table(tmp_gguf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = q8_0_table(0)
    first = retiled(blocks)
    assert_bitwise(first, gguf_table.retile(blocks, NATIVE_TYPES['Q8_0'].pack))
    assert len(entries(tmp_gguf_cache)) == 1
    monkeypatch.setattr(gguf_table, 'retile', lambda *_: pytest.fail('retiled again'))
    assert_bitwise(retiled(blocks.clone()), first)


@needs_q8_gemv
def test_another_table_or_an_edit_of_its_packing_misses(tmp_gguf_cache: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = q8_0_table(1)
    retiled(blocks)
    changed = blocks.clone()
    changed[999, 7, 20] ^= 1  # one code of the last row, in the padded tile
    assert_bitwise(retiled(changed), gguf_table.retile(changed, NATIVE_TYPES['Q8_0'].pack))
    assert len(entries(tmp_gguf_cache)) == 2
    packing = tmp_path / 'q8_cpu.py'
    packing.write_text(Path(NATIVE_TYPES['Q8_0'].sources[-1]).read_text() + '\n# edited\n')
    monkeypatch.setitem(NATIVE_TYPES, 'Q8_0', NATIVE_TYPES['Q8_0']._replace(sources=(str(packing), )))
    retiled(blocks)
    assert len(entries(tmp_gguf_cache)) == 3


def test_small_weights_are_not_cached(tmp_gguf_cache: Path) -> None:
    calls = []
    small = torch.ones(derived_cache.MIN_CACHED_NUMEL - 1)
    assert derived_cache.cached_derivation('x', small, __file__, lambda: calls.append(1) or (small,))[0] is small
    assert calls == [1] and entries(tmp_gguf_cache) == []


def test_lazily_zeroed_memory_is_zeros_and_writable() -> None:
    cache = lazily_zeroed((3, 64, 2, 8), torch.bfloat16, torch.device('cpu'))
    assert cache.shape == (3, 64, 2, 8) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    cache[1, 5] = 2.5
    assert cache.sum().item() == 2.5 * 16
    assert lazily_zeroed((0, 4), torch.float32, torch.device('cpu')).shape == (0, 4)
