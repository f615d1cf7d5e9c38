"""Typed request errors: an :class:`ErrorCode` says what went wrong and which HTTP status it maps to."""
from __future__ import annotations

import enum
from http import HTTPStatus


class ErrorCode(enum.Enum):
    """What went wrong with a request; ``http_status`` is what the OpenAI server answers with."""

    INVALID_ARGUMENT = ('invalid_argument', HTTPStatus.BAD_REQUEST)
    INPUT_LENGTH_ERROR = ('input_length_error', HTTPStatus.BAD_REQUEST)
    SESSION_OCCUPIED = ('session_occupied', HTTPStatus.BAD_REQUEST)
    ABORTED = ('aborted', HTTPStatus.SERVICE_UNAVAILABLE)
    SERVER_OVERLOADED = ('server_overloaded', HTTPStatus.SERVICE_UNAVAILABLE)
    ENGINE_ERROR = ('engine_error', HTTPStatus.INTERNAL_SERVER_ERROR)
    ENGINE_UNAVAILABLE = ('engine_unavailable', HTTPStatus.SERVICE_UNAVAILABLE)

    @property
    def http_status(self) -> int:
        return int(self.value[1])


class SafeRunException(Exception):
    """A request failed for a known reason; the engine and every other request go on unaffected."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f'[{self.code.name}] {self.message}'
