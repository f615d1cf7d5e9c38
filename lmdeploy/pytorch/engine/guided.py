"""Grammar-constrained decoding with xgrammar.

A request's ``response_format`` compiles once into a :class:`Grammar` (compiled grammars are cached by their
source, up to ``PytorchEngineConfig.grammar_cache_mb``); each sequence keeps its own :class:`GrammarState`, whose
matcher masks the sequence's logits before sampling and advances with every token it samples.
"""
from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.grammar_cost import share_regex_strings
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported where a grammar is used: an engine that never sees one never pays for it
    import xgrammar as xgr

_LOG_PREFIX = re.compile(r'^\[[\d:]+\] \S+:\d+: ')  # xgrammar's "[time] file.cc:line: " before its message

# JSON grammars allow this much whitespace in a row: enough for indented JSON, too little for a model to
# spend its whole budget on blank space.
_MAX_WHITESPACE = 16


@dataclass(frozen=True)
class Grammar:
    """A compiled response format; ``after_ids`` are the tokens after which it starts to apply, and with
    ``opener_ids`` only when the output starts with those (from its start otherwise)."""

    compiled: xgr.CompiledGrammar
    after_ids: tuple[int, ...] = ()
    opener_ids: tuple[int, ...] = ()


class GrammarCompiler:
    """Compiles ``GenerationConfig.response_format`` for one tokenizer; safe to call from any thread. Compiled
    grammars kept for reuse take at most ``cache_bytes`` (0: none kept).

    The vocabulary is read on first use, so an engine that never sees a grammar never pays for it.
    :class:`~lmdeploy.pytorch.engine.grammar_worker.GrammarProcessPool` compiles in processes that can be
    killed, for the same result.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 cache_bytes: int = PytorchEngineConfig.grammar_cache_mb << 20):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_bytes = cache_bytes
        self._info: xgr.TokenizerInfo | None = None
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def tokenizer_info(self) -> xgr.TokenizerInfo:
        """xgrammar's view of the vocabulary (read once)."""
        import xgrammar as xgr
        with self._lock:
            if self._info is None:
                self._info = xgr.TokenizerInfo.from_huggingface(self.tokenizer.hf, vocab_size=self.vocab_size,
                                                                stop_token_ids=sorted(self.tokenizer.eos_token_ids))
            return self._info

    def compile(self, gen_config: GenerationConfig) -> Grammar | None:
        """The grammar of ``gen_config.response_format``, compiled in this process (None without one); a
        format xgrammar cannot compile raises ``ValueError`` with its reason."""
        fmt = gen_config.response_format
        if fmt is None:
            return None
        import xgrammar as xgr
        info = self.tokenizer_info()
        with self._lock:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=self.cache_bytes > 0,
                                                     cache_limit_bytes=self.cache_bytes)
        return self.grammar(compile_format(self._compiler, fmt), gen_config)

    def grammar(self, compiled: xgr.CompiledGrammar, gen_config: GenerationConfig) -> Grammar:
        """``compiled`` (the grammar of ``gen_config.response_format``) with the tokens it applies after."""
        def ids(text: str | None) -> tuple[int, ...]:
            return tuple(self.tokenizer.encode(text, add_special_tokens=False)) if text else ()
        return Grammar(compiled, ids(gen_config.response_format_after), ids(gen_config.response_format_opener))


def compile_format(compiler: xgr.GrammarCompiler, fmt: dict[str, Any]) -> xgr.CompiledGrammar:
    """``fmt`` (a ``response_format``) compiled by ``compiler``; one xgrammar cannot compile raises
    ``ValueError`` with its reason."""
    try:
        return _compile(compiler, fmt)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = _LOG_PREFIX.sub('', str(exc).strip())
        raise ValueError(f"response_format {fmt['type']!r} could not be compiled: {reason}") from None


def _compile(compiler: xgr.GrammarCompiler, fmt: dict[str, Any]) -> xgr.CompiledGrammar:
    kind = fmt['type']
    if kind in ('json_object', 'json_schema'):
        schema = fmt['json_schema']['schema'] if kind == 'json_schema' else {'type': 'object'}
        return compiler.compile_grammar(json_schema_grammar(schema))
    if kind == 'regex':
        return compiler.compile_regex(fmt['regex'])
    if kind == 'choice':
        return compiler.compile_grammar('root ::= ' + ' | '.join(json.dumps(c) for c in fmt['choice']))
    return compiler.compile_grammar(fmt['grammar'])


