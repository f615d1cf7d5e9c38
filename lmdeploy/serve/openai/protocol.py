"""Pydantic request and response models of the OpenAI-compatible server.

Unknown request fields are ignored, as OpenAI does; every known field is either honoured or
rejected with a 400.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator
from pydantic_core import PydanticCustomError

from lmdeploy.messages import MAX_NEW_TOKENS_LIMIT

# How deep a request body's JSON may nest (the body itself is level 1): the chat template, JSON-schema checks
# and grammar compilation recurse over nested values and would run out of stack on deeper ones.
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile('[\ud800-\udfff]')


def random_id(prefix: str) -> str:
    return f'{prefix}-{uuid.uuid4().hex[:24]}'


class MalformedJSON(ValueError):
    """A request body :func:`check_json` refuses; ``field`` is the top-level field that holds the fault."""

    def __init__(self, message: str, field: str | None):
        super().__init__(f'{field}: {message}' if field else message)
        self.field = field


def check_json(body: Any) -> None:
    """Raises :class:`MalformedJSON` for a body nested deeper than :data:`MAX_JSON_DEPTH`, or holding a string
    (or key) with a lone UTF-16 surrogate: JSON may escape one (``"\\ud800"``), but no text holds it, so
    nothing downstream (tokenizer, chat template, grammar) could take it."""
    stack = [(body, 1, None)]
    while stack:
        value, depth, field = stack.pop()
        if isinstance(value, str):
            _check_text(value, field)
            continue
        if not isinstance(value, (dict, list)):  # the body itself may be anything
            continue
        if depth > MAX_JSON_DEPTH:
            raise MalformedJSON(f'the request nests JSON deeper than {MAX_JSON_DEPTH} levels', field)
        if isinstance(value, list):
            stack += [(item, depth + 1, field) for item in value if isinstance(item, (str, dict, list))]
            continue
        for key, item in value.items():
            _check_text(key, field)
            if isinstance(item, (str, dict, list)):
                stack.append((item, depth + 1, field or key))


def _check_text(text: str, field: str | None) -> None:
    found = _SURROGATE.search(text)
    if found:
        raise MalformedJSON(f'a string holds a lone UTF-16 surrogate ({found.group()!a}); send valid Unicode text',
                            field)


class RequestBody(BaseModel):
    """A request body: well-formed (see :func:`check_json`) before its fields are validated. A top-level field
    sent as ``null`` is left out, so that it takes its default, as OpenAI reads its nullable fields (the
    official client sends ``temperature=None`` as ``null``)."""

    @model_validator(mode='before')
    @classmethod
    def _well_formed(cls, data: Any) -> Any:
        try:
            check_json(data)
        except MalformedJSON as exc:
            raise PydanticCustomError('malformed_json', '{message}',
                                      {'message': str(exc), 'param': exc.field}) from None
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(BaseModel):
    """``include_usage``: a last chunk with ``usage`` and no choices; ``continuous_usage_stats`` (vLLM's):
    also every chunk carries its choice's usage so far."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = 'response'
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias='schema')
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (with ``json_schema``)."""

    type: Literal['text', 'json_object', 'json_schema'] = 'text'
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema, or its text), ``regex``,
    ``choice``, ``grammar`` (EBNF) or ``json_object``."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(None, alias='json')
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The structured-output fields of chat and completion requests. ``guided_json``, ``guided_regex``,
    ``guided_choice`` and ``guided_grammar`` are vLLM's older names of ``structured_outputs``' keys, read as
    those."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode='after')
    def _guided(self) -> StructuredFields:
        guided = {key: value for key, value in [('json', self.guided_json), ('regex', self.guided_regex),
                                                ('choice', self.guided_choice), ('grammar', self.guided_grammar)]
                  if value is not None}
        if guided:
            if self.structured_outputs is not None:
                raise PydanticCustomError('guided_and_structured_outputs',
                                          'guided_json, guided_regex, guided_choice and guided_grammar (vLLM\'s older '
                                          'names) cannot go with structured_outputs; send one of them',
                                          {'param': 'structured_outputs'})
            self.structured_outputs = StructuredOutputs.model_validate(guided)
        return self


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal['function'] = 'function'
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal['function'] = 'function'
    function: NamedFunction


class SamplingFields(RequestBody):
    """Fields shared by chat and completion requests."""

    model: str
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None
    seed: int | None = Field(None, ge=-2 ** 63, lt=2 ** 64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    session_id: int | None = Field(None, ge=0)
    # vLLM's fields that would change the reply and that this server does not implement: refused, not ignored
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: list[Any] | None = None

    def unsupported_fields(self) -> list[str]:
        """Those of vLLM's fields above that the request sets to a value other than their default's."""
        names = ('use_beam_search', 'allowed_token_ids', 'bad_words', 'prompt_logprobs', 'truncate_prompt_tokens',
                 'logits_processors')
        return [name for name in names if not (getattr(self, name) is None or getattr(self, name) is False
                                               or getattr(self, name) == [])]


class ChatCompletionRequest(SamplingFields, StructuredFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal['none', 'minimal', 'low', 'medium', 'high'] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI fields this server cannot honour, refused rather than ignored (see serving_chat._check)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None


class CompletionRequest(SamplingFields, StructuredFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=128)
    max_tokens: int | None = Field(16, ge=1, le=MAX_NEW_TOKENS_LIMIT)


class GenerateRequest(SamplingFields):
    """Native ``/generate``: a prompt (chat-templated unless ``do_preprocess`` is False) or token ids."""

    model: str | None = None
    prompt: str | list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    do_preprocess: bool = True
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    logprobs: int | None = Field(None, ge=0, le=20)


class EncodeRequest(RequestBody):
    input: str | list[str]
    do_preprocess: bool = False
    add_bos: bool = True


class AbortRequest(RequestBody):
    session_id: int | None = Field(None, ge=0)
    abort_all: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # a chat reply's, with a reasoning parser


class ModelCard(BaseModel):
    id: str
    object: str = 'model'
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = 'lmdeploy'


class ModelList(BaseModel):
    object: str = 'list'
    data: list[ModelCard]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal['function'] = 'function'
    function: FunctionCall


class ChatMessage(BaseModel):
    role: str | None = 'assistant'
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage | None = None
    delta: ChatMessage | None = None
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal['chat.completion', 'chat.completion.chunk'] = 'chat.completion'
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal['text_completion'] = 'text_completion'
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
