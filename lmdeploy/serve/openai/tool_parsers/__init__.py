"""Tool-call parsers: turn a model's reply into text and OpenAI tool calls.

A parser registers itself under the names ``--tool-call-parser`` accepts (see
:func:`register_tool_parser`); importing this package registers the built-in ones.
"""
from lmdeploy.serve.openai.tool_parsers import deepseek, glm45, granite, harmony, hermes  # noqa: F401  (registration)
from lmdeploy.serve.openai.tool_parsers import llama3_json, mistral, pythonic, qwen3_coder  # noqa: F401  (registration)
from lmdeploy.serve.openai.tool_parsers import cohere, falcon_h1, jamba  # noqa: F401  (registration)
from lmdeploy.serve.openai.tool_parsers import minimax_m2, seed_oss  # noqa: F401  (registration)
from lmdeploy.serve.openai.tool_parsers.base import (TOOL_PARSERS, ParsedDelta, ToolCallDelta, ToolParser,
                                                     get_tool_parser, register_tool_parser)
from lmdeploy.serve.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser

__all__ = ['TOOL_PARSERS', 'NamedToolParser', 'ParsedDelta', 'RequiredToolParser', 'ToolCallDelta', 'ToolParser',
           'get_tool_parser', 'register_tool_parser']
