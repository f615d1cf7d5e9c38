"""``benchmark/gpu_scale.py``: its roofline and workload, and its whole ``--device cpu --tiny`` run (every
part, the api_server subprocess included, the decode shapes cut to fewer layers by the memory plan as on an
80 GB H100), so that the one run on a GPU machine is not its first."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmark')
sys.path.insert(0, BENCHMARK)

from gpu_device import RESERVE_BYTES, GiB, kv_bytes_per_token, parameter_counts, roofline_ms  # noqa: E402
from gpu_scale import DECODE_CACHE_FRACTION, parse_args, plan_tokens  # noqa: E402
from workload import llama3_8b_config, qwen3_30b_a3b_config, sharegpt_like_workload  # noqa: E402

H200 = dict(bandwidth=4.3e12, flops_per_s=790e12)


def test_roofline_dense_8b():
    # ~7.5B parameters read (all but the embedding): 15.0 GB at 4.3 TB/s.
    assert roofline_ms(llama3_8b_config(), 1, 0, **H200) == pytest.approx(3.49, abs=0.01)
    # Plus 64 x 8192 tokens of 128 KiB of KV.
    kv_ms = 64 * 8192 * 128 * 1024 / 4.3e12 * 1e3
    assert roofline_ms(llama3_8b_config(), 64, 8192, **H200) == pytest.approx(3.49 + kv_ms, abs=0.01)


def test_roofline_moe_counts_touched_experts():
    config = qwen3_30b_a3b_config()
    one, many = roofline_ms(config, 1, 0, **H200), roofline_ms(config, 256, 0, **H200)
    # Batch 1 reads 8 of 128 experts per layer (~1.4 ms); batch 256 reads nearly all of them (~14 ms).
    assert 1.2 < one < 1.6
    assert 13 < many < 15


def test_sharegpt_like_workload():
    work = sharegpt_like_workload(1000, 128256, seed=0)
    assert work == sharegpt_like_workload(1000, 128256, seed=0)
    inputs, outputs = [len(p) for p, _ in work], [n for _, n in work]
    assert 200 < statistics.median(inputs) < 300 and 160 < statistics.median(outputs) < 240
    assert min(inputs) >= 4 and max(inputs) <= 2048 and min(outputs) >= 4 and max(outputs) <= 1024
    assert all(0 <= t < 128256 for p, _ in work for t in p)
    clipped = sharegpt_like_workload(50, 100, input_clip=(8, 16), output_clip=(2, 3))
    assert all(8 <= len(p) <= 16 and 2 <= n <= 3 for p, n in clipped)


def one_layer_free_gib() -> float:
    """Free memory in which each tiny decode shape's plan keeps one of its two layers."""
    tokens = plan_tokens(parse_args(['--device', 'cpu', '--tiny']))
    needs = []
    for config in (llama3_8b_config(tiny=True), qwen3_30b_a3b_config(tiny=True)):
        per_layer, outside = parameter_counts(config)
        needs.append([RESERVE_BYTES + 2 * (outside + layers * per_layer)
                      + tokens * kv_bytes_per_token(config, layers) / DECODE_CACHE_FRACTION for layers in (1, 2)])
    low, high = max(one for one, _ in needs), min(two for _, two in needs)
    assert low < high
    return (low + high) / 2 / GiB


@pytest.mark.slow
def test_tiny_run_prints_every_row(tmp_path):
    out = tmp_path / 'table.txt'
    budgets = 'graphs=200,decode=200,moe=200,offline=200,server=200'
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARK, 'gpu_scale.py'), '--device', 'cpu', '--tiny',
                           '--out', str(out), '--budgets', budgets, '--free-gib', str(one_layer_free_gib())],
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    table = out.read_text()
    assert table.strip() in proc.stdout
    assert 'roofline: ' in table.splitlines()[0] and "no entry for 'cpu'" in table.splitlines()[0]
    assert '# decode memory plan: llama3-8b: 1 of 2 layers' in table
    assert '# moe memory plan: qwen3-30b-a3b: 1 of 2 layers' in table
    rows = [line for line in table.splitlines() if ' | ' in line][1:]
    cases = {tuple(cell.strip() for cell in row.split('|')[:2]): row for row in rows}
    assert 'graphs on' in cases['graphs', '135M-shape b=1 ctx=512 decode']
    for batch in (1, 4, 16):
        for ctx in (64, 512):
            for part, name in (('decode', 'llama3-8b/1L'), ('moe', 'qwen3-30b-a3b/1L')):
                row = cases[part, f'{name} b={batch} ctx={ctx} graphs']
                assert ('n/a (KV does not fit)' in row) == ((batch, ctx) == (16, 512)), row  # 96 blocks of 64
                assert 'n/a' in row or ('ms/step' in row and 'roofline' in row)
    assert '% of roofline' in cases['decode', 'llama3-8b/1L b=1 ctx=512 eager']
    assert 'transformers' in cases['offline', 'llama3-8b 8 prompts']
    assert 'lmdeploy' in cases['offline', 'llama3-8b 24 prompts']
    assert 'p99' in cases['server', 'llama3-8b 6 streams TTFT']
    assert 'p99' in cases['server', 'llama3-8b 6 streams TPOT']
    assert not any('ERROR' in row or 'skipped' in row for row in rows)
