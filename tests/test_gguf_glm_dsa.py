"""GLM-5 from GGUF: llama.cpp's converter writes ``GlmMoeDsaForCausalLM`` as ``glm-dsa`` (``DeepseekV2Model``'s
keys and tensors, ``kv_b`` split into ``k_b``/``v_b``, the experts stacked, plus the indexer's keys and tensors),
its next-token-prediction layer appended past the decoder's. An F32 file reads back into the checkpoint bit for bit
and serves tokens and first-step logits like transformers; a Q8_0 file keeps its experts as blocks where the engine
keeps ``deepseek2``'s; a file missing an indexer key is refused naming it."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

from conftest import save_random_model
from family_checks import assert_matches_transformers, hf_causal_lm
from helpers import assert_transformers_greedy, make_engine, random_prompts, run
from test_deepseek_v32 import dsa_shape
from test_gguf import _add_tokenizer, finish
from test_gguf_archs import converter_tensors
from test_gguf_glm4moe import NEXTN_TENSORS
from test_gguf_moe import expert_formats

from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.weights.file_checks import open_gguf
from lmdeploy.pytorch.weights.gguf import convert_gguf, gguf_config

INDEXER_TYPES = ['full', 'shared', 'full', 'shared']
INDEXER_KEYS = ('head_count', 'key_length', 'top_k')
# the tensors a Q8_0 file holds in Q8_0 (the routers stay F32, as llama.cpp keeps them), and in transformers' model
FILE_PROJECTIONS = ('q_a_proj.weight', 'q_b_proj.weight', 'kv_a_proj_with_mqa.weight', 'o_proj.weight', 'wq_b.weight',
                    'wk.weight', 'weights_proj.weight', 'gate_proj.weight', 'up_proj.weight', 'down_proj.weight')
HF_PROJECTIONS = FILE_PROJECTIONS + ('experts.gate_up_proj', 'experts.down_proj')


@pytest.fixture(scope='module')
def glm5_path(tmp_path_factory) -> str:
    """A tiny random GLM-5 (as ``test_glm_moe_dsa.py``'s, its low-rank query of whole Q8_0 blocks) over the GGUF
    test tokenizer's vocabulary."""
    folder = tmp_path_factory.mktemp('glm5')
    config = GlmMoeDsaConfig(**dsa_shape(num_hidden_layers=4, n_group=1, topk_group=1, rms_norm_eps=1e-5,
                                         q_lora_rank=64, rope_parameters={'rope_type': 'default', 'rope_theta': 1e4}),
                             indexer_types=INDEXER_TYPES)
    config.vocab_size = _add_tokenizer(gguf.GGUFWriter(str(folder / 'probe.gguf'), 'glm-dsa'))
    return save_random_model(config, str(folder / 'hf'), std={'e_score_correction_bias': 0.1})


@pytest.fixture
def glm5(glm5_path) -> torch.nn.Module:
    return hf_causal_lm(glm5_path)


def write_metadata(config, writer: gguf.GGUFWriter, skip: str | None = None,
                   indexer_flags: list[bool] | None = None, rope_dim: int | None = None) -> None:
    """The keys GlmMoeDsaModel writes (DeepseekV2Model's, the sigmoid router GLM-5's config names, the decoder's
    layers plus the next-token-prediction one, the indexer's but ``skip``; ``attention.indexer.types`` where
    ``indexer_flags`` are given, as current converters write it, absent as older ones)."""
    layers = config.num_hidden_layers + 1
    for add, value in [(writer.add_block_count, layers), (writer.add_context_length, config.max_position_embeddings),
                       (writer.add_embedding_length, config.hidden_size),
                       (writer.add_feed_forward_length, config.intermediate_size),
                       (writer.add_head_count, config.num_attention_heads), (writer.add_head_count_kv, 1),
                       (writer.add_layer_norm_rms_eps, config.rms_norm_eps),
                       (writer.add_rope_freq_base, config.rope_parameters['rope_theta']),
                       (writer.add_vocab_size, config.vocab_size), (writer.add_q_lora_rank, config.q_lora_rank),
                       (writer.add_kv_lora_rank, config.kv_lora_rank),
                       (writer.add_key_length, config.kv_lora_rank + config.qk_rope_head_dim),
                       (writer.add_value_length, config.kv_lora_rank),
                       (writer.add_key_length_mla, config.qk_nope_head_dim + config.qk_rope_head_dim),
                       (writer.add_value_length_mla, config.v_head_dim),
                       (writer.add_leading_dense_block_count, config.first_k_dense_replace),
                       (writer.add_expert_feed_forward_length, config.moe_intermediate_size),
                       (writer.add_expert_count, config.n_routed_experts),
                       (writer.add_expert_used_count, config.num_experts_per_tok),
                       (writer.add_expert_group_count, config.n_group),
                       (writer.add_expert_group_used_count, config.topk_group),
                       (writer.add_expert_shared_count, config.n_shared_experts),
                       (writer.add_expert_weights_scale, config.routed_scaling_factor),
                       (writer.add_expert_weights_norm, config.norm_topk_prob),
                       (writer.add_expert_gating_func, gguf.ExpertGatingFuncType.SIGMOID),
                       (writer.add_rope_dimension_count, rope_dim or config.qk_rope_head_dim),
                       (writer.add_nextn_predict_layers, 1)]:
        add(value)
    indexer = {'head_count': (writer.add_indexer_head_count, config.index_n_heads),
               'key_length': (writer.add_indexer_key_length, config.index_head_dim),
               'top_k': (writer.add_indexer_top_k, config.index_topk)}
    for key, (add, value) in indexer.items():
        if key != skip:
            add(value)
    if indexer_flags is not None:
        writer.add_array('glm-dsa.attention.indexer.types', indexer_flags)


def write_glm5_gguf(hf: torch.nn.Module, path: Path, quantized: tuple[str, ...] = (), **metadata) -> None:
    """``hf`` as GlmMoeDsaModel writes it, with one next-token-prediction layer (a copy of the last layer plus its
    ``nextn.*`` tensors); the tensors named by a suffix in ``quantized`` in Q8_0; ``metadata``: see
    :func:`write_metadata`."""
    config, layers = hf.config, hf.config.num_hidden_layers
    writer = gguf.GGUFWriter(str(path), 'glm-dsa')
    _add_tokenizer(writer)
    write_metadata(config, writer, **metadata)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, layers + 1)
    tensors = converter_tensors(hf, 'deepseek_v3', {})
    tensors.update({name.replace(f'layers.{layers - 1}.', f'layers.{layers}.'): data.copy()
                    for name, data in tensors.items() if name.startswith(f'model.layers.{layers - 1}.')})
    rng = np.random.default_rng(0)
    tensors.update({f'model.layers.{layers}.{name}': rng.standard_normal(
        (config.hidden_size, 2 * config.hidden_size) if name == 'eh_proj.weight' else (config.hidden_size,),
        dtype=np.float32) for name in NEXTN_TENSORS})
    for name, data in tensors.items():
        data = np.ascontiguousarray(data)
        q8 = name.endswith(quantized)
        writer.add_tensor(names.get_name(name, try_suffixes=('.weight', '.bias')),
                          quantize(data, Q.Q8_0) if q8 else data, raw_dtype=Q.Q8_0 if q8 else None)
    finish(writer)