def json_schema_grammar(schema: Any) -> xgr.Grammar:
    """The grammar of JSON valid under ``schema``, with xgrammar's length-bounded strings made JSON strings.

    xgrammar (0.2) writes a ``minLength``/``maxLength`` string as a counted repetition of one character rule,
    which compiles lazily whatever its bounds but lets in control characters (JSON forbids them unescaped)
    and UTF-8-encoded surrogates (invalid UTF-8, three characters once decoded): that rule is narrowed here.
    Repeated pattern and format strings are defined once (:func:`share_regex_strings`).
    """
    import xgrammar as xgr
    grammar = xgr.Grammar.from_json_schema(json.dumps(share_regex_strings(schema)), any_whitespace=True,
                                           max_whitespace_cnt=_MAX_WHITESPACE)
    text, count = _BOUNDED_STRING_CHAR.subn(lambda m: f'{m[1]} ::= (({_JSON_STRING_CHAR}))', str(grammar))
    return xgr.Grammar.from_ebnf(text) if count else grammar


_BOUNDED_STRING_CHAR = re.compile(r'^(\w+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\ud800-\udfff]'


class GrammarState:
    """Where one sequence stands in its grammar. ``active``: the grammar masks the next token. While
    ``opening`` (from the output's start, until it is decided), the output may open with the grammar's
    ``opener_ids`` instead: tokens that both allow go to both, the first that only the grammar allows starts
    the grammar, and once the opener is complete the grammar applies after the ``after_ids``."""

    def __init__(self, grammar: Grammar):
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(grammar.compiled)
        self.after_ids = list(grammar.after_ids)
        self.opener_ids = list(grammar.opener_ids)
        self.opened = 0  # tokens of the opener output so far
        self.opening = bool(self.opener_ids)
        self.grammar_open = True  # while opening: the output so far is also the grammar's
        self.active = not self.after_ids or self.opening

    def accept(self, token_id: int, output_ids: list[int]) -> bool:
        """Advances past ``token_id`` (sampled after ``output_ids``); True once the grammar is complete or
        the token breaks it (it cannot when the logits were masked), so generation must stop."""
        if self.opening:
            self.grammar_open = self.grammar_open and self.matcher.accept_token(token_id)
            if token_id == self.opener_ids[self.opened]:
                self.opened += 1
                if self.opened == len(self.opener_ids):
                    self.opening = self.active = False
                    self.matcher.reset()
                return False
            self.opening = False
            return not self.grammar_open or self.matcher.is_terminated()
        if not self.active:
            n = len(self.after_ids)
            self.active = (output_ids[-(n - 1):] if n > 1 else []) + [token_id] == self.after_ids
            return False
        return not self.matcher.accept_token(token_id) or self.matcher.is_terminated()


_per_thread = threading.local()  # each engine thread its own batch matcher (it holds a thread pool) and bitmask


def apply_grammars(x: Tensor, states: list[GrammarState | None]) -> None:
    """Masks, in place, the logits ``x [B, V]`` of the rows whose grammar is active to the tokens their
    grammar allows next."""
    rows = [i for i, s in enumerate(states) if s is not None and s.active]
    if not rows:
        return
    import xgrammar as xgr
    if not hasattr(_per_thread, 'batch_matcher'):
        # On the CPU the engine's own threads hold every core: more threads would only take turns with them.
        _per_thread.batch_matcher = xgr.BatchGrammarMatcher(max_threads=1 if x.device.type == 'cpu' else 'auto')
        _per_thread.bitmask = xgr.allocate_token_bitmask(1, x.shape[1])
    shape = (len(states), xgr.get_bitmask_shape(1, x.shape[1])[1])
    if _per_thread.bitmask.shape[0] < shape[0] or _per_thread.bitmask.shape[1] != shape[1]:
        _per_thread.bitmask = torch.empty((max(shape[0], _per_thread.bitmask.shape[0]), shape[1]),
                                          dtype=xgr.bitmask_dtype)
    bitmask = _per_thread.bitmask[:shape[0]]  # the rows not filled here are not applied either
    _per_thread.batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, rows)
    for i in rows:
        if states[i].opening:
            _allow_opener(bitmask[i], states[i])
    native = cpu.native() if x.device.type == 'cpu' else None
    if native is not None:  # xgrammar's CPU version is several times slower on bf16 logits
        native.apply_token_bitmask(x, bitmask, rows)
    else:
        xgr.apply_token_bitmask_inplace(x, bitmask.to(x.device, non_blocking=True), indices=rows)


def _allow_opener(mask: Tensor, state: GrammarState) -> None:
    """Lets ``state``'s opener go on in a row ``mask`` of the grammar's allowed tokens: its next token along
    with them while the output so far is also the grammar's, alone once it is not."""
    if not state.grammar_open:
        mask.zero_()
    token = state.opener_ids[state.opened]
    bit = 1 << token % 32
    mask[token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # the mask's words are int32


def needs_grammar(states: list[GrammarState | None]) -> bool:
    return any(s is not None and s.active for s in states)

