"""Model settings the engine needs, read from a Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

# ``layer_types`` of layers with a recurrent state instead of a KV cache: Gated DeltaNet (Qwen3-Next, Qwen3.5),
# Mamba-2 (Granite 4.0-H; transformers 5 reads its checkpoints' 'mamba' as 'linear_attention') and LFM2's short
# convolutions
RECURRENT_LAYER_TYPES = ('linear_attention', 'mamba', 'conv')
# ``layer_types`` of layers with neither: Nemotron-H's MLP and MoE blocks
CACHELESS_LAYER_TYPES = ('mlp', 'moe')
# model type -> how many times ``num_key_value_heads`` its sliding-window layers have (MiMo-V2-Flash's double them);
# every layer's cache holds that many, a full layer's KV heads each repeated to fill it
SLIDING_KV_HEADS_FACTOR = {'mimo_v2_flash': 2}


def index_key_dim(hf_config: PretrainedConfig) -> int:
    """The width of the indexer key each token caches: DeepSeek Sparse Attention's ``index_head_dim`` (with
    ``index_topk``), Qwen4-Exp QSA's ``indexer_head_dim`` (with ``indexer_budget``); 0 without an indexer."""
    if getattr(hf_config, 'index_topk', None):
        return hf_config.index_head_dim
    if getattr(hf_config, 'indexer_budget', None):
        return hf_config.indexer_head_dim
    return 0