def test_f32_file_reads_back_the_checkpoint_and_serves_like_transformers(glm5, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    src = tmp_path / 'glm5.gguf'
    write_glm5_gguf(glm5, src, indexer_flags=[kind == 'full' for kind in INDEXER_TYPES])
    convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())
    converted = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'converted'), dtype=torch.float32)
    for field in ('architectures', 'model_type', 'num_hidden_layers', 'indexer_types', 'index_n_heads',
                  'index_head_dim', 'index_topk', 'q_lora_rank', 'kv_lora_rank', 'qk_rope_head_dim',
                  'qk_nope_head_dim', 'v_head_dim', 'mlp_layer_types', 'n_routed_experts', 'num_experts_per_tok',
                  'norm_topk_prob', 'rope_parameters', 'tie_word_embeddings'):
        assert getattr(converted.config, field) == getattr(glm5.config, field), field
    expected = glm5.state_dict()
    state = converted.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    assert_matches_transformers(str(src), glm5, random_prompts([5, 17, 40], vocab=glm5.config.vocab_size),
                                random_prompts([7, 31], vocab=glm5.config.vocab_size))


def test_q8_0_experts_kept_as_blocks_as_deepseek2s(glm5, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q8_0 file (every projection with whole blocks in Q8_0, the routers F32 as llama.cpp keeps them) is served
    as ``deepseek2``'s: the routed experts as their blocks, one tensor per expert; MLA's, the indexer's, the shared
    experts' and the dense layer's projections dequantized; tokens like transformers on the weights the file holds."""
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'cache'))
    hf = glm5
    with torch.no_grad():  # the weights as the Q8_0 blocks hold them (quantizing them again gives the same blocks)
        for name, param in hf.named_parameters():
            if name.endswith(HF_PROJECTIONS):
                param.copy_(torch.from_numpy(dequantize(quantize(param.numpy(), Q.Q8_0), Q.Q8_0)))
    src = tmp_path / 'glm5-q8_0.gguf'
    write_glm5_gguf(hf, src, quantized=FILE_PROJECTIONS)
    engine = make_engine(str(src))
    try:
        sparse = range(hf.config.first_k_dense_replace, hf.config.num_hidden_layers)
        assert expert_formats(engine) == {i: {'gate_up': 'Q8_0', 'down': 'Q8_0'} for i in sparse}
        quantization = engine.model_config.hf_config.quantization_config
        assert quantization['ggml_types'] and all('.mlp.experts.' in name for name in quantization['ggml_types'])
        prompts = random_prompts([5, 23], vocab=hf.config.vocab_size)
        assert_transformers_greedy(hf, prompts, run(engine, prompts))
    finally:
        engine.close()


@pytest.mark.parametrize('key', INDEXER_KEYS)
def test_a_file_missing_an_indexer_key_is_refused_naming_it(glm5, key: str, tmp_path: Path) -> None:
    src = tmp_path / 'glm5.gguf'
    write_glm5_gguf(glm5, src, skip=key)
    with pytest.raises(ConfigError, match=f'missing GGUF metadata: attention.indexer.{key}'):
        convert_gguf(str(src), str(tmp_path / 'converted'), raw_types=())


@pytest.mark.parametrize('flags', [None, [kind == 'full' for kind in INDEXER_TYPES]], ids=['tensors', 'key'])
def test_shared_layers_from_the_key_or_the_tensors(glm5, flags: list[bool] | None, tmp_path: Path) -> None:
    """Older converters write no ``attention.indexer.types``: a layer without indexer tensors is ``shared``."""
    src = tmp_path / 'glm5.gguf'
    write_glm5_gguf(glm5, src, indexer_flags=flags)
    assert gguf_config(open_gguf(src), str(src))['indexer_types'] == INDEXER_TYPES


@pytest.mark.parametrize('flags, error', [([True] * 4, 'marks layer 1 full, but the file has no blk.1.indexer'),
                                          ([True, False, True], 'has 3 flags, not one for each of the 4 decoder')])
def test_indexer_types_that_disagree_with_the_file_are_refused(glm5, flags: list[bool], error: str,
                                                               tmp_path: Path) -> None:
    src = tmp_path / 'glm5.gguf'
    write_glm5_gguf(glm5, src, indexer_flags=flags)
    with pytest.raises(ConfigError, match=error):
        gguf_config(open_gguf(src), str(src))


def test_a_partial_rotary_is_refused(glm5, tmp_path: Path) -> None:
    """The converter writes ``qk_rope_head_dim * partial_rotary_factor`` as the rotary's width."""
    src = tmp_path / 'glm5.gguf'
    write_glm5_gguf(glm5, src, rope_dim=glm5.config.qk_rope_head_dim // 2)
    with pytest.raises(ConfigError, match='partial rotary'):
        gguf_config(open_gguf(src), str(src))
