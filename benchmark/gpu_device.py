"""What the GPU check's figures are measured against, per device: the datasheet peaks looked up by the device's
name, the copy bandwidth measured on it, and how many layers of a model's shape fit its memory with the KV cache
that the decode rows need (a shape that does not fit is shrunk to fewer layers, and says so)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # kernel_bench.py imports this module, and transformers would add seconds to its start
    from transformers import PretrainedConfig

GiB = 2**30
# What the engine leaves out of its KV cache budget: the decode graphs' activations and logits (about 1.5 GiB
# at 256 rows of a 152k vocabulary), the CUDA context, the allocator's slack; measured nowhere yet, so generous.
RESERVE_BYTES = 6 * GiB


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU's datasheet figures: dense bf16 tensor-core TFLOP/s and HBM TB/s."""
    name: str
    bf16_tflops: float
    hbm_tbs: float


# Matched in order against torch.cuda.get_device_name() ('NVIDIA H100 80GB HBM3' is the SXM part; the NVL and
# PCIe parts say so). Dense figures: NVIDIA's datasheets give twice as much "with sparsity".
DEVICES = (
    ('H200 NVL', DeviceSpec('H200 NVL', 835.0, 4.8)),
    ('H200', DeviceSpec('H200 SXM', 989.0, 4.8)),
    ('H100 NVL', DeviceSpec('H100 NVL', 835.0, 3.9)),
    ('H100 PCIe', DeviceSpec('H100 PCIe', 756.0, 2.0)),
    ('H100', DeviceSpec('H100 SXM', 989.0, 3.35)),
)
FALLBACK = DEVICES[-1][1]


def device_spec(device_name: str) -> tuple[DeviceSpec, bool]:
    """The table's entry for ``device_name`` and whether the name matched one (else the H100 SXM's, assumed)."""
    for pattern, spec in DEVICES:
        if pattern.lower() in device_name.lower():
            return spec, True
    return FALLBACK, False


def spec_source(device_name: str) -> str:
    """Where :func:`device_spec`'s figures for ``device_name`` come from, for a report's header."""
    spec, matched = device_spec(device_name)
    return f'{spec.name} datasheet' if matched else f'no entry for {device_name!r}: the {spec.name} datasheet assumed'


def copy_tbs(device: str, nbytes: int = GiB, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read and written (as the roofline's KV and weight
    reads are counted against it): ``reps`` copies of ``nbytes``, far beyond any L2, after two warm-up copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    if device.startswith('cuda'):
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if device.startswith('cuda'):
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del src, dst
    if device.startswith('cuda'):
        torch.cuda.empty_cache()
    return 2 * nbytes * reps / seconds / 1e12


def parameter_counts(c: PretrainedConfig) -> tuple[int, int]:
    """(parameters per decoder layer, parameters outside the layers) of a Llama- or Qwen3-MoE-shaped config; norms
    left out."""
    h = c.hidden_size
    attention = h * 2 * (c.num_attention_heads + c.num_key_value_heads) * c.head_dim
    experts = getattr(c, 'num_local_experts', None) or getattr(c, 'num_experts', 0)
    mlp = experts * (3 * h * c.moe_intermediate_size + h) if experts else 3 * h * c.intermediate_size
    return attention + mlp, c.vocab_size * h * (1 if c.tie_word_embeddings else 2)


def kv_bytes_per_token(c: PretrainedConfig, layers: int | None = None) -> int:
    """bf16 K and V of one token in ``layers`` (default: all) layers."""
    return 2 * (layers or c.num_hidden_layers) * c.num_key_value_heads * c.head_dim * 2


@dataclass(frozen=True)
class LayerPlan:
    """How many of a shape's layers run on a device whose free memory is ``free_bytes``, and why."""
    layers: int
    full_layers: int
    weight_bytes: int
    kv_bytes: int
    free_bytes: int

    @property
    def shrunk(self) -> bool:
        return self.layers < self.full_layers

    def describe(self, name: str, kv_tokens: int) -> str:
        kept = f'{self.layers} of {self.full_layers} layers' if self.shrunk else f'all {self.layers} layers'
        return (f'{name}: {kept} (bf16 weights {self.weight_bytes / GiB:.1f} GiB, KV of {kv_tokens} tokens '
                f'{self.kv_bytes / GiB:.1f} GiB, of {self.free_bytes / GiB:.1f} GiB free)')


def plan_layers(c: PretrainedConfig, free_bytes: int, kv_tokens: int, cache_fraction: float,
                reserve_bytes: int = RESERVE_BYTES) -> LayerPlan:
    """The most layers (at most the config's) whose bf16 weights leave, after ``reserve_bytes``, a KV cache of
    ``cache_fraction`` of the rest (the engine's ``cache_max_entry_count``) that holds ``kv_tokens`` tokens."""
    per_layer, outside = parameter_counts(c)
    for layers in range(c.num_hidden_layers, 0, -1):
        weights = 2 * (outside + layers * per_layer)
        kv = kv_tokens * kv_bytes_per_token(c, layers)
        if weights + reserve_bytes + kv / cache_fraction <= free_bytes:
            break
    return LayerPlan(layers, c.num_hidden_layers, weights, kv, free_bytes)


def roofline_ms(c: PretrainedConfig, batch: int, ctx: int, bandwidth: float, flops_per_s: float) -> float:
    """max(bytes / bandwidth, FLOPs / peak) of one bf16 decode step: the weights read (a MoE's touched
    experts only, for ``batch * top_k`` random picks; not the token table) plus the KV cache read, against 2
    FLOPs per active parameter per token plus attention."""
    layers, (per_layer, _) = c.num_hidden_layers, parameter_counts(c)
    lm_head = c.vocab_size * c.hidden_size
    experts = getattr(c, 'num_local_experts', None) or getattr(c, 'num_experts', 0)
    if experts:
        expert = 3 * c.hidden_size * c.moe_intermediate_size
        shared = layers * (per_layer - experts * expert) + lm_head
        touched = experts * (1 - (1 - c.num_experts_per_tok / experts) ** batch)
        weights = shared + layers * touched * expert
        active = shared + layers * c.num_experts_per_tok * expert
    else:
        weights = active = layers * per_layer + lm_head
    kv_bytes = batch * ctx * kv_bytes_per_token(c)
    flops = 2 * active * batch + 4 * batch * ctx * layers * c.num_attention_heads * c.head_dim
    return 1e3 * max((2 * weights + kv_bytes) / bandwidth, flops / flops_per_s)