def layer_kv_geometry(hf_config: PretrainedConfig) -> tuple[tuple[int, int], ...] | None:
    """Per layer ``(num_kv_heads, head_dim)`` of a config whose layers override them (transformers'
    ``per_layer_config``: Gemma 4's full-attention layers); None where every layer has the config's own."""
    if not getattr(hf_config, 'is_heterogeneous', False):
        return None
    # the config's own values are the default layer's (Gemma 4's sliding layers); read them as the model's
    hf_config.allow_global_per_layer_attribute_access = True
    geometry = tuple((layer.num_key_value_heads, layer.head_dim) for layer in hf_config.per_layer_config)
    return geometry if len(set(geometry)) > 1 else None


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
    quant_policy: int = 0  # KV cache: 0 in ``dtype``, 8 int8, 4 int4 (see PytorchEngineConfig)
    # Multi-head latent attention (DeepSeek-V2/V3): each token caches one vector of this width, its latent
    # (``kv_lora_rank``) then its rotary key (``qk_rope_head_dim``), shared by every head; DeepSeek-V4: its row of
    # key-value, compressor inputs and compressed entries (``kernels/compressed_attention.py``); 0: per-head K/V.
    kv_latent_dim: int = 0
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) and Qwen4-Exp's QSA: each token also caches its indexer key
    # of this width, in ``dtype`` whatever ``quant_policy`` (``kernels/dsa.py``, ``kernels/qsa.py``); 0: no indexer
    index_key_dim: int = 0
    # layers with a recurrent state instead of a KV cache (see RECURRENT_LAYER_TYPES)
    num_state_layers: int = 0
    # layers with neither a KV cache nor a recurrent state (see CACHELESS_LAYER_TYPES)
    num_cacheless_layers: int = 0
    # layers that attend over an earlier layer's KV cache and hold none (Gemma 3n's ``num_kv_shared_layers``)
    num_kv_shared_layers: int = 0
    # per layer ``(num_kv_heads, head_dim)`` where the layers' caches differ (Gemma 4's full-attention layers: wider
    # heads, fewer of them); None: every layer's is ``(num_kv_heads, head_dim)``
    layer_kv_geometry: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def from_hf(cls, config: PretrainedConfig, dtype: torch.dtype, quant_policy: int = 0) -> ModelConfig:
        hf_config = config.get_text_config()
        geometry = layer_kv_geometry(hf_config)
        # a model without attention (Mamba, Falcon Mamba) counts one nominal head: none of its layers has a KV cache
        num_heads = getattr(hf_config, 'num_attention_heads', None) or 1
        layer_types = getattr(hf_config, 'layer_types', None) or []
        head_dim = getattr(hf_config, 'head_dim', None) or hf_config.hidden_size // num_heads
        kv_lora_rank = getattr(hf_config, 'kv_lora_rank', None)
        kv_latent_dim = kv_lora_rank + hf_config.qk_rope_head_dim if kv_lora_rank else 0
        num_kv_heads = getattr(hf_config, 'num_key_value_heads', None) or num_heads
        if 'sliding_attention' in layer_types:
            num_kv_heads *= SLIDING_KV_HEADS_FACTOR.get(hf_config.model_type, 1)
        index_keys = index_key_dim(hf_config)
        if hf_config.model_type == 'deepseek_v4':  # one row a token: models/deepseek_v4_attention.py
            from lmdeploy.pytorch.models.deepseek_v4_attention import cache_row_width
            kv_latent_dim, index_keys = cache_row_width(hf_config), 0
        return cls(hf_config=hf_config,
                   architecture=config.architectures[0],
                   hidden_size=hf_config.hidden_size,
                   num_layers=hf_config.num_hidden_layers,
                   num_heads=num_heads,
                   num_kv_heads=num_kv_heads,
                   head_dim=head_dim,
                   vocab_size=hf_config.vocab_size,
                   max_position_embeddings=getattr(hf_config, 'max_position_embeddings', 4096),
                   dtype=dtype,
                   tie_word_embeddings=bool(getattr(config, 'tie_word_embeddings', False)),
                   mm_config=None if hf_config is config else config,
                   quant_policy=quant_policy,
                   kv_latent_dim=kv_latent_dim,
                   index_key_dim=index_keys,
                   num_state_layers=sum(kind in RECURRENT_LAYER_TYPES for kind in layer_types),
                   num_cacheless_layers=sum(kind in CACHELESS_LAYER_TYPES for kind in layer_types),
                   num_kv_shared_layers=getattr(hf_config, 'num_kv_shared_layers', 0) or 0,
                   layer_kv_geometry=geometry)

    def kv_cache_shapes(self, num_blocks: int, block_size: int,
                        layer: int | None = None) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each tensor of one layer's cache (of ``layer``'s own geometry where the layers'
        differ, see ``layer_kv_geometry``): K and V, then with ``quant_policy`` their
        scales and zero points (``kernels/kv_quant.py`` describes the layout); with ``kv_latent_dim`` one
        tensor ``[num_blocks, block_size, kv_latent_dim]``, or with ``quant_policy`` its codes and the scales
        and zero points of its two parts (``kernels/mla.py``); with ``index_key_dim`` then one more tensor
        ``[num_blocks, block_size, index_key_dim]`` of the indexer's keys (``kernels/dsa.py``, ``kernels/qsa.py``)."""
        index_keys = [((num_blocks, block_size, self.index_key_dim), self.dtype)] if self.index_key_dim else []
        if self.kv_latent_dim:
            if not self.quant_policy:
                return [((num_blocks, block_size, self.kv_latent_dim), self.dtype)] + index_keys
            return [((num_blocks, block_size, self.kv_latent_dim * self.quant_policy // 8), torch.uint8),
                    ((num_blocks, block_size, 2, 2), torch.float32)] + index_keys
        num_kv_heads, head_dim = self.kv_geometry(layer)
        rows = (num_blocks, num_kv_heads, block_size)
        if not self.quant_policy:
            return [((*rows, head_dim), self.dtype)] * 2 + index_keys
        codes = ((*rows, head_dim * self.quant_policy // 8), torch.uint8)
        return [codes, codes, ((*rows, 2), torch.float32), ((*rows, 2), torch.float32)] + index_keys

    def kv_geometry(self, layer: int | None = None) -> tuple[int, int]:
        """``(num_kv_heads, head_dim)`` of ``layer``'s cache (None: of the model's, as its config names them)."""
        if layer is None or self.layer_kv_geometry is None:
            return self.num_kv_heads, self.head_dim
        return self.layer_kv_geometry[layer]

    def kv_bytes_per_layer_token(self, layer: int | None = None) -> int:
        """Bytes of KV cache one token takes in one layer (``layer``, where the layers' differ), scales and zero
        points included."""
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                   for shape, dtype in self.kv_cache_shapes(1, 1, layer))

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes across all layers with one, scales and zero points included."""
        layers = self.num_layers - self.num_state_layers - self.num_cacheless_layers - self.num_kv_shared_layers
        # where the layers' caches differ (Gemma 4), those with one are the first: its KV-sharing layers are the last
        return sum(self.kv_bytes_per_layer_token(layer) for layer in range(layers))

    def shared_kv_bytes_per_token(self) -> int:
        """Bytes of KV cache per token that the KV-sharing layers (the last ``num_kv_shared_layers``) do not hold."""
        return sum(self.kv_bytes_per_layer_token(layer)
                   for layer in range(self.num_layers - self.num_kv_shared_layers, self.num_layers))
