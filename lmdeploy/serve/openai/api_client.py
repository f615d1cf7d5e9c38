"""``APIClient``: a small client for the OpenAI-compatible endpoints of ``lmdeploy serve api_server``."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


class APIClient:
    """Talks to ``api_server_url``; ``api_key`` is sent as a bearer token.

    The ``*_v1`` methods yield response dicts: one when ``stream`` is False, else one per
    server-sent event.
    """

    def __init__(self, api_server_url: str, api_key: str | None = None, timeout: float = 600.0,
                 transport: httpx.BaseTransport | None = None):
        headers = {'Authorization': f'Bearer {api_key}'} if api_key else {}
        self.api_server_url = api_server_url.rstrip('/')
        self._http = httpx.Client(base_url=self.api_server_url, headers=headers, timeout=timeout, transport=transport)

    @property
    def available_models(self) -> list[str]:
        """Ids of the models the server serves."""
        response = self._http.get('/v1/models')
        response.raise_for_status()
        return [model['id'] for model in response.json()['data']]

    def _post(self, path: str, body: dict) -> Iterator[dict]:
        if not body.get('stream'):
            response = self._http.post(path, json=body)
            response.raise_for_status()
            yield response.json()
            return
        with self._http.stream('POST', path, json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                data = line.removeprefix('data:').strip() if line.startswith('data:') else ''
                if data == '[DONE]':
                    return
                if data:
                    yield json.loads(data)

    def chat_completions_v1(self, model: str, messages: str | list[dict], stream: bool = False,
                            **kwargs) -> Iterator[dict]:
        """POST /v1/chat/completions; ``kwargs`` are further request fields (temperature, max_tokens...)."""
        if isinstance(messages, str):
            messages = [{'role': 'user', 'content': messages}]
        yield from self._post('/v1/chat/completions', {'model': model, 'messages': messages, 'stream': stream,
                                                       **kwargs})

    def completions_v1(self, model: str, prompt: str | list[str], stream: bool = False, **kwargs) -> Iterator[dict]:
        """POST /v1/completions; ``kwargs`` are further request fields."""
        yield from self._post('/v1/completions', {'model': model, 'prompt': prompt, 'stream': stream, **kwargs})

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> APIClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
