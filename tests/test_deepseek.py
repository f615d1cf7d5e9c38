"""DeepSeek-V3 against transformers on tiny random models saved by transformers: greedy tokens and first-step
logits in fp32, batching, chunked prefill and prefix-cache hits, the latent KV cache's size, grouped top-k
routing, and FP8 block-scaled checkpoints dequantized at load."""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_batched_chunked_and_cached_equal_solo, assert_first_logits_close,
                           assert_matches_transformers, assert_tp2_equals_tp1, hf_causal_lm, hf_last_logits,
                           prefix_sharing_prompts)
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_gguf_linear import dequantized_weight

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import group_limited_topk, grouped_topk, moe_routing
from lmdeploy.pytorch.nn.quant import weight_format_for
from lmdeploy.pytorch.nn.quant.fp8 import dequantize_fp8

KV_LORA_RANK, ROPE_DIM = 32, 8
YARN = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0, 'original_max_position_embeddings': 64,
        'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0}
# name -> (model type, q_lora_rank); V2 routes by group-limited softmax top-k and turns complex rotary pairs
VARIANTS = {'v3_q_lora': ('v3', 48), 'v3_no_q_lora': ('v3', None), 'v2_group_limited': ('v2', 48)}
FP8_BLOCK = [16, 16]  # several blocks per tiny weight, ragged at the edges of the 40-row kv_a projection


def ds_config(q_lora_rank: int | None, kind: str = 'v3') -> DeepseekV3Config | DeepseekV2Config:
    shape = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                 num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=KV_LORA_RANK, q_lora_rank=q_lora_rank,
                 qk_rope_head_dim=ROPE_DIM, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1,
                 vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=None,
                 rope_parameters=YARN)
    if kind == 'v2':
        return DeepseekV2Config(**shape, topk_method='group_limited_greedy', routed_scaling_factor=2.0)
    return DeepseekV3Config(**shape)


def save_deepseek(path: str, q_lora_rank: int | None = 48, kind: str = 'v3') -> str:
    """A tiny random DeepSeek-V3 (or V2) saved with transformers; V3's routers' correction biases are random
    too."""
    return save_random_model(ds_config(q_lora_rank, kind), path, std={'e_score_correction_bias': 0.1})


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def deepseek(request, tmp_path_factory) -> str:
    kind, q_lora_rank = VARIANTS[request.param]
    return save_deepseek(str(tmp_path_factory.mktemp(request.param)), q_lora_rank, kind)


def test_greedy_and_first_logits_match_transformers(deepseek):
    # 90 + 32 tokens pass YaRN's original 64 positions
    assert_matches_transformers(deepseek, hf_causal_lm(deepseek), random_prompts([3, 17, 52, 90]),
                                random_prompts([7, 31, 60]))


def test_bf16_first_logits_near_transformers(deepseek):
    """bf16 on the CPU: packed projections (``kv_b_proj`` left dense) and the native latent-attention kernels
    where they build; the logits stay within bf16's error of transformers in fp32."""
    hf_model = hf_causal_lm(deepseek)
    engine = Engine(deepseek, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    prompts = random_prompts([7, 31, 60], seed=2)
    assert_first_logits_close(engine, prompts, [hf_last_logits(hf_model, p) for p in prompts], tol=0.05,
                              relative=True)


def test_bf16_small_step_copies_decode(deepseek):
    """``decode_int4`` in bf16 (the default for a Q4_1 GGUF file): the projections' 4-bit copies and the LM
    head's small-step copy serve batch-1 decode, 32 tokens for each prompt."""
    engine = Engine(deepseek, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16,
                                                  decode_int4=True), show_progress=False)
    lm_head = engine.runner.model.lm_head
    assert lm_head.q8 is not None or lm_head.fp16 is not None
    assert [len(tokens) for tokens in run(engine, random_prompts([7, 20], seed=3))] == [32, 32]


def test_batched_chunked_and_cached_equal_solo(deepseek):
    assert_batched_chunked_and_cached_equal_solo(deepseek, prefix_sharing_prompts())


def test_tp2_splits_heads_and_experts(tmp_path):
    """Each rank computes its own heads over the whole latent cache and its share of every expert."""
    assert_tp2_equals_tp1(save_deepseek(str(tmp_path / 'v3')), random_prompts([5, 40], seed=8))


