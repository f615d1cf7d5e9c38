"""Public configuration and result types: GenerationConfig, PytorchEngineConfig, ChatTemplateConfig, Response."""
from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np

MAX_NEW_TOKENS_LIMIT = 1 << 20
# Sampling at a lower temperature is greedy (as in vLLM): 1 / temperature would overflow the logits.
MIN_SAMPLING_TEMPERATURE = 1e-5


class ConfigError(ValueError):
    """A config field or a tool's argument out of its range, a model a tool does not take, or model files that
    cannot be served (truncated, corrupt, incomplete); the message says which (the command line prints it as one
    line)."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` passes ``isinstance(x, int)``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _plain(value: Any) -> Any:
    """``value`` with numpy scalars (itself, a list's or tuple's items, a dict's keys and values) made Python's,
    so that ``np.int64(32)`` passes as an int and ``np.bool_(True)`` as a bool."""
    def scalar(v: Any) -> Any:
        return v.item() if isinstance(v, np.generic) else v

    if isinstance(value, (list, tuple)):
        return type(value)(scalar(v) for v in value)
    if isinstance(value, dict):
        return {scalar(k): scalar(v) for k, v in value.items()}
    return scalar(value)


def _plain_fields(config: Any) -> None:
    for f in fields(config):
        setattr(config, f.name, _plain(getattr(config, f.name)))


@dataclass
class GenerationConfig:
    """Per-request generation parameters (names follow LMDeploy).

    Greedy decoding is used when ``do_sample`` is False, ``top_k == 1`` or ``temperature`` is below
    :data:`MIN_SAMPLING_TEMPERATURE` (1e-5). ``random_seed`` is an int in [-2**63, 2**64) (torch takes it
    modulo 2**64).

    ``prompt_logprobs=N`` also returns, in the first output, the logprob of each prompt token after the
    first (plus the top N tokens at its position), computed in the request's own prefill, which then
    reuses no prefix-cache blocks.

    ``response_format`` constrains the output with a grammar (xgrammar), one of
    ``{'type': 'json_object'}``, ``{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}``,
    ``{'type': 'regex', 'regex': '...'}``, ``{'type': 'choice', 'choice': ['a', 'b']}`` or
    ``{'type': 'grammar', 'grammar': '<EBNF>'}``; ``{'type': 'text'}`` is the same as None. With
    ``response_format_after`` (a reasoning model's ``'</think>'``), the grammar applies only to the output
    after that marker; with ``response_format_opener`` as well (``'<think>'``, for a reply that may or may not
    open a reasoning block), only when the output starts with the opener, and from its start otherwise.

    ``logit_bias`` maps token ids (ints, or their decimal strings as JSON gives them) to biases in [-100, 100].

    ``keep_special_tokens`` are special tokens that stay in the text although ``skip_special_tokens``
    drops the others (the server's harmony parsers read gpt-oss's channel markers this way).
    """

    max_new_tokens: int = 512
    do_sample: bool = False
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 0.8
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    random_seed: int | None = None
    stop_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    keep_special_tokens: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    response_format: dict[str, Any] | None = None
    response_format_after: str | None = None
    response_format_opener: str | None = None

    def __post_init__(self):
        _plain_fields(self)
        if isinstance(self.stop_words, str):
            self.stop_words = [self.stop_words]
        for name in ('do_sample', 'ignore_eos', 'skip_special_tokens', 'include_stop_str_in_output'):
            value = getattr(self, name)
            _check(isinstance(value, bool), f'{name} must be True or False, got {value!r}')
        for name in ('stop_words', 'stop_token_ids', 'keep_special_tokens'):
            value = getattr(self, name)
            _check(value is None or isinstance(value, (list, tuple)), f'{name} must be None or a list, got {value!r}')
            if isinstance(value, tuple):
                setattr(self, name, list(value))
        self.response_format = _check_response_format(self.response_format)
        for name in ('response_format_after', 'response_format_opener'):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value), f'{name} must be None or a non-empty str')
        _check(self.response_format_opener is None or self.response_format_after is not None,
               'response_format_opener needs response_format_after (the marker that closes what it opens)')
        _check(_is_int(self.max_new_tokens) and 0 < self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT,
               f'max_new_tokens must be an int in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens!r}')
        _check(_is_int(self.top_k) and self.top_k >= 0,
               f'top_k must be an int >= 0 (0 disables it), got {self.top_k!r}')
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, f'top_p must be in (0, 1], got {self.top_p!r}')
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, f'min_p must be in [0, 1], got {self.min_p!r}')
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               f'temperature must be in [0, 100], got {self.temperature!r}')
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 100.0,
               f'repetition_penalty must be in (0, 100], got {self.repetition_penalty!r}')
        _check(_is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
               f'presence_penalty must be in [-2, 2], got {self.presence_penalty!r}')
        _check(_is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
               f'frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}')
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {int(t) if isinstance(t, str) and t.isascii() and t.isdigit() and len(t) <= 18 else t: b
                               for t, b in self.logit_bias.items()}
        _check(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            _is_int(t) and t >= 0 and _is_number(b) and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items())),
            'logit_bias must be None or a dict of token ids (ints >= 0, or their decimal strings) to biases in '
            f'[-100, 100], got {str(self.logit_bias)[:80]}')
        _check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
               f'min_new_tokens must be an int in [0, max_new_tokens], got {self.min_new_tokens!r}')
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f'logprobs must be None or an int in [0, 20], got {self.logprobs!r}')
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               f'prompt_logprobs must be None or an int in [0, 20], got {self.prompt_logprobs!r}')
        _check(_is_int(self.n) and 1 <= self.n <= 128, f'n must be an int in [1, 128], got {self.n!r}')
        _check(self.stop_words is None or all(isinstance(w, str) and w for w in self.stop_words),
               'stop_words must be a list of non-empty strings')
        _check(self.keep_special_tokens is None or all(isinstance(t, str) and t for t in self.keep_special_tokens),
               'keep_special_tokens must be a list of non-empty strings')
        _check(self.stop_token_ids is None or all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               'stop_token_ids must be a list of non-negative ints')
        _check(self.random_seed is None or (_is_int(self.random_seed) and -2 ** 63 <= self.random_seed < 2 ** 64),
               f'random_seed must be None or an int in [-2**63, 2**64), got {self.random_seed!r}')

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample or self.top_k == 1 or self.temperature < MIN_SAMPLING_TEMPERATURE


_FORMAT_FIELDS = {'json_object': None, 'json_schema': dict, 'regex': str, 'choice': list, 'grammar': str}


def _check_response_format(fmt: Any) -> dict[str, Any] | None:
    """The response format with its value checked (a JSON schema given as text parsed); None for plain text."""
    if fmt is None:
        return None
    _check(isinstance(fmt, dict) and (fmt.get('type') == 'text' or fmt.get('type') in _FORMAT_FIELDS),
           f"response_format must be a dict whose 'type' is one of 'text', {', '.join(map(repr, _FORMAT_FIELDS))}; "
           f'got {str(fmt)[:80]!r}')
    kind = fmt['type']
    if kind == 'text':
        return None
    field_type = _FORMAT_FIELDS[kind]
    if field_type is None:
        return dict(fmt)
    value = fmt.get(kind)
    _check(isinstance(value, field_type) and bool(value),
           f"response_format {kind!r} needs a non-empty {field_type.__name__} in its {kind!r} field")
    if kind == 'json_schema':
        schema = value.get('schema')
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f'response_format json_schema.schema is not valid JSON: {exc}') from None
        _check(isinstance(schema, (dict, bool)), "response_format json_schema needs a JSON schema in 'schema'")
        return {**fmt, 'json_schema': {**value, 'schema': schema}}
    if kind == 'choice':
        _check(all(isinstance(c, str) and c for c in value), 'response_format choice must list non-empty strings')
    return dict(fmt)


@dataclass
class PytorchEngineConfig:
    """Engine settings.

    ``cache_max_entry_count`` is the fraction of free memory (GPU) or available RAM (CPU) that the
    KV cache may take; on CPU it is also capped by ``max_cache_bytes``.

    ``decode_int4`` (CPU, bfloat16): steps of at most a few tokens (batch-1 decode) run the linear
    layers on 4-bit group-wise weights with torch's int4 CPU kernel, and a single row's LM head on an
    fp16 copy of its weight; bigger steps keep the bf16 weights. None (auto) turns it on for GGUF
    models whose linear weights are Q4_1, whose 4-bit grid it reproduces exactly; True also quantizes
    other models (round-to-nearest, lossy); False turns it off.

    On CUDA, decode steps replay CUDA graphs captured per padded batch size (1, 2, 4, 8, 16, 24, 32,
    then steps of 16, up to ``max_batch_size``); ``eager_mode=True`` runs every step eagerly instead.
    ``load_format='dummy'`` fills the weights with random values on the device instead of reading
    weight files (the folder needs only its config and tokenizer; a quantized checkpoint's integer codes
    and scales with zeros): for measuring speed at a model's shape without its checkpoint.

    ``overlap_schedule`` queues each step on the device before the previous step's tokens reach the
    host, so that scheduling and input building overlap the device's work (None: on for CUDA, where
    the device runs asynchronously; on the CPU there is nothing to overlap). Outputs are the same.

    ``quant_policy`` quantizes the KV cache: 0 keeps it in the model dtype, 8 stores K and V as int8 and
    4 as int4 (two codes per byte), each token's row of each KV head with its own fp32 scale and zero
    point (asymmetric min/max, LMDeploy's scheme); the cache then holds about 1.8x (int8) or 3x (int4)
    as many tokens of a bf16 model (see docs/quantization.md). Multi-head latent attention (DeepSeek-V2/V3)
    quantizes each token's latent and rotary key the same way, each with its own scale and zero point.

    ``tp`` splits the model over that many tensor-parallel ranks (see docs/scale_out.md): this process
    is rank 0 and ``distributed_executor_backend`` runs the others, ``'mp'`` as processes on this
    machine, ``'ray'`` as Ray actors (``pip install 'lmdeploy[ray]'``), on this machine or across a
    Ray cluster, where ``ray_placement_strategy`` places the ranks: ``'PACK'`` fills this machine first,
    ``'SPREAD'`` puts them on as many machines as it can. On the CPU each rank on a machine computes on
    its own share of the cores (``num_threads`` threads each; None or 0: one per core of its share).

    ``grammar_cache_mb`` bounds the compiled grammars (response formats, forced tool calls) kept for reuse, in
    MiB (as vLLM's ``VLLM_XGRAMMAR_CACHE_MB``): the least recently used is dropped first, a grammar larger than
    the bound is not kept, and 0 keeps none (every format compiles each time it is asked for).
    """

    dtype: Literal['auto', 'float32', 'bfloat16', 'float16'] = 'auto'
    session_len: int | None = None
    max_batch_size: int = 64
    cache_max_entry_count: float = 0.5
    max_cache_bytes: int = 4 << 30
    num_gpu_blocks: int = 0
    block_size: int = 64
    max_prefill_token_num: int = 4096
    enable_prefix_caching: bool = True
    tp: int = 1
    distributed_executor_backend: Literal['mp', 'ray'] = 'mp'
    ray_placement_strategy: Literal['PACK', 'SPREAD'] = 'PACK'
    device: str = 'cpu'
    num_threads: int | None = None
    decode_int4: bool | None = None
    eager_mode: bool = False
    overlap_schedule: bool | None = None
    load_format: Literal['auto', 'dummy'] = 'auto'
    quant_policy: Literal[0, 4, 8] = 0
    grammar_cache_mb: int = 512

    def __post_init__(self):
        _plain_fields(self)
        _check(self.dtype in ('auto', 'float32', 'bfloat16', 'float16'),
               f"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16', got {self.dtype!r}")
        for name in ('enable_prefix_caching', 'eager_mode', 'decode_int4', 'overlap_schedule'):
            value = getattr(self, name)
            _check(isinstance(value, bool) or (value is None and name in ('decode_int4', 'overlap_schedule')),
                   f'{name} must be True or False, got {value!r}')
        for name in ('session_len', 'max_batch_size', 'max_cache_bytes', 'num_gpu_blocks', 'block_size',
                     'max_prefill_token_num', 'num_threads', 'grammar_cache_mb'):
            value = getattr(self, name)
            _check((value is None and name in ('session_len', 'num_threads')) or _is_int(value),
                   f'{name} must be an int, got {value!r}')
        _check(self.session_len is None or self.session_len > 0, 'session_len must be positive')
        _check(self.max_batch_size > 0, 'max_batch_size must be positive')
        _check(self.num_threads is None or self.num_threads >= 0,
               'num_threads must be >= 0 (None or 0: one per core of the share)')
        _check(_is_number(self.cache_max_entry_count) and 0.0 < self.cache_max_entry_count <= 1.0,
               'cache_max_entry_count must be in (0, 1]')
        _check(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
               f'block_size must be a power of two, got {self.block_size}')
        _check(self.max_prefill_token_num >= self.block_size, 'max_prefill_token_num must be >= block_size')
        _check(self.num_gpu_blocks >= 0, 'num_gpu_blocks must be >= 0 (0 means size from memory)')
        _check(self.grammar_cache_mb >= 0, f'grammar_cache_mb must be >= 0 (0: no grammar cache), got '
               f'{self.grammar_cache_mb}')
        _check(isinstance(self.tp, int) and self.tp >= 1, f'tp must be a positive integer, got {self.tp!r}')
        _check(self.distributed_executor_backend in ('mp', 'ray'),
               f"distributed_executor_backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}")
        _check(self.ray_placement_strategy in ('PACK', 'SPREAD'),
               f"ray_placement_strategy must be 'PACK' or 'SPREAD', got {self.ray_placement_strategy!r}")
        _check(self.load_format in ('auto', 'dummy'), f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        _check(self.quant_policy in (0, 4, 8) and not isinstance(self.quant_policy, bool),
               f'quant_policy must be 0 (off), 4 (int4 KV cache) or 8 (int8 KV cache), got {self.quant_policy!r}')


@dataclass
class ChatTemplateConfig:
    """Overrides the model's chat template: ``chat_template`` is Jinja text or the path of a file holding it."""

    chat_template: str | None = None

    def __post_init__(self):
        _check(self.chat_template is None or (isinstance(self.chat_template, str) and self.chat_template.strip()),
               'chat_template must be None or a non-empty str (Jinja text or a file path)')
        if self.chat_template and os.path.isfile(self.chat_template):
            with open(self.chat_template, encoding='utf-8') as f:
                self.chat_template = f.read()


FinishReason = Literal['stop', 'length', 'abort', 'error']


@dataclass
class Response:
    """The result of one prompt (or one streamed chunk of it).

    ``prompt_logprobs`` (with ``GenerationConfig.prompt_logprobs``, in the first chunk) has one entry per
    prompt token: None for the first, which nothing predicts, then ``{token_id: logprob}`` of the token
    and the top tokens at its position.

    With a reasoning parser (``pipeline(reasoning_parser=...)``, by default the model's own: harmony for
    gpt-oss), ``text`` is the answer and ``reasoning_content`` the reasoning before it ('' when there was
    none; a streamed chunk's are its shares of both), and ``reasoning_tokens`` how many of the reply's tokens
    are reasoning, without the markers around it (OpenAI's ``completion_tokens_details.reasoning_tokens``; in a
    stream, the last chunk's); without one, both are None.
    """

    text: str
    generate_token_len: int
    input_token_len: int
    finish_reason: FinishReason | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    index: int = 0
    cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    reasoning_content: str | None = None
    reasoning_tokens: int | None = None

    def extend(self, chunk: Response) -> None:
        """Adds a streamed chunk of the same prompt: text, reasoning and tokens grow, counts and finish_reason
        follow it."""
        self.text += chunk.text
        if chunk.reasoning_content is not None:
            self.reasoning_content = (self.reasoning_content or '') + chunk.reasoning_content
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = (self.logprobs or []) + chunk.logprobs
        self.prompt_logprobs = self.prompt_logprobs or chunk.prompt_logprobs
        self.generate_token_len = max(self.generate_token_len, chunk.generate_token_len)
        self.input_token_len = chunk.input_token_len
        self.cached_tokens = chunk.cached_tokens
        self.finish_reason = chunk.finish_reason
        self.error = chunk.error
        if chunk.reasoning_tokens is not None:
            self.reasoning_tokens = chunk.reasoning_tokens


@dataclass
class EngineOutput:
    """Incremental output of one request from one engine step."""

    seq_id: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
