"""The derived-weight cache (``weights/derived_cache.py``) behind ``decode_int4``'s 4-bit grid, a GGUF token
table's native tiles, the GGUF Q4_K and Q6_K layers' GEMV packing, bf16 weights' native panels and an LM head's
8-bit copy: a later start reads the same bits the fit or
packing gives, another weight never finds an entry, an edit of the deriving code misses, an unreadable entry is
derived again; its cap (least recently used entries removed first, never this process's; 0: off); and the KV
cache's lazily zeroed memory."""
from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmdeploy.pytorch.device import lazily_zeroed
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant import cpu_bf16, gguf_table, int4_cpu, q4k_cpu, q6k_cpu, q8_cpu
from lmdeploy.pytorch.nn.quant.gguf_table import NATIVE_TYPES, NativeBlocks
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.weights import derived_cache

needs_gemv = pytest.mark.skipif(cpu.int4_gemv() is None, reason='the native int4 GEMV is not built for this CPU')
needs_q8_gemv = pytest.mark.skipif(cpu.q8_gemv() is None, reason='the native Q8_0 GEMV is not built for this CPU')
needs_bf16_gemm = pytest.mark.skipif(cpu.bf16_gemm() is None, reason='the native bf16 GEMM is not this CPU\'s')


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test as a process of its own: no entries used before it."""
    monkeypatch.setattr(derived_cache, '_used_here', {})
    monkeypatch.delenv('LMDEPLOY_DERIVED_CACHE_BYTES', raising=False)


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


def kquant_blocks(seed: int, block_bytes: int, rows: int = 256) -> torch.Tensor:
    """Random bytes as ``[rows, 8, block_bytes]`` blocks (the packings move bits, whatever they hold)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, 8, block_bytes), generator=generator, dtype=torch.uint8)


# per type: its module, the packing function its kernel calls, its block bytes, the kernel's packed tensors
KQUANTS = {
    'Q6_K': (q6k_cpu, 'pack_q6k_rows', 210, lambda blocks, _: q6k_cpu.Q6KGemv.of(blocks)),
    'Q4_K': (q4k_cpu, 'pack_q4k', 144, lambda blocks, gate_up: q4k_cpu.Q4KGemv.of_blocks(blocks, gate_up)),
}


