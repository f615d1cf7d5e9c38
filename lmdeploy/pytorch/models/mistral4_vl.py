"""Mistral Small 4 (``Mistral3ForConditionalGeneration`` with a ``mistral4`` language model): Mistral 3's Pixtral
tower and patch-merging projector (:mod:`~lmdeploy.pytorch.models.mistral3_vl`) feeding Mistral 4's language model
(:class:`~lmdeploy.pytorch.models.deepseek_v3.Mistral4ForCausalLM`: DeepSeek-V3's latent attention and experts).
:class:`~lmdeploy.pytorch.models.mistral3_vl.Mistral3ForConditionalGeneration` builds this class for such a config."""
from __future__ import annotations

from lmdeploy.pytorch.models.deepseek_v3 import Mistral4ForCausalLM
from lmdeploy.pytorch.models.mistral3_vl import Mistral3ForConditionalGeneration


class MistralSmall4ForConditionalGeneration(Mistral3ForConditionalGeneration, Mistral4ForCausalLM):
    """Mistral 3's vision part and image spans over Mistral 4's layers and latent KV cache."""
