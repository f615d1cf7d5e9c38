"""Model settings the engine needs, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


@dataclass
class ModelConfig:
    """The shape of a decoder-only model, independent of its family.

    ``hf_config`` is the language model's config; for a vision-language model ``mm_config`` is the
    whole config (vision tower, image token id), else None.
    """

    hf_config: PretrainedConfig
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    dtype: torch.dtype
    tie_word_embeddings: bool = False
    mm_config: PretrainedConfig | None = None

    @classmethod
    def from_hf(cls, config: PretrainedConfig, dtype: torch.dtype) -> ModelConfig:
        hf_config = config.get_text_config()
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, 'head_dim', None) or hf_config.hidden_size // num_heads
        return cls(hf_config=hf_config,
                   architecture=config.architectures[0],
                   hidden_size=hf_config.hidden_size,
                   num_layers=hf_config.num_hidden_layers,
                   num_heads=num_heads,
                   num_kv_heads=getattr(hf_config, 'num_key_value_heads', None) or num_heads,
                   head_dim=head_dim,
                   vocab_size=hf_config.vocab_size,
                   max_position_embeddings=getattr(hf_config, 'max_position_embeddings', 4096),
                   dtype=dtype,
                   tie_word_embeddings=bool(getattr(config, 'tie_word_embeddings', False)),
                   mm_config=None if hf_config is config else config)

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem
