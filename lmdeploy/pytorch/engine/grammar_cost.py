"""What drives xgrammar's compile time, read off a response format's text without compiling it.

xgrammar computes, for every position of the grammar, the vocabulary's tokens allowed there
(``benchmark/grammar_compile.py`` measures it): its cost grows with

- the size of the format (enum values, choices, properties, alternatives: about linearly);
- the nesting depth of a JSON schema (faster than quadratically: each level rewrites the ones inside; the
  server bounds it with the nesting of a request's JSON, a schema sent as text included);
- the character classes (``[a-z]``, ``.``, ``\\d``) a regex spells out, a schema ``pattern``'s counted
  repetitions ``{m,n}`` multiplied out (xgrammar expands them; a ``regex`` or ``grammar`` format keeps them lazy),
  each the dearer the more optional items come before it (``.?`` 12 times, then ``[a-z]`` 300 times: 4.6 s,
  the classes alone 0.6 s);
- the optional items (``x?``, ``x{0,1}``, empty alternatives) of one regex or grammar: about cubically, since
  a token may skip any of them.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_COUNT = re.compile(r'\{\s*(\d*)\s*(?:(,)\s*(\d*)\s*)?\}')
_CLASS_ESCAPES = frozenset('dDwWsSpP')
# A string ``format`` counts as a pattern of this many classes: ``email`` and ``uri``, the slowest, cost as much.
FORMAT_REPETITION = 20
_DATA_KEYWORDS = ('const', 'enum', 'default', 'examples')  # their values are data, not schemas
_EBNF_NAME = re.compile(r'[A-Za-z_][\w-]*')
_EBNF_DEFINES = re.compile(r'\s*::=')

# The items a regex or grammar is read into: ('atom', weight), ('open',), ('close',), ('alt',), ('count', lo, hi)
Item = tuple


@dataclass(frozen=True)
class FormatCost:
    """What drives a response format's compile time (see the module's docstring)."""

    repetition: int  # character classes it spells out (:func:`regex_repetition`, all its regexes added)
    optionals: int  # optional items of its regex or grammar (:func:`regex_optionals`; a schema: its most in one)


def format_cost(fmt: dict[str, Any]) -> FormatCost:
    """The :class:`FormatCost` of a ``response_format`` (linear in :func:`format_size`)."""
    kind = fmt['type']
    if kind == 'json_schema':
        schema = fmt['json_schema']['schema']
        patterns = [p for p in schema_patterns(schema) if p is not None]
        return FormatCost(pattern_repetition(schema), max(map(regex_optionals, patterns), default=0))
    if kind == 'regex':
        return FormatCost(regex_repetition(fmt['regex'], expand=False), regex_optionals(fmt['regex'], expand=False))
    if kind == 'grammar':
        return FormatCost(grammar_repetition(fmt['grammar']), grammar_optionals(fmt['grammar']))
    return FormatCost(0, 0)


def format_size(fmt: dict[str, Any]) -> int:
    """Bytes of the text of a ``response_format`` (:func:`format_text`, UTF-8)."""
    return len(format_text(fmt).encode())


def format_text(fmt: dict[str, Any]) -> str:
    """The text of a ``response_format`` that its size is measured on: the schema as compact JSON, the regex,
    the grammar, the choices as a JSON list."""
    kind = fmt['type']
    if kind == 'json_schema':
        return json.dumps(fmt['json_schema']['schema'], separators=(',', ':'), ensure_ascii=False)
    if kind == 'choice':
        return json.dumps(fmt['choice'], separators=(',', ':'), ensure_ascii=False)
    return fmt.get(kind) if isinstance(fmt.get(kind), str) else ''


def json_depth(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (a scalar: 0, ``{}``: 1, ``{"a": []}``: 2)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest


def schema_patterns(schema: Any) -> Iterator[str | None]:
    """The regexes of a JSON schema as xgrammar compiles them: the ``pattern`` of each distinct string schema (one
    used twice compiles once: see :func:`share_regex_strings`), the keys of ``patternProperties``, and None for
    each distinct string schema with a ``format``."""
    seen = set()
    for item in _schema_objects(schema):
        key = _regex_string_key(item)
        if key is None or key not in seen:
            if key is not None:
                seen.add(key)
            if isinstance(item.get('pattern'), str):
                yield item['pattern']
            elif isinstance(item.get('format'), str):
                yield None
        if isinstance(item.get('patternProperties'), dict):
            yield from item['patternProperties']


def _schema_objects(schema: Any) -> Iterator[dict]:
    """Every object of a JSON schema, the values of data keywords (``enum``, ``const``...) left out."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack += item
        elif isinstance(item, dict):
            yield item
            stack += [v for k, v in item.items() if k not in _DATA_KEYWORDS]


def pattern_repetition(schema: Any) -> int:
    """:func:`regex_repetition` of the regexes of ``schema``, all added, and :data:`FORMAT_REPETITION` for each
    string ``format`` (xgrammar writes a regex for it)."""
    return sum(FORMAT_REPETITION if regex is None else regex_repetition(regex) for regex in schema_patterns(schema))


def share_regex_strings(schema: Any) -> Any:
    """``schema`` with each string schema that has a ``pattern`` or ``format`` and appears more than once (tools
    sharing a parameter type) defined once in ``$defs`` and referenced: xgrammar compiles a schema's every
    occurrence, a definition once (a tool set of 31 tools: 12 s, then 1.7 s). Annotations (``description``...)
    are dropped from them; a schema without such repeats is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    counts: dict[str, int] = {}
    for item in _schema_objects(schema):
        key = _regex_string_key(item)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    names = {key: f'lmdeploy_shared_{i}' for i, key in enumerate(k for k, n in counts.items() if n > 1)}
    if not names:
        return schema

    def rewrite(item: Any) -> Any:
        if isinstance(item, list):
            return [rewrite(v) for v in item]
        if not isinstance(item, dict):
            return item
        name = names.get(_regex_string_key(item))
        if name is not None:
            return {'$ref': f'#/$defs/{name}'}
        return {k: v if k in _DATA_KEYWORDS else rewrite(v) for k, v in item.items()}

    shared = rewrite(schema)
    defs = shared.get('$defs') if isinstance(shared.get('$defs'), dict) else {}
    shared['$defs'] = {**defs, **{name: json.loads(key) for key, name in names.items()}}
    return shared


_ANNOTATIONS = frozenset(['description', 'title', '$comment', 'examples', 'default', 'deprecated'])


def _regex_string_key(item: dict) -> str | None:
    """What identifies a string schema with a ``pattern`` or ``format`` and nothing else but scalars (its
    annotations left out), as text; None for any other schema."""
    if item.get('type') != 'string' or not (isinstance(item.get('pattern'), str)
                                            or isinstance(item.get('format'), str)):
        return None
    kept = {k: v for k, v in item.items() if k not in _ANNOTATIONS}
    if any(isinstance(v, (dict, list)) for v in kept.values()):
        return None
    return json.dumps(kept, sort_keys=True)


def regex_repetition(regex: str, expand: bool = True) -> int:
    """The character classes ``regex`` spells out (``[...]``, ``.``, ``\\d``, ``\\p{L}``...: 1 each, plus 1 for each
    optional item before it), a counted repetition ``{m,n}`` counting its bound (``{n}``, ``{m,}``: m) times what
    it repeats (a literal: 1) when ``expand`` (nested ones multiplied), else once; all added."""
    return _weigh(_regex_items(regex), expand)[0]


def regex_optionals(regex: str, expand: bool = True) -> int:
    """The optional items of ``regex``: ``x?``, ``x{0,1}`` and empty alternatives, a counted repetition of
    such items counting its bound times them when ``expand``."""
    return _weigh(_regex_items(regex), expand)[1]


def grammar_repetition(ebnf: str) -> int:
    """:func:`regex_repetition` of an EBNF grammar (xgrammar's dialect), counted repetitions counted once."""
    return _weigh(_ebnf_items(ebnf), False)[0]


def grammar_optionals(ebnf: str) -> int:
    """:func:`regex_optionals` of an EBNF grammar, all its rules together (a rule may use the others)."""
    return _weigh(_ebnf_items(ebnf), False)[1]


def _weigh(items: Iterator[Item], expand: bool) -> tuple[int, int]:
    """(classes, optional items) of a stream of items, counted repetitions multiplied out when ``expand``; a class
    counts once more for each optional item before it (a token reaches it from as many places)."""
    groups = [_Group()]
    last = _Group()  # what a quantifier applies to: the item just before it
    seen = 0  # optional items so far
    for item in items:
        kind, group = item[0], groups[-1]
        if kind == 'open':
            groups.append(_Group())
        elif kind == 'alt':
            seen += group.alternative_ends()
        elif kind == 'count':
            lo, hi = item[1], item[2]
            if (lo, hi) == (0, 1):
                group.optionals += 1
                seen += 1
            elif expand:
                factor = max(lo, hi or 0)
                group.classes += (factor - 1) * last.classes if last.classes else factor
                group.optionals += (factor - 1) * last.optionals
                seen += (factor - 1) * last.optionals
        else:
            if kind == 'close' and len(groups) > 1:
                last = groups.pop()
                seen += last.alternative_ends(last=True)
                group = groups[-1]
            else:
                last = _Group(item[1] * (1 + seen) if kind == 'atom' else 0)
            group.classes += last.classes
            group.optionals += last.optionals
            group.items += 1
    for group in groups[1:]:
        groups[0].classes += group.classes
        groups[0].optionals += group.optionals
    groups[0].alternative_ends(last=True)
    return groups[0].classes, groups[0].optionals


class _Group:
    """What :func:`_weigh` has counted in a group so far; an empty alternative is an optional item."""

    def __init__(self, classes: int = 0):
        self.classes, self.optionals, self.items, self.alternatives = classes, 0, 0, 0

    def alternative_ends(self, last: bool = False) -> int:
        """Ends an alternative; returns the optional items that adds (1 if it was empty, else 0)."""
        empty = not self.items and (self.alternatives or not last)
        self.optionals += empty
        self.items, self.alternatives = 0, self.alternatives + 1
        return int(empty)


def _regex_items(regex: str) -> Iterator[Item]:
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        i += 1
        if c == '(':
            if regex.startswith('?', i):  # (?:...), (?=...), (?<name>...): no quantifier
                close = regex.find(':', i) if regex.startswith('?:', i) else -1
                i = close + 1 if close >= 0 else i + 1
            yield ('open',)
        elif c == ')':
            yield ('close',)
        elif c == '|':
            yield ('alt',)
        elif c == '\\':
            escaped = regex[i:i + 1]
            i += 1
            if escaped in ('p', 'P', 'u', 'x') and regex.startswith('{', i):  # \p{L}, \u{1F600}
                i = regex.find('}', i) + 1 or n
            yield ('atom', int(escaped in _CLASS_ESCAPES))
        elif c == '[':
            i = _class_end(regex, i)
            yield ('atom', 1)
        elif c == '.':
            yield ('atom', 1)
        elif c == '?':
            i += regex.startswith('?', i)  # lazy
            yield ('count', 0, 1)
        elif c in '*+':
            i += regex.startswith('?', i)  # lazy
        elif c == '{' and _COUNT.match(regex, i - 1):
            match = _COUNT.match(regex, i - 1)
            i = match.end()
            i += regex.startswith('?', i)
            yield _count_item(match)
        elif c not in '^$':
            yield ('atom', 0)


def _ebnf_items(ebnf: str) -> Iterator[Item]:
    """Each rule as a group of its own, so that an empty alternative of one counts as an optional item."""
    i, n, in_rule = 0, len(ebnf), False
    while i < n:
        c = ebnf[i]
        if c == '#':
            end = ebnf.find('\n', i)
            i = n if end < 0 else end
            continue
        if ebnf.startswith('::=', i):
            if in_rule:
                yield ('close',)
            yield ('open',)
            in_rule, i = True, i + 3
            continue
        i += 1
        if c in '"\'':
            start = i
            while i < n and ebnf[i] != c:
                i += 2 if ebnf[i] == '\\' else 1
            i += 1
            yield ('atom', 0) if i - start > 1 else ('count', 0, 1)  # "": the empty string
        elif c == '[':
            i = _class_end(ebnf, i)
            yield ('atom', 1)
        elif c == '(':
            yield ('open',)
        elif c == ')':
            yield ('close',)
        elif c == '|':
            yield ('alt',)
        elif c == '?':
            yield ('count', 0, 1)
        elif c == '{' and _COUNT.match(ebnf, i - 1):
            match = _COUNT.match(ebnf, i - 1)
            i = match.end()
            yield _count_item(match)
        elif _EBNF_NAME.match(ebnf, i - 1):
            i = _EBNF_NAME.match(ebnf, i - 1).end()
            if not _EBNF_DEFINES.match(ebnf, i):  # a rule's name before its '::=' is not an item
                yield ('atom', 0)
    if in_rule:
        yield ('close',)


def _class_end(text: str, i: int) -> int:
    """Where the character class whose '[' is just before ``i`` ends (after its ']')."""
    i += text.startswith('^', i)
    i += text.startswith(']', i)
    while i < len(text) and text[i] != ']':
        i += 2 if text[i] == '\\' else 1
    return i + 1


def _count_item(match: re.Match) -> Item:
    lo = int(match[1] or 0)
    hi = lo if not match[2] else (int(match[3]) if match[3] else None)
    return ('count', lo, hi)