def kquant_packed(ggml_type: str, blocks: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = KQUANTS[ggml_type][3](blocks, gate_up)
    return kernel.packed, kernel.scales


def kquant_fresh(ggml_type: str, blocks: torch.Tensor, gate_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    module, pack, _, _ = KQUANTS[ggml_type]
    return getattr(module, pack)(blocks, gate_up) if ggml_type == 'Q4_K' else getattr(module, pack)(blocks)


needs_kquant_gemvs = pytest.mark.skipif(cpu.q6k_gemv() is None or cpu.int4_gemv() is None,
                                        reason='the native Q6_K and int4 GEMVs are not built for this CPU')


@needs_kquant_gemvs
@pytest.mark.parametrize('ggml_type', KQUANTS)
def test_a_second_start_reads_the_kquant_packing(ggml_type: str, tmp_gguf_cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    module, pack, block_bytes, _ = KQUANTS[ggml_type]
    blocks = kquant_blocks(0, block_bytes)
    first = kquant_packed(ggml_type, blocks)
    assert_bitwise(first, kquant_fresh(ggml_type, blocks))
    assert len(entries(tmp_gguf_cache)) == 1
    monkeypatch.setattr(module, pack, lambda *_: pytest.fail('packed again'))
    assert_bitwise(kquant_packed(ggml_type, blocks.clone()), first)


@needs_kquant_gemvs
@pytest.mark.parametrize('ggml_type', KQUANTS)
def test_another_kquant_weight_or_an_edit_of_its_packing_misses(ggml_type: str, tmp_gguf_cache: Path,
                                                                tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    module, _, block_bytes, _ = KQUANTS[ggml_type]
    blocks = kquant_blocks(1, block_bytes)
    kquant_packed(ggml_type, blocks)
    changed = blocks.clone()
    changed[200, 3, 100] ^= 1
    assert_bitwise(kquant_packed(ggml_type, changed), kquant_fresh(ggml_type, changed))
    assert len(entries(tmp_gguf_cache)) == 2
    if ggml_type == 'Q4_K':
        assert_bitwise(kquant_packed(ggml_type, blocks, gate_up=True), kquant_fresh(ggml_type, blocks, gate_up=True))
        assert len(entries(tmp_gguf_cache)) == 3
    source = tmp_path / Path(module.__file__).name
    source.write_text(Path(module.__file__).read_text() + '\n# edited\n')
    monkeypatch.setattr(module, '__file__', str(source))
    before = len(entries(tmp_gguf_cache))
    assert_bitwise(kquant_packed(ggml_type, blocks), kquant_fresh(ggml_type, blocks))
    assert len(entries(tmp_gguf_cache)) == before + 1


MIB = 1 << 20


def cached(seed: int, calls: list[int]) -> Path:
    """Derives a 1 MiB tensor through the cache (``calls`` counts the derivations); returns its entry's path."""
    w = torch.full((derived_cache.MIN_CACHED_NUMEL, ), float(seed))
    got = derived_cache.cached_derivation('test', w, __file__, lambda: calls.append(seed) or (w * 2, ))
    assert torch.equal(got[0], w * 2)
    return derived_cache.entry_path('test', w, __file__)


def in_another_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(derived_cache, '_used_here', {})


def bf16_panels(w: torch.Tensor, gate_up: bool) -> torch.Tensor:
    return cpu_bf16.native_bf16_kernel(w, gate_up).panels


@needs_bf16_gemm
@pytest.mark.parametrize('gate_up', [False, True])
def test_a_second_start_reads_the_bf16_panels(gate_up: bool, tmp_gguf_cache: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    w = weight(20, rows=600, cols=513)  # padded: 600 rows (300 each for gate and up) and an odd width
    first = bf16_panels(w, gate_up)
    with monkeypatch.context() as uncached:
        uncached.setenv('LMDEPLOY_DERIVED_CACHE_BYTES', '0')
        assert_bitwise((first, ), (bf16_panels(w, gate_up), ))
    assert len(entries(tmp_gguf_cache)) == 1
    changed = w.clone()
    changed[599, 512] += 1
    assert not torch.equal(bf16_panels(changed, gate_up), first)
    source = tmp_path / 'linear_bf16.cpp'
    source.write_text('// the packing, edited\n')
    monkeypatch.setattr(cpu_bf16, '_PACKING_SOURCES', cpu_bf16._PACKING_SOURCES[:1] + (str(source), ))
    bf16_panels(w, gate_up)
    assert len(entries(tmp_gguf_cache)) == 3
    monkeypatch.setattr(cpu, 'bf16_gemm', lambda: SimpleNamespace(pack_bf16_weight=pytest.fail,
                                                                  pack_bf16_gate_up=pytest.fail))
    assert_bitwise((bf16_panels(w.clone(), gate_up), ), (first, ))


@needs_q8_gemv
def test_a_second_start_reads_the_lm_heads_8_bit_copy(tmp_gguf_cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(21)
    codes = torch.randint(-127, 128, (1024, 8, 32), generator=generator).float()
    codes[..., 0] = 127  # each group's scale its largest magnitude over 127: a power of two, as given
    scales = torch.exp2(-torch.randint(4, 12, (1024, 8, 1), generator=generator).float())
    table = (codes * scales).view(1024, 256).bfloat16()  # a Q8_0 table, exact in bf16: its 8-bit copy is exact
    noisy = weight(22, rows=1024, cols=256)  # one that 8 bits would round: no copy
    first = q8_cpu.Q8Gemv.of(table)
    assert_bitwise((first.packed, first.scales), q8_cpu.packed_q8_copy(table))
    assert q8_cpu.Q8Gemv.of(noisy) is None
    assert len(entries(tmp_gguf_cache)) == 2
    with monkeypatch.context() as failing:
        failing.setattr(q8_cpu, 'packed_q8_copy', pytest.fail)
        again = q8_cpu.Q8Gemv.of(table.clone())
        assert_bitwise((again.packed, again.scales), (first.packed, first.scales))
        assert q8_cpu.Q8Gemv.of(noisy.clone()) is None
    source = tmp_path / 'q8_cpu.py'
    source.write_text(Path(q8_cpu.__file__).read_text() + '\n# edited\n')
    monkeypatch.setattr(q8_cpu, '__file__', str(source))
    q8_cpu.Q8Gemv.of(table)
    assert len(entries(tmp_gguf_cache)) == 3


def test_a_weight_is_hashed_again_once_written_in_place() -> None:
    w = weight(23)
    digest = derived_cache.weight_digest(w)
    assert derived_cache.weight_digest(w) == digest == derived_cache.weight_digest(w.clone())
    w[0, 0] += 1
    assert derived_cache.weight_digest(w) != digest


def test_the_cap_removes_the_least_recently_used_first(tmp_gguf_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_DERIVED_CACHE_BYTES', str(3 * MIB + MIB // 2))
    calls: list[int] = []
    now = time.time()
    paths = []
    for age, seed in zip((300, 200, 100), range(3)):  # entry 0 the oldest
        in_another_process(monkeypatch)
        paths.append(cached(seed, calls))
        os.utime(paths[-1], (now - age, now - age))
    in_another_process(monkeypatch)
    assert cached(0, calls) == paths[0] and calls == [0, 1, 2]  # read: now the most recently used
    in_another_process(monkeypatch)
    paths.append(cached(3, calls))
    assert entries(tmp_gguf_cache) == sorted((paths[0], paths[2], paths[3]))


def test_the_cap_keeps_this_process_entries(tmp_gguf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_DERIVED_CACHE_BYTES', str(2 * MIB + MIB // 2))
    calls: list[int] = []
    this_process = derived_cache._used_here
    mine = [cached(0, calls)]
    os.utime(mine[0], (time.time() - 100, ) * 2)
    in_another_process(monkeypatch)
    cached(1, calls)  # used more recently than this process's first entry
    monkeypatch.setattr(derived_cache, '_used_here', this_process)
    mine.append(cached(2, calls))
    assert entries(tmp_gguf_cache) == sorted(mine)  # the other process's entry removed
    cached(3, calls)  # over the cap with this process's own: derived, not stored
    cached(3, calls)
    assert entries(tmp_gguf_cache) == sorted(mine) and calls == [0, 1, 2, 3, 3]


def test_a_cap_of_zero_turns_the_cache_off(tmp_gguf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    stored = cached(0, calls)
    monkeypatch.setenv('LMDEPLOY_DERIVED_CACHE_BYTES', '0')
    cached(0, calls)
    cached(1, calls)
    assert calls == [0, 0, 1] and entries(tmp_gguf_cache) == [stored]
    monkeypatch.setenv('LMDEPLOY_DERIVED_CACHE_BYTES', '4 GiB')
    with pytest.raises(ValueError, match='number of bytes'):
        cached(1, calls)


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
