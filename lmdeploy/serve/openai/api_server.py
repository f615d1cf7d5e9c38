"""The OpenAI-compatible HTTP server: :func:`create_app` builds the FastAPI app, :func:`run_server` runs it."""
from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from lmdeploy.serve.async_engine import AsyncEngine, request_owner
from lmdeploy.serve.openai.admission import Admission
from lmdeploy.serve.openai.errors import (APIError, document_errors, error_response, error_responses,
                                          install_error_handlers)
from lmdeploy.serve.openai.limits import BodyLimitMiddleware, RequestLimits
from lmdeploy.serve.openai.metrics import Metrics
from lmdeploy.serve.openai.protocol import (AbortRequest, ChatCompletionRequest, ChatCompletionResponse,
                                            CompletionRequest, CompletionResponse, EncodeRequest, GenerateRequest,
                                            ModelCard, ModelList)
from lmdeploy.serve.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from lmdeploy.serve.openai.serving_chat import create_chat_completion
from lmdeploy.serve.openai.serving_common import ServerState, check_model, sampling_defaults
from lmdeploy.serve.openai.serving_completion import create_completion
from lmdeploy.serve.openai.serving_native import abort_request, encode_text, generate
from lmdeploy.serve.openai.tool_parsers import ToolParser, get_tool_parser
from lmdeploy.serve.openai.web_ui import mount_web_ui
from lmdeploy.serve.reasoning import MODEL_PARSERS
from lmdeploy.tokenizer import Tokenizer

logger = logging.getLogger('lmdeploy')
AUTH_EXEMPT = frozenset({'/health'})
# The engine-loop thread gives up the GIL inside every torch op and needs it back after each; while
# the event loop is busy streaming, Python's default 5 ms interval left it waiting that long.
GIL_SWITCH_INTERVAL = 0.0005


def _bearer_key(headers: list[tuple[bytes, bytes]], keys: list[bytes]) -> bytes | None:
    """The key of ``keys`` that the ``Authorization: Bearer`` header carries, or None."""
    auth = dict(headers).get(b'authorization', b'')
    scheme, _, token = auth.partition(b' ')
    if scheme.lower() != b'bearer':
        return None
    token = token.strip()
    found = None
    for key in keys:  # compare with every key, so that the time taken does not tell which one matched
        if hmac.compare_digest(token, key):
            found = key
    return found


