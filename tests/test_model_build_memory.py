"""Building a model reserves only the parameters it will hold: a GGUF MoE layer's experts are created as their
blocks, never first as dense tensors in the model dtype (``defer_weights``). Checked in a child process whose
address space (RLIMIT_AS) leaves room for the experts' blocks, not for their dense form."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

# Four layers of Qwen3-30B-A3B's experts (128 of 2048 x 768): 2.4 G weights, 1.3 GiB as Q4_K and Q6_K blocks,
# 9.0 GiB dense in fp32.
LAYERS, EXPERTS, HIDDEN, INTER = 4, 128, 2048, 768
HEADROOM = 3 * 2**30  # address space granted beyond the child's after its imports

CHILD = r'''
import json, re, resource, sys
import torch
from transformers import Qwen3MoeConfig
from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.nn.quant import weight_format_for
from lmdeploy.pytorch.weights.loader import _new_model

layers, experts, hidden, inter, headroom, reserve_dense = json.loads(sys.argv[1])
types = {}
for i in range(layers):
    types[f'layers.{i}.mlp.experts.gate_up_proj'] = 'Q4_K'
    types[f'layers.{i}.mlp.experts.down_proj'] = 'Q6_K' if i == 0 else 'Q4_K'
    types[f'layers.{i}.self_attn.qkv_proj'] = 'Q4_K'
quantization = {'quant_method': 'gguf', 'ggml_types': types}
hf = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, intermediate_size=3 * inter,
                    num_experts=experts, num_experts_per_tok=8, num_hidden_layers=layers, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=128, vocab_size=1024, architectures=['Qwen3MoeForCausalLM'],
                    quantization_config=quantization)
cfg = ModelConfig.from_hf(hf, torch.float32)
vm = int(re.search(r'VmSize:\s+(\d+) kB', open('/proc/self/status').read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))
if reserve_dense:  # what building the experts dense first would reserve
    dense = [torch.empty(experts, 3 * inter, hidden) for _ in range(layers)]
model = _new_model(cfg, weight_format_for(quantization))
params = {name: [str(p.dtype), list(p.shape)] for name, p in model.named_parameters()
          if name.startswith('layers.0.') and ('experts' in name or 'qkv' in name)}
print(json.dumps(params))
'''


def build_in_child(reserve_dense: bool) -> subprocess.CompletedProcess:
    args = json.dumps([LAYERS, EXPERTS, HIDDEN, INTER, HEADROOM, reserve_dense])
    return subprocess.run([sys.executable, '-c', CHILD, args], capture_output=True, text=True, timeout=300)


def test_gguf_moe_experts_are_built_as_blocks_within_the_address_space_of_the_blocks():
    built = build_in_child(reserve_dense=False)
    assert built.returncode == 0, built.stderr[-3000:]
    params = json.loads(built.stdout.splitlines()[-1])
    assert params['layers.0.mlp.experts.gate_up_qweight'] == ['torch.uint8', [EXPERTS, 2 * INTER, HIDDEN // 256,
                                                                                    144]]
    assert params['layers.0.mlp.experts.down_qweight'] == ['torch.uint8', [EXPERTS, HIDDEN, INTER // 256, 210]]
    assert params['layers.0.self_attn.qkv_proj.qweight'][0] == 'torch.uint8'
    assert not any(name.endswith(('experts.gate_up', 'experts.down', 'qkv_proj.weight')) for name in params)


def test_the_address_space_bound_rules_out_dense_experts():
    """The control: the same child fails when it reserves the experts' dense fp32 tensors first."""
    built = build_in_child(reserve_dense=True)
    assert built.returncode != 0
    assert 'memory' in built.stderr.lower(), built.stderr[-3000:]


@pytest.mark.parametrize('attribute', ['weight', 'gate_up'])
def test_layers_built_outside_a_model_hold_real_parameters(attribute):
    """Outside ``defer_weights`` (a layer built on its own) the parameters are created where the default device
    says, uninitialized, as before."""
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.moe import FusedExperts
    layer = Linear(64, 32) if attribute == 'weight' else FusedExperts(64, 32, 4)
    param = getattr(layer, attribute)
    assert param.device.type == 'cpu' and not param.is_meta



BENCHMARK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmark')
RETILE_CHILD = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from memory_accounting import anonymous_gib, malloc_gib
from lmdeploy.pytorch.nn.quant.q4k_cpu import pack_q4k
from lmdeploy.pytorch.weights.safetensors_loader import release_free_heap

blocks = torch.randint(0, 256, (32, 1536, 8, 144), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
kept = [pack_q4k(blocks[e], gate_up=True) for e in range(32)]
del blocks
before, free = anonymous_gib(), malloc_gib()['free']
release_free_heap()
print(json.dumps([before - anonymous_gib(), free]))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), 'malloc_trim') or not os.path.exists('/proc/self/smaps_rollup'),
                    reason='glibc malloc_trim and /proc/self/smaps_rollup are needed')
def test_release_free_heap_gives_back_what_retiling_experts_left_behind():
    """Retiling 32 Qwen3-30B-A3B-sized Q4_K experts one by one (as loading a GGUF MoE layer does) leaves their
    temporaries' freed chunks resident in the heap (7-80 MiB, as the heap happens to fall: the modules imported
    before move it); ``release_free_heap`` returns their pages."""
    out = subprocess.run([sys.executable, '-c', RETILE_CHILD, BENCHMARK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    released_gib, free_gib = json.loads(out.stdout.splitlines()[-1])
    assert free_gib > 4 / 1024, free_gib
    assert released_gib > free_gib / 2, (released_gib, free_gib)
