"""The offline workload that ``throughput.py`` and ``vllm_throughput.py`` share, and a random-weight
model of the default model's exact shape. Needs only torch, tokenizers and transformers, so a peer's
own environment can import it."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast


def save_default_shaped_model(folder: str) -> str:
    """A random-weight LlamaForCausalLM with SmolLM2-135M's configuration and a word-level tokenizer of its
    vocabulary size, saved into ``folder``."""
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters={'rope_type': 'default', 'rope_theta': 100000.0}, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f'<{i}>': i for i in range(config.vocab_size)}, unk_token='<0>'))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token='<1>', eos_token='<2>').save_pretrained(folder)
    return folder


def make_workload(num_prompts: int, vocab_size: int, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (num_prompts, 2), generator=g).tolist()
    return [(torch.randint(0, vocab_size, (n_in,), generator=g).tolist(), n_out) for n_in, n_out in lengths]
