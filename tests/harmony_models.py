"""A tiny random gpt-oss whose tokenizer has harmony's markers as special tokens and whose chat template
renders a harmony conversation (tools as a developer message, the prompt ending ``<|start|>assistant``);
its replies end at ``<|return|>`` or ``<|call|>``, as gpt-oss's ``generation_config.json`` says."""
from __future__ import annotations

import json
import os

from conftest import VOCAB_SIZE, save_random_model
from transformers import AutoTokenizer, GptOssConfig

from lmdeploy.serve.openai.harmony import CALL, RETURN, SPECIAL_TOKENS

HARMONY_TEMPLATE = """\
<|start|>system<|message|>You are a tiny model.<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {
{% for tool in tools %}type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;
{% endfor %}} // namespace functions<|end|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}
{%- for call in m.tool_calls %}<|start|>assistant to=functions.{{ call.function.name }}<|channel|>commentary json\
<|message|>{{ call.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def save_harmony_model(path: str) -> str:
    """The model at ``path``; ``model_type`` gpt_oss."""
    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024)
    save_random_model(config, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({'additional_special_tokens': list(SPECIAL_TOKENS)})
    assert len(tokenizer) <= VOCAB_SIZE
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({'eos_token_id': tokenizer.convert_tokens_to_ids([RETURN, CALL])}, f)
    return path