def test_cache_holds_the_latent_per_token(deepseek, caplog):
    """Each layer caches ``kv_lora_rank + qk_rope_head_dim`` values per token, not per-head K/V, and the
    engine reports the bytes per token at start-up."""
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(deepseek, num_gpu_blocks=10, block_size=16)
    per_layer = (KV_LORA_RANK + ROPE_DIM) * 4  # fp32
    caches = engine.runner.kv_caches
    assert len(caches) == 3
    for layer_cache in caches:
        assert [tuple(t.shape) for t in layer_cache] == [(11, 16, KV_LORA_RANK + ROPE_DIM)]  # + the scratch block
        assert sum(t.numel() * t.element_size() for t in layer_cache) == 11 * 16 * per_layer
    assert engine.runner.cfg.kv_bytes_per_token() == 3 * per_layer
    assert f'{3 * per_layer} bytes per token' in caplog.text and 'latent (MLA)' in caplog.text


def test_grouped_topk_matches_transformers_router():
    config = ds_config(48)
    config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok = 16, 4, 2, 3
    for renormalize in (True, False):
        config.norm_topk_prob = renormalize
        router = DeepseekV3TopkRouter(config)
        torch.manual_seed(1)
        with torch.no_grad():
            router.weight.normal_(0, 1)
            router.e_score_correction_bias.normal_(0, 0.5)
        x = torch.randn(50, config.hidden_size)
        logits, ref_weights, ref_ids = router(x)
        weights, ids = grouped_topk(logits, router.e_score_correction_bias, 3, 4, 2, renormalize,
                                    config.routed_scaling_factor)
        ref_order, order = ref_ids.argsort(-1), ids.argsort(-1)
        assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
        torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


@pytest.mark.parametrize('method', ['greedy', 'group_limited_greedy'])
def test_v2_routing_matches_transformers_router(method):
    config = ds_config(48, 'v2')
    config.n_routed_experts, config.n_group, config.topk_group, config.num_experts_per_tok = 16, 4, 2, 3
    config.topk_method = method
    router = DeepseekV2TopkRouter(config)
    torch.manual_seed(2)
    with torch.no_grad():
        router.weight.normal_(0, 1)
    logits, ref_weights, ref_ids = router(torch.randn(50, config.hidden_size))
    if method == 'greedy':
        weights, ids = moe_routing(logits, 3, False)
    else:
        weights, ids = group_limited_topk(logits, 3, 4, 2)
    ref_order, order = ref_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order) * config.routed_scaling_factor,
                               ref_weights.gather(1, ref_order))