def key_owner(key: bytes) -> str:
    """The owner id of requests made with ``key``: a digest, so that the key itself is kept nowhere else."""
    return hashlib.sha256(b'lmdeploy-request-owner:' + key).hexdigest()


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` with one of ``api_keys`` on every HTTP request and websocket
    (except on ``public_paths``: ``/health``, and the chat page's files, which ask for a key themselves); the
    requests it lets in run with :data:`request_owner` set to the key's owner id.
    CORS preflights never get here: the CORS middleware, outside this one, answers them."""

    def __init__(self, app: ASGIApp, api_keys: list[str], public_paths: frozenset[str] = AUTH_EXEMPT):
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] not in ('http', 'websocket') or scope['path'] in self.public_paths:
            await self.app(scope, receive, send)
            return
        key = _bearer_key(scope['headers'], self.api_keys)
        if key is None:
            if scope['type'] == 'websocket':
                await send({'type': 'websocket.close', 'code': 1008})
                return
            response = error_response(401, 'missing or invalid API key (send Authorization: Bearer <key>)',
                                      code='invalid_api_key', headers={'WWW-Authenticate': 'Bearer'})
            await response(scope, receive, send)
            return
        token = request_owner.set(key_owner(key))
        try:
            await self.app(scope, receive, send)
        finally:
            request_owner.reset(token)


def streamed(model: type[BaseModel] | None = None) -> dict:
    """The OpenAPI 200 of a route that answers JSON (``model``), or server-sent events with ``stream: true``."""
    return {'description': 'The response (JSON), or server-sent events with stream: true',
            **({'model': model} if model else {}),
            'content': {'text/event-stream': {'schema': {'type': 'string'}}}}


def _parsers(engine: AsyncEngine, tool_name: str | None, reasoning_name: str | None
             ) -> tuple[type[ToolParser] | None, type[ReasoningParser] | None]:
    """The tool and reasoning parser classes the server uses (see :func:`create_app`)."""
    if tool_name is None and reasoning_name is None:
        tool_name, reasoning_name = MODEL_PARSERS.get(engine.engine.model_config.hf_config.model_type, (None, None))
    tools = get_tool_parser(tool_name) if tool_name else None
    reasoning = get_reasoning_parser(reasoning_name) if reasoning_name else None
    needed = tools.reasoning_parser if tools else None
    if needed is not None:
        if reasoning is None:
            reasoning = get_reasoning_parser(needed)
        elif reasoning is not get_reasoning_parser(needed):
            raise ValueError(f'the tool call parser {tool_name!r} reads the content of the reasoning parser '
                             f'{needed!r}, not of {reasoning_name!r}')
    return tools, reasoning


def _special_markers(tokenizer: Tokenizer, *parsers: type[ToolParser] | type[ReasoningParser] | None
                     ) -> frozenset[str]:
    """The markers of ``parsers`` that ``tokenizer`` makes special tokens: those a reply's text decoded with
    ``skip_special_tokens`` leaves out."""
    special = set(tokenizer.special_token_ids.values())
    return frozenset(m for parser in parsers if parser is not None for m in parser.markers if m in special)


def create_app(engine: AsyncEngine, model_name: str | None = None, api_keys: list[str] | None = None,
               allow_origins: list[str] | None = None, allow_credentials: bool = False,
               allow_methods: list[str] | None = None, allow_headers: list[str] | None = None,
               max_concurrent_requests: int = 256, max_queue_size: int = 1024,
               heartbeat_timeout: float = 30.0, limits: RequestLimits | None = None,
               preprocess_workers: int = 2, admin_api_keys: list[str] | None = None,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               generation_config: str = 'auto', web_ui: bool = True) -> FastAPI:
    """An app serving ``engine``; each app has its own metrics registry. The caller owns (and closes) the
    engine; on shutdown the app aborts what is still in flight.

    ``max_concurrent_requests`` and ``max_queue_size`` count slots: a request takes one per generation it
    fans out to (n x prompts). ``limits`` bounds each request (see :class:`RequestLimits`);
    ``preprocess_workers`` threads tokenize and preprocess images of admitted requests.

    ``api_keys`` guard every endpoint but ``/health``; a session's request can then be aborted only with
    the key that started it. ``admin_api_keys`` are accepted wherever ``api_keys`` are and alone may
    ``abort_all`` (without them, ``abort_all`` is refused). Images load under the engine's
    ``MediaPolicy``, which by default allows no URL and no local file.

    ``tool_call_parser`` and ``reasoning_parser`` name the parsers (see ``TOOL_PARSERS`` and
    ``REASONING_PARSERS``) that read tool calls and reasoning out of chat replies; an unknown name raises
    ``ValueError``. Without either, a model type of ``lmdeploy.serve.reasoning.MODEL_PARSERS`` gets its parsers; a tool parser
    that reads a reasoning parser's content brings that one along.

    ``model_name`` defaults to the model's own name (``engine.model_name``). With ``generation_config``
    'auto', the sampling fields a chat or completion request leaves out come from the model's
    ``generation_config.json`` ('none': the OpenAI defaults). ``web_ui`` serves the chat page at ``/``."""
    tools, reasoning = _parsers(engine, tool_call_parser, reasoning_parser)
    limits = limits or RequestLimits()
    admission = Admission(max_concurrent_requests, max_queue_size)
    executor = ThreadPoolExecutor(preprocess_workers, thread_name_prefix='lmdeploy-preprocess')
    if generation_config not in ('auto', 'none'):
        raise ValueError(f"generation_config must be 'auto' or 'none', got {generation_config!r}")
    defaults = sampling_defaults(engine.model_dir) if generation_config == 'auto' else {}
    state = ServerState(engine, model_name or engine.model_name, admission,
                        Metrics(engine, lambda: admission.num_waiting), heartbeat_timeout, limits, executor,
                        tools, reasoning, defaults, _special_markers(engine.tokenizer, tools, reasoning))
    # Admitted slots are the only waiters for engine instances: bound that line too (defence in depth).
    insts = engine.inst_manager
    insts.max_waiting = max(insts.max_waiting or 0, max_concurrent_requests)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.stop_all_session()
        executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title='lmdeploy OpenAI-compatible server', lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    document_errors(app)
    auth = (401,) if api_keys else ()
    body = (413,) if limits.max_request_body_bytes is not None else ()
    generating = error_responses(400, *auth, 404, *body, 429, 500, 503)

    card = ModelCard(id=state.model_name)  # created: when the app was made, the same in every answer

    @app.get('/v1/models', responses=error_responses(*auth))
    async def list_models() -> ModelList:
        """The served model."""
        return ModelList(data=[card])

    @app.get('/v1/models/{model:path}', responses=error_responses(*auth, 404))
    async def retrieve_model(model: str) -> ModelCard:
        """The served model, by its name (``client.models.retrieve``); another name is a 404."""
        check_model(state, model)
        return card

    @app.post('/v1/chat/completions', responses={**generating, 200: streamed(ChatCompletionResponse)})
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        """OpenAI chat completions (streaming with ``stream: true``)."""
        return await create_chat_completion(state, req, raw)

    @app.post('/v1/completions', responses={**generating, 200: streamed(CompletionResponse)})
    async def completions(req: CompletionRequest, raw: Request):
        """OpenAI text completions (streaming with ``stream: true``)."""
        return await create_completion(state, req, raw)

    @app.post('/generate', responses={**generating, 200: streamed()})
    async def generate_endpoint(req: GenerateRequest, raw: Request):
        """Native generation from a prompt or token ids."""
        return await generate(state, req, raw)

    @app.post('/v1/encode', responses=error_responses(400, *auth, *body, 429))
    async def encode_endpoint(req: EncodeRequest, raw: Request) -> dict:
        """Token ids of a text or a list of texts."""
        return await encode_text(state, req, raw.receive)

    admin_keys = [key.encode() for key in admin_api_keys or ()]

    @app.post('/abort_request', responses=error_responses(400, *auth, 403, *body))
    async def abort_endpoint(req: AbortRequest, raw: Request) -> dict:
        """Aborts a session's request, or all requests (``abort_all``: admin keys only). With API keys, a
        session's request is aborted only for the key that started it (or an admin key)."""
        admin = bool(admin_keys) and _bearer_key(raw.scope['headers'], admin_keys) is not None
        if req.abort_all and not admin:
            raise APIError(403, 'abort_all is an admin action: send an admin API key (the server takes them '
                           'with --admin-api-keys)', 'abort_all', 'admin_key_required')
        if not req.abort_all and req.session_id is not None and api_keys and not admin:
            if not await engine.abort_session(req.session_id, owner=request_owner.get()):
                raise APIError(403, f'session {req.session_id} runs a request that was not started with your '
                               'API key', 'session_id', 'not_session_owner')
            return {'success': True}
        return await abort_request(state, req)

    @app.get('/health', responses=error_responses(503))
    async def health() -> Response:
        """200 while the engine loop runs and makes progress, else 503."""
        loop = engine.engine_loop
        stale = time.monotonic() - loop.last_heartbeat
        if loop.is_alive and stale < state.heartbeat_timeout:
            return JSONResponse({'status': 'ok'})
        if loop.error:  # the engine died (a tensor-parallel rank failed, ...): it never recovers
            return error_response(503, f'unhealthy: {loop.error}', code='engine_failed')
        reason = 'the engine loop stopped' if not loop.is_alive else f'no progress for {stale:.0f} s'
        return error_response(503, f'unhealthy: {reason}', code='engine_unhealthy')

    @app.get('/metrics', response_class=PlainTextResponse, responses=error_responses(*auth))
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    public = AUTH_EXEMPT | (mount_web_ui(app) if web_ui else frozenset())
    if limits.max_request_body_bytes is not None:
        app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_request_body_bytes)
    if api_keys:  # added after the body limit, so it runs first: no body is read for a bad key
        app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys) + list(admin_api_keys or ()),
                           public_paths=public)
    if allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allow_origins, allow_credentials=allow_credentials,
                           allow_methods=allow_methods or ['*'], allow_headers=allow_headers or ['*'])
    return app


def _ignore_signal(signum: int, _frame: object) -> None:
    logger.info('signal %d handled: the server has shut down', signum)


def describe(state: ServerState) -> str:
    """What the server runs, for its start-up log: model folder, dtype, device, KV cache size, kernels."""
    engine = state.engine.engine
    blocks = engine.block_manager.pools[0].num_blocks  # the full-attention layers' pool where there are two
    if engine.device.type == 'cuda':
        kernels = 'Triton kernels'
    else:
        from lmdeploy.pytorch.kernels import cpu
        kernels = 'native CPU kernels' if cpu.native() is not None else 'torch CPU kernels'
    dtype = str(engine.model_config.dtype).removeprefix('torch.')
    return (f'{state.engine.model_dir}: {dtype} on {engine.device}, KV cache {blocks * engine.config.block_size} '
            f'tokens ({blocks} blocks of {engine.config.block_size}), session_len {engine.session_len}, {kernels}')


class DrainLogging:
    """A uvicorn server mixin that logs the shutdown: how many requests are in flight, every few seconds
    while they finish, and when it is done."""

    in_flight: Callable[[], int]
    REPORT_EVERY = 5.0

    async def shutdown(self, sockets: list | None = None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        logger.info('shutting down: %d requests in flight get up to %.0f s to finish (Ctrl-C again aborts them)',
                    self.in_flight(), timeout or 0)
        reporter = asyncio.create_task(self._report())
        try:
            await super().shutdown(sockets)
        finally:
            reporter.cancel()
        logger.info('stopped')

    async def _report(self) -> None:
        start = time.monotonic()
        while True:
            await asyncio.sleep(self.REPORT_EVERY)
            logger.info('draining: %d requests still in flight after %.0f s', self.in_flight(),
                        time.monotonic() - start)


class Server(DrainLogging, uvicorn.Server):
    """uvicorn's server, logging its shutdown."""


def run_server(app: FastAPI, host: str = '127.0.0.1', port: int = 23333, log_level: str = 'info',
               shutdown_timeout: float = 30.0, proxy_url: str | None = None, proxy_api_key: str | None = None) -> None:
    """Serves ``app`` until SIGINT/SIGTERM: then it stops accepting, lets requests in flight finish for up
    to ``shutdown_timeout`` seconds, aborts the rest and returns. With ``proxy_url`` the server registers
    at that proxy once it listens and leaves it when it shuts down (see docs/scale_out.md). At INFO it logs
    what it serves, one line per request (uvicorn's access log) and its shutdown."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=shutdown_timeout)
    signal.signal(signal.SIGTERM, _ignore_signal)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    # The ~400k objects alive now (model, torch, transformers) would be scanned by every full collection, for
    # 0.2-0.5 s with the GIL held: the event loop and the engine stalled. Frozen, they are never scanned.
    gc.collect()
    gc.freeze()
    state: ServerState = app.state.server
    web = ' (chat page at /)' if getattr(app.state, 'web_ui', False) else ''
    logger.info('serving %s on http://%s:%d%s', state.model_name, host, port, web)
    logger.info('model %s', describe(state))
    if proxy_url:
        from lmdeploy.serve.proxy.registration import NodeServer

        class JoinedServer(DrainLogging, NodeServer):
            """A node server logging its shutdown."""

        server = JoinedServer(config, proxy_url, [state.model_name], proxy_api_key)
    else:
        server = Server(config)
    server.in_flight = lambda: state.admission.running
    server.run()
