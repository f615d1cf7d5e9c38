"""The chat page at ``/``: plain HTML, JS and CSS shipped in the package (no build step, no CDN), talking to
``/v1/chat/completions`` like any other client."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

STATIC_DIR = Path(__file__).parent / 'static'
MEDIA_TYPES = {'.html': 'text/html; charset=utf-8', '.js': 'text/javascript; charset=utf-8',
               '.css': 'text/css; charset=utf-8'}
# The page runs only its own files: no inline script, no other origin; images may be data: or blob: URLs.
HEADERS = {'Content-Security-Policy': "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
                                      "base-uri 'none'; frame-ancestors 'none'",
           'X-Content-Type-Options': 'nosniff', 'Cache-Control': 'no-cache'}


def mount_web_ui(app: FastAPI) -> frozenset[str]:
    """Serves ``static/index.html`` at ``/`` and the other static files at ``/web/NAME``; returns those
    paths, which need no API key (the page asks for one and sends it with its API calls)."""
    paths = {'/': 'index.html'}
    paths.update({f'/web/{f.name}': f.name for f in STATIC_DIR.iterdir() if f.name != 'index.html'})
    for path, name in paths.items():
        file = STATIC_DIR / name
        _add_route(app, path, file.read_bytes(), MEDIA_TYPES[file.suffix])
    app.state.web_ui = True
    return frozenset(paths)


def _add_route(app: FastAPI, path: str, body: bytes, media_type: str) -> None:
    async def serve_file() -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    app.add_api_route(path, serve_file, methods=['GET'], include_in_schema=False)
