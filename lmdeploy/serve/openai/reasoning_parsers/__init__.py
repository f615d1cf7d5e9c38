"""Reasoning parsers: split a reasoning model's reply into ``reasoning_content`` and ``content``.

A parser registers itself under the names ``--reasoning-parser`` accepts (see
:func:`register_reasoning_parser`); importing this package registers the built-in ones.
"""
from lmdeploy.serve.openai.reasoning_parsers import harmony, think  # noqa: F401  (registration)
from lmdeploy.serve.openai.reasoning_parsers.base import (REASONING_PARSERS, ReasoningDelta, ReasoningParser,
                                                          get_reasoning_parser, register_reasoning_parser)

__all__ = ['REASONING_PARSERS', 'ReasoningDelta', 'ReasoningParser', 'get_reasoning_parser',
           'register_reasoning_parser']
