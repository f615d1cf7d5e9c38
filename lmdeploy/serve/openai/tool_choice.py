"""How a chat request uses its ``tools``: what the chat template gets, which grammar forces a call
(``tool_choice`` ``required`` or a named function) and which parser reads the calls in the reply."""
from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial
from typing import Any

import jsonschema
from pydantic import ValidationError

from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.protocol import (MAX_JSON_DEPTH, ChatCompletionRequest, ChatTool, MalformedJSON,
                                           NamedToolChoice, check_json)
from lmdeploy.serve.openai.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser

EMPTY_PARAMETERS = {'type': 'object', 'properties': {}}


@dataclass
class ToolPlan:
    """``template_tools`` go to the chat template; ``response_format`` (if any) forces the reply to be
    calls; ``make_parser`` gives each choice its parser (None: the reply is plain content);
    ``max_calls`` keeps the calls after the first out without ``parallel_tool_calls``;
    ``markers`` are those the parser reads."""

    template_tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    make_parser: Callable[[], ToolParser] | None = None
    max_calls: int | None = None
    markers: tuple[str, ...] = ()


def _check_tools(tools: list[ChatTool]) -> None:
    seen = set()
    for i, tool in enumerate(tools):
        name, params = tool.function.name, tool.function.parameters
        if name in seen:
            raise APIError(400, f'tools[{i}]: a second function named {name!r}; names must be unique',
                           f'tools.{i}.function.name')
        seen.add(name)
        if params is None:
            continue
        try:
            jsonschema.Draft202012Validator.check_schema(params)
        except jsonschema.SchemaError as exc:
            raise APIError(400, f'tools[{i}] ({name!r}): parameters is not a valid JSON schema: {exc.message}',
                           f'tools.{i}.function.parameters') from exc


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a reply that calls one (or, ``parallel``, several) of ``tools``."""
    calls = [{'type': 'object', 'properties': {'name': {'type': 'string', 'enum': [t.function.name]},
                                               'parameters': _parameters(t)},
              'required': ['name', 'parameters']} for t in tools]
    return {'type': 'array', 'minItems': 1, **({} if parallel else {'maxItems': 1}), 'items': {'anyOf': calls}}


def _tool_choice(value: str | dict[str, Any] | None, tools: list[ChatTool]) -> str | NamedToolChoice:
    if value is None:
        return 'auto' if tools else 'none'
    if isinstance(value, str):
        if value not in ('none', 'auto', 'required'):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or "
                           f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}', 'tool_choice')
        return value
    try:
        return NamedToolChoice.model_validate(value)
    except ValidationError as exc:
        raise APIError(400, 'tool_choice must be \'none\', \'auto\', \'required\' or '
                       f'{{"type": "function", "function": {{"name": ...}}}}: {exc.errors()[0]["msg"]}',
                       'tool_choice') from exc


def plan_tools(req: ChatCompletionRequest, parser: type[ToolParser] | None,
               special_markers: Collection[str]) -> ToolPlan:
    """Checks ``tools`` and ``tool_choice`` (bad ones are a 400) and says how the request uses them.

    ``parser`` is the server's ``--tool-call-parser`` (None: none configured); it gets the tools, whose
    schemas type the arguments of the formats that write them as text, and ``special_markers`` (see
    :class:`ToolParser`)."""
    tools = req.tools or []
    choice = _tool_choice(req.tool_choice, tools)
    if not tools:
        if choice == 'required' or isinstance(choice, NamedToolChoice):
            raise APIError(400, 'tool_choice requires tools', 'tool_choice')
        return ToolPlan()
    _check_tools(tools)
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    max_calls = None if req.parallel_tool_calls else 1
    if choice == 'none':
        return ToolPlan(template_tools)
    if choice == 'auto':
        if parser is None:
            raise APIError(400, "tool_choice 'auto' needs a tool call parser: start the server with "
                           "--tool-call-parser (or send tool_choice 'required', 'none' or a named function)",
                           'tool_choice')
        return ToolPlan(template_tools, None, partial(parser, template_tools, special_markers), max_calls,
                        parser.markers)
    if choice == 'required':
        schema = required_schema(tools, req.parallel_tool_calls)
        return ToolPlan(template_tools, _json_schema('tool_calls', schema), RequiredToolParser, max_calls)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise APIError(400, f'tool_choice names the function {choice.function.name!r}, which is not in tools '
                       f'({", ".join(repr(t.function.name) for t in tools)})', 'tool_choice.function.name')
    name = tool.function.name
    return ToolPlan(template_tools, _json_schema(name, _parameters(tool)), lambda: NamedToolParser(name))


def _json_schema(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {'type': 'json_schema', 'json_schema': {'name': name, 'schema': schema, 'strict': True}}


def template_messages(messages: list[dict[str, Any]], developer_as_system: bool = False) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: an assistant's tool-call arguments as objects, not
    the JSON text OpenAI sends; with ``developer_as_system`` (for a template that has no ``developer`` role),
    OpenAI's ``developer`` messages as ``system`` ones. A malformed ``tool_calls`` is a 400, and so are
    arguments whose JSON a body could not hold (see :func:`check_json`)."""
    out = []
    for i, message in enumerate(messages):
        if developer_as_system and isinstance(message, dict) and message.get('role') == 'developer':
            message = {**message, 'role': 'system'}
        calls = message.get('tool_calls') if isinstance(message, dict) else None
        if calls is not None:
            if not isinstance(calls, list):
                raise APIError(400, f'messages[{i}].tool_calls must be a list', f'messages.{i}.tool_calls')
            message = {**message, 'tool_calls': [_template_call(call, f'messages.{i}.tool_calls.{j}')
                                                 for j, call in enumerate(calls)]}
        out.append(message)
    return out


def _template_call(call: Any, param: str) -> dict[str, Any]:
    function = call.get('function') if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get('name'), str):
        raise APIError(400, f'{param} must be {{"type": "function", "function": {{"name": str, "arguments": str}}}}',
                       param)
    arguments = function.get('arguments')
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        except RecursionError:
            raise APIError(400, f'{param}.function.arguments nests JSON deeper than {MAX_JSON_DEPTH} levels',
                           f'{param}.function.arguments') from None
        try:  # the arguments go to the chat template as they are read, as a body's JSON would
            check_json(parsed)
        except MalformedJSON as exc:
            raise APIError(400, f'{param}.function.arguments: {exc}', f'{param}.function.arguments') from None
        if isinstance(parsed, dict):
            return {**call, 'function': {**function, 'arguments': parsed}}
    return call
