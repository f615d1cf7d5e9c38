"""Reasoning replies outside the HTTP layer: which parsers a model gets by default (the server uses the same
table), and a reply's streamed chunks split into reasoning and answer for ``pipeline()`` and ``lmdeploy chat``.

The parsers themselves are the server's (``lmdeploy/serve/openai/reasoning_parsers``, plain Python).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from lmdeploy.messages import GenerationConfig, Response
from lmdeploy.serve.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser

if TYPE_CHECKING:  # the tokenizer module imports transformers: `lmdeploy chat --help` stays fast without it
    from lmdeploy.tokenizer import IncrementalDetokenizer

# Model types whose chat replies need parsers, and the (tool, reasoning) parsers they get unless named.
# Only model types whose replies are in one format whatever the checkpoint: Qwen3-Coder (``qwen3_moe``),
# Qwen3-Coder-Next (``qwen3_next``), Granite (3.x and 4.x share ``granite``) and Llama 4 (its format follows
# the chat template) share theirs with models that write calls otherwise.
MODEL_PARSERS = {'gpt_oss': ('harmony', 'harmony'), 'seed_oss': ('seed_oss', 'seed_oss'),
                 'qwen3_5_text': ('qwen3_coder', 'qwen3_5'), 'qwen3_5_moe_text': ('qwen3_coder', 'qwen3_5'),
                 'minimax_m2': ('minimax_m2', 'qwen3'), 'hunyuan_v1_moe': ('hunyuan_a13b', 'hunyuan_a13b'),
                 'hunyuan_v1_dense': ('hunyuan_a13b', 'hunyuan_a13b'), 'jamba': ('jamba', None),
                 'cohere2': ('cohere2', 'cohere2'), 'falcon_h1': ('falcon_h1', None),
                 'mistral4': ('mistral', 'mistral'), 'longcat_flash': ('longcat', None)}
AUTO = 'auto'


def check_reasoning_parser(name: str | None) -> None:
    """Raises ``ValueError`` (naming the known parsers) unless ``name`` is 'auto', None or a parser's name."""
    if name not in (AUTO, None):
        get_reasoning_parser(name)


def pick_reasoning_parser(name: str | None, model_type: str) -> type[ReasoningParser] | None:
    """The parser ``name`` asks for: 'auto' the one of :data:`MODEL_PARSERS` for ``model_type`` (None when it
    has none), None no parser, else the parser registered under ``name``."""
    check_reasoning_parser(name)
    if name == AUTO:
        name = MODEL_PARSERS.get(model_type, (None, None))[1]
    return get_reasoning_parser(name) if name else None


def keep_special_tokens(config: GenerationConfig, tokens: Iterable[str]) -> GenerationConfig:
    """``config`` keeping ``tokens`` in the text as well, when it skips special tokens."""
    kept, tokens = set(config.keep_special_tokens or ()), set(tokens)
    if not config.skip_special_tokens or kept >= tokens:
        return config
    return dataclasses.replace(config, keep_special_tokens=sorted(kept | tokens))


def for_parser(config: GenerationConfig, parser: ReasoningParser) -> GenerationConfig:
    """``config`` for a reply that ``parser`` reads: the markers it reads kept, and a response format that
    does not say where it starts applied to the answer, after the reasoning."""
    config = keep_special_tokens(config, parser.markers)
    if config.response_format is not None and config.response_format_after is None:
        after = parser.grammar_after()
        config = dataclasses.replace(config, response_format_after=after,
                                     response_format_opener=parser.grammar_opener() if after else None)
    return config


class ReasoningCounter:
    """How many of one reply's tokens are reasoning. :meth:`add` the reply's token ids as they come: a fresh
    ``detokenizer``, set up as the engine's was, gives each token's text. A token counts when its text overlaps
    the reasoning that a parser fed that text gave out, not the markers around it; one whose text a later token
    completes (a byte of a character) counts where it stands."""

    def __init__(self, detokenizer: IncrementalDetokenizer):
        self.detokenizer = detokenizer
        self.ends: list[int] = []  # where each token's text ends in the reply's text

    def add(self, token_ids: Iterable[int]) -> str:
        """Takes the next token ids; returns their text."""
        pieces = []
        for token_id in token_ids:
            pieces.append(self.detokenizer.step([token_id]))
            self.ends.append((self.ends[-1] if self.ends else 0) + len(pieces[-1]))
        return ''.join(pieces)

    def count(self, parser: ReasoningParser) -> int:
        """The reasoning tokens among those added, once ``parser`` was fed their text and finished."""
        spans = parser.reasoning_spans
        count = start = 0
        for end in self.ends:
            count += any(first < max(end, start + 1) and start < last for first, last in spans)
            start = end
        return count


class ReasoningSplitter:
    """Splits one reply's chunks as they stream: a chunk's ``text`` becomes its share of the answer and its
    ``reasoning_content`` its share of the reasoning (both possibly ''); the last chunk (the one with a
    ``finish_reason``) carries what the parser held back and the reply's ``reasoning_tokens``, counted by
    ``counter`` (which a parser needs). Without a parser, chunks pass unchanged."""

    def __init__(self, parser: ReasoningParser | None, counter: ReasoningCounter | None = None):
        self.parser = parser
        self.counter = counter

    def __call__(self, chunk: Response) -> Response:
        if self.parser is None:
            return chunk
        self.counter.add(chunk.token_ids)
        split = self.parser.feed(chunk.text)
        if chunk.finish_reason is not None:
            rest = self.parser.finish()
            split.reasoning += rest.reasoning
            split.content += rest.content
            chunk.reasoning_tokens = self.counter.count(self.parser)
        chunk.text, chunk.reasoning_content = split.content, split.reasoning
        return chunk


def assistant_message(content: str, reasoning: str | None, parser: type[ReasoningParser] | None) -> dict:
    """A reply as the history's assistant message: the answer as its content and the reasoning, if any, in
    the field where the parser's chat templates take it (which decide whether to render it again)."""
    message = {'role': 'assistant', 'content': content}
    if parser is not None and reasoning:
        message[parser.history_field] = reasoning
    return message
