"""A tiny random model whose chat template renders tools, tool calls and tool results Hermes/Qwen-style,
closes an empty think block with Qwen3's ``enable_thinking=False`` and opens one in the prompt, as
DeepSeek-R1's template does, with ``open_think=True``; its tokenizer has ``<think>``, ``</think>``,
``<tool_call>`` and ``</tool_call>`` as single tokens."""
from __future__ import annotations

from collections.abc import Collection

from conftest import save_tiny_model
from transformers import AutoTokenizer

TOOL_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a tool with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif open_think is defined and open_think %}<think>
{% endif %}{% endif %}"""

ADDED_TOKENS = ['<think>', '</think>', '<tool_call>', '</tool_call>']


def save_tool_model(path: str, template: str = TOOL_TEMPLATE, special: Collection[str] = ()) -> str:
    """A tiny random Qwen2 at ``path`` with ``template`` (by default :data:`TOOL_TEMPLATE`) and the
    :data:`ADDED_TOKENS`: plain added tokens, as in Qwen's tokenizers, but for those in ``special``, which
    are special tokens."""
    save_tiny_model('qwen2', path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens([t for t in ADDED_TOKENS if t not in special])
    tokenizer.add_tokens([t for t in ADDED_TOKENS if t in special], special_tokens=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path
