"""Structured output: a request's ``response_format`` or ``structured_outputs`` as the engine's
``GenerationConfig.response_format``, checked and compiled before the request starts."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from lmdeploy.messages import GenerationConfig
from lmdeploy.serve.exceptions import SafeRunException
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import RequestLimits, flag
from lmdeploy.serve.openai.protocol import StructuredFields, StructuredOutputs, check_json
from lmdeploy.serve.openai.reasoning_parsers import ReasoningParser

Format = dict[str, Any]


def requested_format(req: StructuredFields) -> tuple[Format | None, str | None]:
    """The response format a request asks for (None: free text) and the field that asks for it."""
    fmt, outputs = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != 'text' and outputs is not None:
        raise APIError(400, 'response_format and structured_outputs cannot be combined; send one of them',
                       'structured_outputs')
    if outputs is not None:
        return _structured_outputs(outputs), 'structured_outputs'
    if fmt is None or fmt.type == 'text':
        return None, None
    if fmt.type == 'json_object':
        return {'type': 'json_object'}, 'response_format'
    spec = fmt.json_schema
    if spec is None or spec.schema_ is None:
        raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema (a JSON schema)",
                       'response_format.json_schema')
    return {'type': 'json_schema', 'json_schema': {'name': spec.name, 'schema': spec.schema_,
                                                   'strict': bool(spec.strict)}}, 'response_format'


def _structured_outputs(outputs: StructuredOutputs) -> Format:
    given = {name: value for name, value in [('json', outputs.json_), ('regex', outputs.regex),
                                             ('choice', outputs.choice), ('grammar', outputs.grammar),
                                             ('json_object', outputs.json_object or None)] if value is not None}
    if len(given) != 1:
        raise APIError(400, 'structured_outputs needs exactly one of json, regex, choice, grammar, json_object; '
                       f'got {", ".join(given) or "none"}', 'structured_outputs')
    (kind, value), = given.items()
    if kind == 'json':
        if isinstance(value, str):
            try:
                value = json.loads(value)
                check_json(value)
            except (ValueError, RecursionError) as exc:  # MalformedJSON too: nested deeper than a body may be
                raise APIError(400, f'structured_outputs.json is not valid JSON: {exc}',
                               'structured_outputs.json') from exc
        return {'type': 'json_schema', 'json_schema': {'name': 'structured_outputs', 'schema': value}}
    if kind == 'json_object':
        return {'type': 'json_object'}
    return {'type': kind, kind: value}


def with_format(config: GenerationConfig, fmt: Format | None, reasoning: ReasoningParser | None, param: str | None
                ) -> GenerationConfig:
    """``config`` constrained to ``fmt`` (applying to the answer after the reasoning that ``reasoning``, the
    reply's parser, reads); a malformed one is a 400."""
    if fmt is None:
        return config
    after = reasoning.grammar_after() if reasoning else None
    try:
        return dataclasses.replace(config, response_format=fmt, response_format_after=after,
                                   response_format_opener=reasoning.grammar_opener() if after else None)
    except ValueError as exc:
        raise APIError(400, str(exc), param) from exc


async def compile_format(engine: Any, config: GenerationConfig, param: str | None, limits: RequestLimits) -> None:
    """Compiles ``config``'s grammar (cached by the engine); one that cannot compile, or not within
    ``--max-grammar-compile-seconds``, is a 400 with the reason. (``check_grammar_cost`` bounds the compile time
    before admission.)"""
    if config.response_format is None:
        return
    seconds = limits.max_grammar_compile_seconds
    try:
        await engine.compile_grammar(config, seconds)
    except SafeRunException as exc:
        raise APIError(exc.code.http_status, exc.message, param, exc.code.value[0]) from exc
    except TimeoutError:
        raise APIError(400, f'the response format did not compile within {seconds} s (the server\'s '
                       f'{flag("max_grammar_compile_seconds")} is {seconds}); simplify it: fewer enum values, choices '
                       'or properties, lower regex repetition bounds', param,
                       'max_grammar_compile_seconds_exceeded') from None
