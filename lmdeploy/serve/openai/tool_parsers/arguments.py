"""Arguments written as text, one value at a time (XML-style and Python-style calls), turned into JSON.

A value's type comes from the tool's JSON schema: a ``string`` parameter is the text as written, others are
read as JSON (or, failing that, as a Python literal, as some chat templates render them); a value that is
not of its parameter's type stays a string. A parameter the schema does not type is JSON if the text is
JSON, else a string.
"""
from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

_NOT_A_VALUE = object()
_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


def parameter_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each tool's parameters' schemas (``properties``), by function name, from OpenAI ``tools`` entries."""
    out = {}
    for tool in tools:
        function = tool.get('function') or {}
        parameters = function.get('parameters') or {}
        properties = parameters.get('properties') if isinstance(parameters, Mapping) else None
        if isinstance(function.get('name'), str):
            out[function['name']] = dict(properties) if isinstance(properties, Mapping) else {}
    return out


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (``type``, or the types of its ``anyOf``/``oneOf`` members); empty
    when it does not say."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get('type')
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    members = [m for key in ('anyOf', 'oneOf') for m in schema.get(key) or ()]
    return set().union(*(schema_types(m) for m in members)) if members else set()


def is_string(schema: Any) -> bool:
    """Whether the schema allows strings only: such a value is its text, known before it ends."""
    return schema_types(schema) == {'string'}


def json_text(value: Any) -> str | None:
    """``value`` as JSON text, None when it is no JSON value (a set, a complex number, an infinity)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except _LITERAL_ERRORS:
        return None


def _json_type(value: Any) -> str | None:
    if value is None:
        return 'null'
    for kind, name in ((bool, 'boolean'), (int, 'integer'), (float, 'number'), (str, 'string'), (list, 'array'),
                       (dict, 'object')):
        if isinstance(value, kind):
            return name
    return None


def literal(text: str, python: bool = True) -> Any:
    """The JSON value ``text`` writes (failing that, with ``python``, the Python literal it writes, as JSON
    would read it back), or a marker that :func:`is_value` tells apart."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        if not python:
            return _NOT_A_VALUE
        try:
            value = ast.literal_eval(text)
        except _LITERAL_ERRORS:
            return _NOT_A_VALUE
    if json_text(value) is None:
        return _NOT_A_VALUE
    return json.loads(json_text(value))  # tuples as lists, keys as strings


def is_value(value: Any) -> bool:
    """Whether :func:`literal` found a value."""
    return value is not _NOT_A_VALUE


def typed_value(text: str, schema: Any) -> Any:
    """The value ``text`` writes for a parameter of ``schema`` (see the module's docstring)."""
    types = schema_types(schema)
    if types == {'string'}:
        return text
    value = literal(text.strip(), python=bool(types))
    if not is_value(value):
        return text
    kind = _json_type(value)
    if not types or kind in types or (kind == 'integer' and 'number' in types):
        return value
    return text
