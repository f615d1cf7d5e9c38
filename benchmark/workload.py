"""The offline workloads the benchmarks share, and configurations of real models' exact shapes (saved with a
word-level tokenizer, with or without random weights). Needs only torch, tokenizers and transformers, so a
peer's own environment can import it."""
from __future__ import annotations

import math

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

Workload = list[tuple[list[int], int]]

# Log-normal fits to ShareGPT's token counts (Llama tokenizer): medians and sigmas of input and output.
SHAREGPT_INPUT = (250, 1.0)
SHAREGPT_OUTPUT = (200, 0.9)


def default_shaped_config() -> LlamaConfig:
    """SmolLM2-135M's configuration (the default model's)."""
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_parameters={'rope_type': 'default', 'rope_theta': 100000.0}, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2)


def llama3_8b_config(tiny: bool = False, layers: int | None = None) -> LlamaConfig:
    """Llama-3-8B's shape (``tiny``: a few-layer miniature of it, for CPU tests), with its first ``layers`` layers
    only where given."""
    shape = dict(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512) if tiny else dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256)
    if layers:
        shape['num_hidden_layers'] = layers
    return LlamaConfig(**shape, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={'rope_type': 'default', 'rope_theta': 500000.0}, bos_token_id=1,
                       eos_token_id=2)


def qwen3_30b_a3b_config(tiny: bool = False, layers: int | None = None) -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's shape (``tiny``: a few-layer miniature of it, for CPU tests), with its first ``layers``
    layers only where given."""
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                 vocab_size=512) if tiny else dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144,
        vocab_size=151936)
    if layers:
        shape['num_hidden_layers'] = layers
    return Qwen3MoeConfig(**shape, norm_topk_prob=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_parameters={'rope_type': 'default', 'rope_theta': 1000000.0},
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def save_word_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` words ``<i>`` (bos ``<1>``, eos ``<2>``)."""
    words = Tokenizer(models.WordLevel({f'<{i}>': i for i in range(vocab_size)}, unk_token='<0>'))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token='<1>', eos_token='<2>').save_pretrained(folder)


def save_shaped_config(folder: str, config: PretrainedConfig) -> str:
    """``config.json`` and a word-level tokenizer, without weights: for ``load_format='dummy'``."""
    config.architectures = [type(config).__name__.replace('Config', 'ForCausalLM')]
    config.save_pretrained(folder)
    save_word_tokenizer(folder, config.vocab_size)
    return folder


def save_default_shaped_model(folder: str) -> str:
    """A random-weight LlamaForCausalLM with SmolLM2-135M's configuration and a word-level tokenizer of its
    vocabulary size, saved into ``folder``."""
    config = default_shaped_config()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    save_word_tokenizer(folder, config.vocab_size)
    return folder


def make_workload(num_prompts: int, vocab_size: int, seed: int = 0) -> Workload:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 257, (num_prompts, 2), generator=g).tolist()
    return [(torch.randint(0, vocab_size, (n_in,), generator=g).tolist(), n_out) for n_in, n_out in lengths]


def sharegpt_like_workload(num_prompts: int, vocab_size: int, seed: int = 0, input_clip: tuple[int, int] = (4, 2048),
                           output_clip: tuple[int, int] = (4, 1024)) -> Workload:
    """Prompts of random token ids whose input and output lengths follow log-normal fits to ShareGPT
    (medians 250 and 200 tokens), clipped to ``input_clip`` and ``output_clip``; each pair is
    (prompt ids, output length to generate with ``ignore_eos``)."""
    g = torch.Generator().manual_seed(seed)

    def lengths(median_sigma: tuple[int, float], clip: tuple[int, int]) -> list[int]:
        median, sigma = median_sigma
        drawn = torch.empty(num_prompts, dtype=torch.float64).log_normal_(math.log(median), sigma, generator=g)
        return drawn.round().clamp(*clip).long().tolist()

    inputs, outputs = lengths(SHAREGPT_INPUT, input_clip), lengths(SHAREGPT_OUTPUT, output_clip)
    return [(torch.randint(0, vocab_size, (n_in,), generator=g).tolist(), n_out)
            for n_in, n_out in zip(inputs, outputs)]
