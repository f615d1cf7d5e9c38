"""``benchmark/gpu_device.py`` without a GPU: the datasheet table by device name, the parameter counts behind the
roofline and the memory plan, and the plan itself for the two devices a GPU check gets, an 80 GB H100 (about
78 GiB free) and an H200 (about 139 GiB)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmark')
sys.path.insert(0, BENCHMARK)

import gpu_scale  # noqa: E402
from gpu_device import (RESERVE_BYTES, GiB, copy_tbs, device_spec, kv_bytes_per_token, parameter_counts,  # noqa: E402
                        plan_layers, spec_source)
from workload import llama3_8b_config, qwen3_30b_a3b_config  # noqa: E402

PLAN_TOKENS = 64 * 8256  # batch 64 at 8k context, in 64-token blocks, after the warm-up and timed steps


@pytest.mark.parametrize('name, part, tflops, tbs', [
    ('NVIDIA H100 80GB HBM3', 'H100 SXM', 989, 3.35),
    ('NVIDIA H100 PCIe', 'H100 PCIe', 756, 2.0),
    ('NVIDIA H100 NVL', 'H100 NVL', 835, 3.9),
    ('NVIDIA H200', 'H200 SXM', 989, 4.8),
    ('NVIDIA H200 NVL', 'H200 NVL', 835, 4.8),
])
def test_datasheet_by_device_name(name, part, tflops, tbs):
    spec, matched = device_spec(name)
    assert matched and (spec.name, spec.bf16_tflops, spec.hbm_tbs) == (part, tflops, tbs)
    assert spec_source(name) == f'{part} datasheet'


def test_unknown_device_says_which_figures_it_assumed():
    spec, matched = device_spec('NVIDIA A100-SXM4-80GB')
    assert not matched and spec.name == 'H100 SXM'
    assert spec_source('NVIDIA A100-SXM4-80GB') == "no entry for 'NVIDIA A100-SXM4-80GB': the H100 SXM datasheet assumed"


@pytest.mark.parametrize('config', [llama3_8b_config(tiny=True), qwen3_30b_a3b_config(tiny=True)])
def test_parameter_counts_are_transformers_less_the_norms(config):
    with torch.device('meta'):
        model = AutoModelForCausalLM.from_config(config)
    norms = sum(p.numel() for name, p in model.named_parameters() if 'norm' in name)
    per_layer, outside = parameter_counts(config)
    assert per_layer * config.num_hidden_layers + outside == sum(p.numel() for p in model.parameters()) - norms


def test_full_shapes_weigh_15_and_57_gib_in_bf16():
    for config, gib in ((llama3_8b_config(), 14.96), (qwen3_30b_a3b_config(), 56.87)):
        per_layer, outside = parameter_counts(config)
        assert 2 * (per_layer * config.num_hidden_layers + outside) / GiB == pytest.approx(gib, abs=0.01)
    assert kv_bytes_per_token(qwen3_30b_a3b_config()) == 96 * 1024


def test_h200_runs_the_whole_shapes():
    for config in (llama3_8b_config(), qwen3_30b_a3b_config()):
        plan = plan_layers(config, 139 * GiB, PLAN_TOKENS, 0.85)
        assert not plan.shrunk and plan.layers == config.num_hidden_layers


@pytest.mark.parametrize('shape, layers', [(llama3_8b_config, 25), (qwen3_30b_a3b_config, 30)])
def test_h100_drops_layers_until_the_batch_64_kv_fits(shape, layers):
    free = 78 * GiB
    plan = plan_layers(shape(), free, PLAN_TOKENS, 0.85)
    assert plan.shrunk and (plan.layers, plan.full_layers) == (layers, shape().num_hidden_layers)
    assert plan.weight_bytes + RESERVE_BYTES + plan.kv_bytes / 0.85 <= free
    one_more = plan_layers(shape(layers=layers + 1), free, PLAN_TOKENS, 0.85)
    assert one_more.shrunk  # the next layer would not fit
    assert f'{layers} of {shape().num_hidden_layers} layers' in plan.describe('x', PLAN_TOKENS)


def test_plan_only_prints_what_an_h100_would_run(capsys):
    assert gpu_scale.main(['--plan-only', '--free-gib', '78']) == 0  # no GPU needed
    out = capsys.readouterr().out
    assert 'llama3-8b: 25 of 32 layers' in out and 'qwen3-30b-a3b: 30 of 48 layers' in out
    assert 'KV of 528384 tokens' in out
    assert gpu_scale.main(['--plan-only', '--free-gib', '139', '--device', 'cpu']) == 0
    out = capsys.readouterr().out
    assert 'llama3-8b: all 32 layers' in out and 'qwen3-30b-a3b: all 48 layers' in out


def test_copy_bandwidth_counts_reads_and_writes():
    assert 0 < copy_tbs('cpu', 2**24, reps=2) < 10


@pytest.mark.slow
def test_kernel_bench_holds_its_figures_against_the_device_table():
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARK, 'kernel_bench.py'), '--device', 'cpu'],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, *rows = proc.stdout.splitlines()
    assert "GB/s measured now; peak 3350 GB/s and 989 TFLOP/s dense bf16 (no entry for 'cpu'" in header
    assert any('% of 3350 (peak)' in row for row in rows) and any('% of 989' in row for row in rows)