def quantize_blockwise(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` as fp8 codes and per-block ``scale_inv`` (each block's max maps to fp8's max)."""
    rows, cols = weight.shape
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scales[i, j] = part.abs().max() / torch.finfo(torch.float8_e4m3fn).max
            codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (
                part / scales[i, j]).to(torch.float8_e4m3fn)
    return codes, scales


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, block: list[int]) -> torch.Tensor:
    out = codes.float()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scales[i, j]
    return out


def save_fp8_and_dense(source: str, out: Path, quantized: Callable[[str], bool]) -> tuple[Path, Path, dict]:
    """``source`` (one ``model.safetensors``) copied twice under ``out``: ``fp8``, the tensors ``quantized`` names in
    fp8 with block scales (its config saying so), and ``dense``, those dequantized here; also ``fp8``'s tensors."""
    fp8, dense = {}, {}
    for name, tensor in load_file(os.path.join(source, 'model.safetensors')).items():
        if quantized(name):
            codes, scales = quantize_blockwise(tensor, FP8_BLOCK)
            fp8[name], fp8[f'{name}_scale_inv'] = codes, scales
            dense[name] = dequantize_blockwise(codes, scales, FP8_BLOCK)
        else:
            fp8[name] = dense[name] = tensor
    folders = [shutil.copytree(source, out / kind) for kind in ('fp8', 'dense')]
    for folder, weights in zip(folders, (fp8, dense)):
        save_file(weights, str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    config = json.loads((folders[0] / 'config.json').read_text())
    config['quantization_config'] = {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
                                     'weight_block_size': FP8_BLOCK}
    (folders[0] / 'config.json').write_text(json.dumps(config))
    return folders[0], folders[1], fp8


def test_fp8_block_scaled_checkpoint_is_dequantized_at_load(tmp_path):
    """Every decoder projection and expert quantized to fp8 with block scales, the scales in a shard of their
    own (read after their weights); the engine equals transformers on the same weights dequantized
    independently here."""
    source = save_deepseek(str(tmp_path / 'source'))
    tensors = load_file(os.path.join(source, 'model.safetensors'))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if name.startswith('model.layers.') and name.endswith(('proj.weight', 'proj_with_mqa.weight')):
            codes, scales = quantize_blockwise(tensor, FP8_BLOCK)
            quantized[name], quantized[f'{name}_scale_inv'] = codes, scales
            dequantized[name] = dequantize_blockwise(codes, scales, FP8_BLOCK)
            torch.testing.assert_close(dequantize_fp8(codes, scales, tuple(FP8_BLOCK)), dequantized[name],
                                       rtol=0, atol=0)
        else:
            quantized[name] = dequantized[name] = tensor
    assert len(quantized) > len(tensors) + 40
    # V3's multi-token-prediction layer follows the last one; the engine does not use it
    extra = {'model.layers.3.mlp.experts.0.gate_proj.weight': torch.randn(32, 64),
             'model.layers.3.eh_proj.weight': torch.randn(64, 128)}
    for name, tensor in extra.items():
        quantized[name], quantized[f'{name}_scale_inv'] = quantize_blockwise(tensor, FP8_BLOCK)
    quantized['model.layers.3.enorm.weight'] = torch.ones(64)
    fp8_dir, dense_dir = tmp_path / 'fp8', tmp_path / 'dense'
    for folder, weights in ((fp8_dir, quantized), (dense_dir, dequantized)):
        os.makedirs(folder)
        for file in os.listdir(source):
            if file != 'model.safetensors':
                with open(os.path.join(source, file), 'rb') as src, open(folder / file, 'wb') as dst:
                    dst.write(src.read())
        scales = {name: t for name, t in weights.items() if name.endswith('_scale_inv')}
        files = {'model.safetensors': weights} if not scales else {
            'model-00001-of-00002.safetensors': {name: t for name, t in weights.items() if name not in scales},
            'model-00002-of-00002.safetensors': scales}
        for file, part in files.items():
            save_file(part, str(folder / file), metadata={'format': 'pt'})
    config = json.loads((fp8_dir / 'config.json').read_text())
    config['quantization_config'] = {'quant_method': 'fp8', 'fmt': 'e4m3', 'activation_scheme': 'dynamic',
                                     'weight_block_size': FP8_BLOCK}
    (fp8_dir / 'config.json').write_text(json.dumps(config))

    engine = make_engine(str(fp8_dir))
    experts = engine.runner.model.layers[1].mlp.experts
    # fp32 experts are packed for the fixed-order fp32 GEMM where it is built, else kept stacked
    down = dequantized_weight(experts.kernel.kernel('down', 3)) if experts.down is None else experts.down[3]
    assert torch.equal(down, dequantized['model.layers.1.mlp.experts.3.down_proj.weight'])
    hf_model = hf_causal_lm(str(dense_dir))
    prompts = random_prompts([5, 40], seed=11)
    assert_transformers_greedy(hf_model, prompts, run(engine, prompts))


def test_fp8_scales_pair_with_their_weights_in_any_order():
    fp8 = weight_format_for({'quant_method': 'fp8', 'fmt': 'e4m3', 'weight_block_size': FP8_BLOCK})
    weight, norm = torch.randn(40, 24), torch.randn(24)
    codes, scales = quantize_blockwise(weight, FP8_BLOCK)
    out = dict(fp8.convert_checkpoint(iter([('a.weight_scale_inv', scales), ('n.weight', norm), ('a.weight', codes)])))
    assert out['n.weight'] is norm and torch.equal(out['a.weight'], dequantize_blockwise(codes, scales, FP8_BLOCK))
    with pytest.raises(ValueError, match='without scales'):
        list(fp8.convert_checkpoint(iter([('a.weight', codes)])))
    with pytest.raises(ValueError, match='weight_block_size'):
        weight_format_for({'quant_method': 'fp8'})
