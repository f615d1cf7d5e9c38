"""OpenAI-style error bodies and the exception handlers that produce them."""
from __future__ import annotations

from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmdeploy.serve.exceptions import SafeRunException

# What each status means on this server, for the OpenAPI schema.
ERROR_DESCRIPTIONS = {
    400: 'Invalid or unsupported value, malformed JSON, a prompt longer than the context or a request over one '
         'of the server\'s limits',
    401: 'Missing or invalid API key',
    403: 'abort_all without an admin key, or a session started with another key',
    404: 'Unknown model',
    413: 'Request body over --max-request-body-bytes',
    429: 'Every running and waiting slot is taken; retry after Retry-After seconds',
    500: 'The engine failed while the request ran',
    503: 'The engine is closed or its loop died, or too many requests wait for an engine instance',
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body."""

    error: ErrorDetail


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an error of HTTP ``status``: ``server_error`` for a 5xx, ``requests`` for a 429 (what
    OpenAI sends for a requests rate limit), else ``invalid_request_error`` (OpenAI's for 401 and 404 too)."""
    if status >= 500:
        return 'server_error'
    return 'requests' if status == 429 else 'invalid_request_error'


def default_code(status: int) -> str:
    """The ``code`` of an error that names none: the status's phrase in snake case (``method_not_allowed``)."""
    return HTTPStatus(status).phrase.lower().replace(' ', '_')


class APIError(Exception):
    """A request the server refuses: ``status`` is the HTTP status, ``param`` the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.code = code or default_code(status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's ``type`` (:func:`error_type`) and a
    specific ``code`` (the status's phrase when none is given)."""
    return {'error': {'message': message, 'type': error_type(status), 'param': param,
                      'code': code or default_code(status)}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def from_safe_run(exc: SafeRunException) -> APIError:
    return APIError(exc.code.http_status, exc.message, code=exc.code.value[0])


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return 'invalid request', None
    first = errors[0]
    loc = [str(p) for p in first.get('loc', ()) if p != 'body']
    if loc == [] and first.get('type') in ('model_attributes_type', 'dict_type'):
        return 'the request body must be a JSON object', None
    if first.get('type') == 'json_invalid':
        return f'malformed JSON body: {first.get("ctx", {}).get("error", first.get("msg"))}', None
    param = '.'.join(loc) or first.get('ctx', {}).get('param')
    return f'{param + ": " if param else ""}{first.get("msg")}' + (
        f' (and {len(errors) - 1} more errors)' if len(errors) > 1 else ''), param


def install_error_handlers(app: FastAPI) -> None:
    """Pydantic errors, :class:`SafeRunException` and :class:`APIError` all become OpenAI error bodies."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param, 'invalid_argument')

    @app.exception_handler(SafeRunException)
    async def _safe_run(_: Request, exc: SafeRunException) -> JSONResponse:
        return error_response(exc.code.http_status, exc.message, code=exc.code.value[0])

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, 'headers', None))


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """The OpenAPI ``responses`` of a route that answers ``statuses`` with the OpenAI error body."""
    responses: dict[int | str, dict] = {}
    for status in statuses:
        responses[status] = {'model': ErrorResponse, 'description': ERROR_DESCRIPTIONS[status]}
        if status == 429:
            responses[status]['headers'] = {'Retry-After': {'description': 'Seconds to wait before retrying',
                                                            'schema': {'type': 'integer'}}}
    return responses


def document_errors(app: FastAPI) -> None:
    """Leaves FastAPI's 422 out of the app's OpenAPI schema: invalid bodies get a 400 with the OpenAI error
    body, which the routes document with :func:`error_responses`."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            for operations in schema['paths'].values():
                for operation in operations.values():
                    operation['responses'].pop('422', None)
            for name in ('HTTPValidationError', 'ValidationError'):
                schema.get('components', {}).get('schemas', {}).pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
