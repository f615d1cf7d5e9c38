"""Tokenizer wrapper, incremental (streaming) detokenization and stop-word handling."""
from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable

from transformers import AutoTokenizer

from lmdeploy.messages import ConfigError

_REPLACEMENT_CHAR = '\ufffd'
_SURROGATE = re.compile('[\ud800-\udfff]')


def _as_ids(value: int | Iterable[int] | None) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _processor_chat_template(model_dir: str) -> str | None:
    """The chat template a vision-language model keeps beside its processor rather than its tokenizer."""
    jinja = os.path.join(model_dir, 'chat_template.jinja')
    if os.path.isfile(jinja):
        with open(jinja, encoding='utf-8') as f:
            return f.read()
    path = os.path.join(model_dir, 'chat_template.json')
    if os.path.isfile(path):
        with open(path, encoding='utf-8') as f:
            return json.load(f).get('chat_template')
    return None


class Tokenizer:
    """A Hugging Face tokenizer loaded from a model folder, with the model's EOS ids."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        try:
            self.hf = AutoTokenizer.from_pretrained(model_dir)
        except (ValueError, OSError) as err:
            reason = ' '.join(str(err).split())
            raise ConfigError(f'cannot load the tokenizer of {model_dir} ({type(err).__name__}: {reason}); the '
                              'folder needs the tokenizer files its model was published with (tokenizer.json, '
                              'tokenizer_config.json)') from err
        eos = _as_ids(self.hf.eos_token_id)
        for name in ('generation_config.json', 'config.json'):
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                with open(path, encoding='utf-8') as f:
                    eos |= _as_ids(json.load(f).get('eos_token_id'))
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        if not getattr(self.hf, 'chat_template', None):
            self.hf.chat_template = _processor_chat_template(model_dir)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; text that is not valid Unicode (a lone UTF-16 surrogate) raises ``ValueError``."""
        try:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        except TypeError:
            if isinstance(text, str) and _SURROGATE.search(text):
                raise ValueError(f'the text holds a lone UTF-16 surrogate ({_SURROGATE.search(text).group()!a}), '
                                 'which no encoding can carry; pass valid Unicode text') from None
            raise

    @functools.cached_property
    def special_token_ids(self) -> dict[int, str]:
        """The special tokens (those ``skip_special_tokens`` drops) by id."""
        tokens = {i: t.content for i, t in self.hf.added_tokens_decoder.items() if t.special}
        return tokens | {i: self.hf.convert_ids_to_tokens(i) for i in self.hf.all_special_ids if i not in tokens}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``, without the legacy clean-up of spaces (which breaks streaming)."""
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            **template_kwargs) -> str:
        """Render ``messages`` (and ``tools``, OpenAI-style function definitions) with ``chat_template``
        (Jinja) or the model's own template, which also sees ``template_kwargs``; or join the messages'
        contents if there is no template."""
        if chat_template or getattr(self.hf, 'chat_template', None):
            return self.hf.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                               add_generation_prompt=add_generation_prompt, tools=tools,
                                               **template_kwargs)
        return '\n'.join(str(m['content']) for m in messages)


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas while they are generated.

    Each step decodes a short window (the tokens of the previous delta plus the new ones) and emits
    what the new tokens added. Text ending in an incomplete UTF-8 character is held back until the
    character is complete, so the concatenated deltas equal ``tokenizer.decode(output_ids)``. (One
    exception: a SentencePiece byte-fallback decoder turns *every* byte of an invalid byte run into
    U+FFFD, also bytes that were valid and already streamed; only garbage output is affected.)
    ``prompt_ids`` is accepted for interface symmetry only: the text is decoded from the output tokens
    alone (with the prompt as context, a SentencePiece leading space would appear that
    ``decode(output_ids)`` strips). With ``skip_special_tokens``, the special tokens named in ``keep``
    stay in the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 keep: list[str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.dropped: frozenset[int] | None = None  # with ``keep``: the special ids decoding leaves out
        if skip_special_tokens and keep:
            self.skip_special_tokens = False
            self.dropped = frozenset(i for i, t in tokenizer.special_token_ids.items() if t not in keep)
        self.output_ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens up to here have been turned into text

    def _decode(self, start: int, end: int) -> str:
        ids = self.output_ids[start:end]
        if self.dropped is not None:
            ids = [i for i in ids if i not in self.dropped]
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def _advance(self, force: bool) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix, len(self.output_ids))
        if not force and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)):
            return ''
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self.output_ids)
        return delta

    def step(self, new_ids: list[int]) -> str:
        """Add newly generated tokens; return the text they complete (may be empty)."""
        self.output_ids.extend(new_ids)
        return self._advance(force=False)

    def finish(self) -> str:
        """Return the text still held back (e.g. a trailing invalid byte sequence)."""
        return self._advance(force=True)


class StopChecker:
    """Stops at the first stop word in streamed text and never streams part of one.

    ``feed`` takes each text delta and returns the text that is safe to stream: a suffix that could
    still grow into a stop word is held back until it can no longer. Everything after the stop word
    is dropped, and the stop word too unless ``include_stop`` (the longest of those found first).
    """

    def __init__(self, stop_words: list[str] | None, include_stop: bool = False):
        self.stop_words = [w for w in stop_words or () if w]
        self.include_stop = include_stop
        self.stopped = False
        self._pending = ''  # text received but not yet released

    def _held_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop word."""
        best = 0
        for word in self.stop_words:
            for k in range(min(len(word) - 1, len(text)), best, -1):
                if text.endswith(word[:k]):
                    best = k
                    break
        return best

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add a text delta; return (text safe to stream now, whether a stop word was reached)."""
        if self.stopped:
            return '', True
        text = self._pending + delta
        hits = [(text.find(w), -len(w)) for w in self.stop_words if w in text]
        if hits:
            self.stopped = True
            self._pending = ''
            start, minus_length = min(hits)
            return text[:start - minus_length if self.include_stop else start], True
        keep = len(text) - self._held_len(text)
        self._pending = text[keep:]
        return text[:keep], False

    def flush(self) -> str:
        """Release the held-back text when generation ends without a stop word."""
        out, self._pending = self._pending, ''
        return out
