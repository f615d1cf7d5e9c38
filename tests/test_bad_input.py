"""Bad input gets a clear exception and leaves the engine usable."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from helpers import make_engine, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


def copy_model(src: str, dst) -> str:
    return shutil.copytree(src, str(dst))


def test_unknown_architecture_names_supported(tiny_llama, tmp_path):
    path = copy_model(tiny_llama, tmp_path / 'm')
    config_path = os.path.join(path, 'config.json')
    with open(config_path) as f:
        config = json.load(f)
    config['architectures'] = ['GPTNeoXForCausalLM']
    config['model_type'] = 'gpt_neox'
    with open(config_path, 'w') as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match='GPTNeoXForCausalLM.*LlamaForCausalLM'):
        make_engine(path)


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match='does not exist'):
        Engine('/no/such/model', PytorchEngineConfig(dtype='float32'))


def test_missing_weight_file(tiny_llama, tmp_path):
    path = copy_model(tiny_llama, tmp_path / 'm')
    os.remove(os.path.join(path, 'model.safetensors'))
    with pytest.raises(FileNotFoundError, match='safetensors'):
        make_engine(path)


def test_corrupt_weight_file(tiny_llama, tmp_path):
    path = copy_model(tiny_llama, tmp_path / 'm')
    weights = os.path.join(path, 'model.safetensors')
    with open(weights, 'r+b') as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ValueError, match='model.safetensors'):
        make_engine(path)


@pytest.fixture(scope='module')
def engine(tiny_llama):
    return make_engine(tiny_llama, session_len=256)


def test_prompt_longer_than_session_len(engine):
    with pytest.raises(ValueError, match='session_len is 256'):
        engine.add_request(list(range(3, 303)))
    assert len(run(engine, [[5, 6, 7]])[0]) == 32


def test_empty_prompt(engine):
    with pytest.raises(ValueError, match='empty'):
        engine.add_request([])
    with pytest.raises(ValueError, match='token ids must be in'):
        engine.add_request([10**9])
    assert not engine.has_unfinished()


@pytest.mark.parametrize('kwargs, match', [
    ({'max_new_tokens': -1}, 'max_new_tokens'),
    ({'max_new_tokens': 10**12}, 'max_new_tokens'),
    ({'top_p': 0.0}, 'top_p'),
    ({'top_p': 1.5}, 'top_p'),
    ({'temperature': -0.5}, 'temperature'),
    ({'temperature': 1e6}, 'temperature'),
    ({'top_k': -3}, 'top_k'),
    ({'min_p': 2.0}, 'min_p'),
    ({'repetition_penalty': 0.0}, 'repetition_penalty'),
    ({'logprobs': 100}, 'logprobs'),
    # wrong types: a bool where an int goes (True is an int to Python), a str where a bool goes, None, a bare id
    ({'logprobs': True}, 'logprobs'),
    ({'max_new_tokens': True}, 'max_new_tokens'),
    ({'ignore_eos': 'no'}, 'ignore_eos'),
    ({'skip_special_tokens': None}, 'skip_special_tokens'),
    ({'top_p': None}, 'top_p'),
    ({'presence_penalty': '1'}, 'presence_penalty'),
    ({'stop_token_ids': 5}, 'stop_token_ids'),
    ({'logit_bias': {'-5': 1.0}}, 'logit_bias'),
    ({'logit_bias': {5: float('nan')}}, 'logit_bias'),
    ({'logit_bias': [5]}, 'logit_bias'),
])
def test_bad_generation_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)


def test_generation_stops_at_session_len(engine):
    out = run(engine, [list(range(3, 243))], GenerationConfig(max_new_tokens=100, ignore_eos=True))[0]
    assert len(out) == 256 - 240


@pytest.mark.parametrize('kwargs, match', [
    ({'session_len': 0}, 'session_len'),
    ({'session_len': '4096'}, 'session_len must be an int'),
    ({'max_batch_size': True}, 'max_batch_size must be an int'),
    ({'block_size': 24}, 'power of two'),
    ({'cache_max_entry_count': True}, 'cache_max_entry_count'),
    ({'num_threads': -2}, 'num_threads must be >= 0'),
    ({'enable_prefix_caching': 'no'}, 'enable_prefix_caching must be True or False'),
    ({'eager_mode': None}, 'eager_mode must be True or False'),
])
def test_bad_engine_config(kwargs, match):
    """Out of range, or of the wrong type: ``'no'`` turned prefix caching on, ``True`` was a batch of one, a
    negative thread count failed the engine's start."""
    with pytest.raises(ValueError, match=match):
        PytorchEngineConfig(**kwargs)


def test_numpy_scalars_pass_as_the_python_values_they_hold():
    """Values taken from numpy arrays (a sweep's ``np.arange``, a tokenizer's id array) are numpy scalars, which
    are not ``int``/``bool`` instances: they were refused as of the wrong type."""
    config = GenerationConfig(max_new_tokens=np.int64(8), do_sample=np.bool_(True), temperature=np.float32(0.5),
                              stop_token_ids=list(np.array([2, 7])), logit_bias={np.int64(5): np.float64(1.5)})
    assert (config.max_new_tokens, config.do_sample, config.stop_token_ids, config.logit_bias) == (
        8, True, [2, 7], {5: 1.5})
    assert type(config.max_new_tokens) is int and type(config.do_sample) is bool
    engine = PytorchEngineConfig(max_batch_size=np.int32(4), enable_prefix_caching=np.bool_(False), num_threads=0)
    assert (engine.max_batch_size, engine.enable_prefix_caching, engine.num_threads) == (4, False, 0)
    with pytest.raises(ValueError, match='do_sample must be True or False'):
        GenerationConfig(do_sample=np.int64(1))


def test_logit_bias_keys_may_be_decimal_strings_as_in_json():
    assert GenerationConfig(logit_bias={'42': 1.0, 7: -2.0}).logit_bias == {42: 1.0, 7: -2.0}
