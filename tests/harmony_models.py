"""A tiny random gpt-oss whose tokenizer has harmony's markers as special tokens and whose chat template
renders a harmony conversation as gpt-oss's does (tools as a developer message, an assistant message's
``thinking`` only in a trailing assistant turn, channel markers in a content refused, the prompt ending
``<|start|>assistant``); its replies end at ``<|return|>`` or ``<|call|>``, as gpt-oss's
``generation_config.json`` says. A scripted variant answers every prompt with the same harmony reply."""
from __future__ import annotations

import json
import os

import torch
from conftest import VOCAB_SIZE, save_random_model
from safetensors.torch import load_file, save_file
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
{%- elif m.role == 'assistant' %}
{%- if '<|channel|>' in m.content %}{{ raise_exception('channel markers in an assistant content') }}{% endif %}
{%- if m.thinking is defined and loop.last and not add_generation_prompt %}\
<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}\
<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def save_harmony_model(path: str, words: tuple[str, ...] = ()) -> str:
    """The model at ``path``; ``model_type`` gpt_oss. Its tokenizer also has ``words`` as single tokens."""
    config = GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=VOCAB_SIZE + len(words), num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=1024)
    save_random_model(config, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({'additional_special_tokens': list(SPECIAL_TOKENS)})
    tokenizer.add_tokens(list(words))
    assert len(tokenizer) <= config.vocab_size
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(path)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({'eos_token_id': tokenizer.convert_tokens_to_ids([RETURN, CALL])}, f)
    return path


SCRIPTED_REASONING, SCRIPTED_ANSWER = 'Pondering', 'Hello!'
SCRIPTED_REPLY = f'<|channel|>analysis<|message|>{SCRIPTED_REASONING}<|end|>{SCRIPTED_ANSWER}'


def save_scripted_harmony_model(path: str) -> str:
    """The harmony model rigged to answer every prompt, greedily, with :data:`SCRIPTED_REPLY` (reasoning in
    the analysis channel, then an answer outside any message) and ``<|return|>``: attention and experts add
    nothing, so a step's logits depend on its input token alone, and the LM head maps the last token of the
    prompt (of ``<|start|>assistant``) to the reply's first token and each token of the reply to the next."""
    save_harmony_model(path, ('analysis', SCRIPTED_REASONING, SCRIPTED_ANSWER))
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True,
                                           tokenize=False)
    chain = [tokenizer.encode(prompt, add_special_tokens=False)[-1],
             *tokenizer.encode(SCRIPTED_REPLY, add_special_tokens=False), tokenizer.convert_tokens_to_ids(RETURN)]
    weights = load_file(os.path.join(path, 'model.safetensors'))
    hidden = weights['model.norm.weight'].numel()
    assert len(set(chain)) == len(chain) <= hidden
    for name, tensor in weights.items():
        if name.endswith(('o_proj.weight', 'o_proj.bias', 'experts.down_proj', 'experts.down_proj_bias')):
            tensor.zero_()
    weights['model.norm.weight'].fill_(1.0)
    head = weights['lm_head.weight'].zero_()
    for i, (token, successor) in enumerate(zip(chain, chain[1:])):
        weights['model.embed_tokens.weight'][token] = torch.eye(hidden)[i]
        head[successor, i] = 4.0
    save_file(weights, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
    return path
