"""Builds one rank's model and :class:`ModelRunner`: the same steps on the engine's rank 0 and on every
tensor-parallel worker, so that their shards and KV caches match."""
from __future__ import annotations

import dataclasses
import logging

import psutil
import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.archs import load_hf_config
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.distributed.channel import StepChannel
from lmdeploy.pytorch.distributed.parallel_state import TPGroup, head_ranges, use_group
from lmdeploy.pytorch.engine.cuda_graph import DecodeGraphRunner
from lmdeploy.pytorch.engine.model_runner import ModelRunner, layer_windows
from lmdeploy.pytorch.paging.state_pool import recurrent_state_shapes, state_bytes_per_slot
from lmdeploy.pytorch.weights.loader import build_model
from lmdeploy.pytorch.weights.safetensors_loader import release_free_heap

logger = logging.getLogger('lmdeploy')

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto`` is bf16: on this CPU (AVX512-BF16/AMX) batched bf16 matmuls are 3-6x faster than fp32."""
    if name == 'auto':
        return torch.bfloat16
    return DTYPES[name]


def uses_decode_int4(config: PytorchEngineConfig, cfg: ModelConfig, hf_config: PretrainedConfig,
                     device: torch.device) -> bool:
    """Whether small steps run on 4-bit weights (see ``PytorchEngineConfig.decode_int4``)."""
    if device.type != 'cpu' or cfg.dtype != torch.bfloat16:
        return False
    if config.decode_int4 is None:
        return getattr(hf_config, 'gguf_weight_type', None) == 'Q4_1'
    return config.decode_int4


def graph_memory(model: nn.Module, cfg: ModelConfig, config: PytorchEngineConfig, device: torch.device) -> int:
    """What the decode graphs will keep: the activations of an eager decode step at the largest graph
    size (the graphs share one pool) plus every smaller graph's logits. The probe's block table is as wide as
    the longest session the engine may allow, since the decode attention's split partials grow with it."""
    probe = ModelRunner(model, cfg, 1, config.block_size, device)
    max_blocks = -(-(config.session_len or cfg.max_position_embeddings) // config.block_size)
    graphs = DecodeGraphRunner(model, probe.kv_caches, config.max_batch_size, max_blocks, config.block_size,
                               probe.scratch_block, make_graph=lambda: None)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        logits = graphs.forward(graphs.sizes[-1])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    smaller_logits = sum(graphs.sizes[:-1]) * logits.shape[1] * logits.element_size()
    del probe, graphs, logits
    torch.cuda.empty_cache()
    return peak + smaller_logits


def cache_budget(cfg: ModelConfig, config: PytorchEngineConfig, device: torch.device,
                 graph_model: nn.Module | None, world_size: int) -> int:
    """The bytes this rank's KV cache and recurrent-state slots may take: ``cache_max_entry_count`` of the free
    memory after what decode graphs of ``graph_model`` (when given) will take; on the CPU of the available RAM,
    capped at ``max_cache_bytes``, which ``world_size`` ranks share."""
    if device.type == 'cuda':
        reserved = graph_memory(graph_model, cfg, config, device) if graph_model is not None else 0
        free = torch.cuda.mem_get_info(device)[0] - reserved
        return int(max(free, 0) * config.cache_max_entry_count)
    available = psutil.virtual_memory().available
    return min(int(available * config.cache_max_entry_count), config.max_cache_bytes) // world_size


def fitting_state_slots(slot_bytes: int, budget: int, config: PytorchEngineConfig) -> int:
    """Recurrent-state slots for a linear-attention model: one per sequence of a full batch
    (``max_batch_size``), or as many as half of the cache ``budget`` holds, with a warning, leaving the other half
    to the KV blocks of its full-attention layers (sequences past the slots wait for one)."""
    fitting = budget // 2 // slot_bytes
    if fitting >= config.max_batch_size:
        return config.max_batch_size
    slots = max(fitting, 1)
    logger.warning('the recurrent states of max_batch_size=%d sequences take %.1f MiB, more than half of the '
                   '%.1f MiB cache budget: %d slots, so at most %d sequences run at once (raise cache_max_entry_count '
                   'or max_cache_bytes for more)', config.max_batch_size, config.max_batch_size * slot_bytes / 2**20,
                   budget / 2**20, slots, slots)
    return slots


def blocks_from_memory(cfg: ModelConfig, config: PytorchEngineConfig, budget: int, state_bytes: int = 0) -> int:
    """KV blocks that fit in a :func:`cache_budget` after the ``state_bytes`` of the recurrent-state slots; for a
    model whose layers keep no KV cache, blocks (of no memory) for ``max_batch_size`` sequences of the session's
    length."""
    block_bytes = cfg.kv_bytes_per_token() * config.block_size
    if not block_bytes:  # no layer keeps a KV cache (Mamba): the blocks only count tokens, a full batch's of them
        return config.max_batch_size * -(-(config.session_len or cfg.max_position_embeddings) // config.block_size)
    if state_bytes and budget - state_bytes < block_bytes:
        raise MemoryError(f'the recurrent-state slots take {state_bytes / 2**20:.1f} MiB of the '
                          f'{budget / 2**20:.1f} MiB cache budget, leaving no room for a KV-cache block; lower '
                          'max_batch_size, or raise cache_max_entry_count or max_cache_bytes')
    num_blocks = (budget - state_bytes) // block_bytes
    if num_blocks < 1:
        raise MemoryError('not enough memory for even one KV-cache block; lower block_size')
    return num_blocks


def window_pool_target(window: int, config: PytorchEngineConfig) -> int:
    """Blocks a sliding-window pool is given: room for each sequence of a full batch to hold the last
    ``window`` tokens while decoding, and for one prefill chunk."""
    bs = config.block_size
    return config.max_batch_size * (-(-(window - 1) // bs) + 1) + -(-config.max_prefill_token_num // bs)


def kv_pool_sizes(windows: list[int | None], num_blocks: int, config: PytorchEngineConfig,
                  layer_bytes: list[int] | None = None) -> tuple[int, int | None]:
    """The blocks of the full-attention layers' pool and of the sliding-window layers' pool (None: one pool
    serves every layer) in the memory of ``num_blocks`` blocks of every layer, for layers of sliding
    ``windows`` (None: full attention) whose blocks take ``layer_bytes`` each (None: all alike). A model with both
    kinds gives its sliding pool :func:`window_pool_target` blocks, never more than the full pool (a sequence never
    holds more blocks there), and the rest of the memory to the full pool; ``config.num_gpu_blocks`` sets the full
    pool's blocks instead."""
    sliding = [w for w in windows if w]
    if not sliding or len(sliding) == len(windows):
        return num_blocks, None
    window_blocks = window_pool_target(max(sliding), config)
    if config.num_gpu_blocks or window_blocks >= num_blocks:
        return num_blocks, min(window_blocks, num_blocks)
    layer_bytes = layer_bytes or [1] * len(windows)
    sliding_bytes = sum(size for window, size in zip(windows, layer_bytes) if window)
    full_bytes = sum(layer_bytes) - sliding_bytes
    return (num_blocks * sum(layer_bytes) - window_blocks * sliding_bytes) // full_bytes, window_blocks


def build_runner(model_dir: str, config: PytorchEngineConfig, device: torch.device, group: TPGroup,
                 show_progress: bool = True) -> tuple[PretrainedConfig, ModelConfig, ModelRunner]:
    """This rank's shard of the model and its runner, with as many KV blocks as every rank can hold;
    returns the Hugging Face config, the whole model's config and the runner."""
    hf_config = load_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf_config, resolve_dtype(config.dtype, config.device), config.quant_policy)
    with use_group(group):
        model = build_model(cfg, model_dir, device, config.load_format, show_progress)
        model.finalize_weights(device.type == 'cpu', uses_decode_int4(config, cfg, hf_config, device))
    release_free_heap()
    (q_start, q_stop), (kv_start, kv_stop) = head_ranges(cfg.num_heads, cfg.num_kv_heads, group.rank,
                                                         group.world_size)
    rank_cfg = dataclasses.replace(cfg, num_heads=q_stop - q_start, num_kv_heads=kv_stop - kv_start)
    layer_states = recurrent_state_shapes(model, cfg.num_layers)
    graph_model = (model if device.type == 'cuda' and not config.eager_mode and group.world_size == 1
                   and not any(layer_states) and model.decode_graphs else None)
    slot_bytes, num_slots, num_blocks = state_bytes_per_slot(layer_states), config.max_batch_size, config.num_gpu_blocks
    if not num_blocks:
        budget = cache_budget(rank_cfg, config, device, graph_model, group.world_size)
        if slot_bytes:
            num_slots = fitting_state_slots(slot_bytes, budget, config)
        num_blocks = group.min(blocks_from_memory(rank_cfg, config, budget, num_slots * slot_bytes),
                               timeout=group.connect_timeout)
    cache_layers = [layer for layer, states in enumerate(layer_states) if states != []]  # with a KV cache
    windows = layer_windows(model, cfg.num_layers)
    num_blocks, num_window_blocks = kv_pool_sizes([windows[layer] for layer in cache_layers], num_blocks, config,
                                                  [rank_cfg.kv_bytes_per_layer_token(layer) for layer in cache_layers])
    channel = StepChannel(group) if group.world_size > 1 else None
    return hf_config, cfg, ModelRunner(model, rank_cfg, num_blocks, config.block_size, device, channel,
                                       num_window_blocks, num_slots)
