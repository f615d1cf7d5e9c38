"""The soak's clients (benchmark/soak.py): each sends requests of the traffic (benchmark/soak_traffic.py) one
after another, drops some at a random point, checks every answer and counts the outcomes and errors in
:class:`Stats`."""
from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import anyio
import httpx
from soak_traffic import FINISH_REASONS, Request, gather, invalid_request, valid_request
from soak_watch import parse_metrics

class Stats:
    def __init__(self):
        self.outcomes = collections.Counter()
        self.errors = collections.Counter()
        self.examples: dict[str, str] = {}
        self.log: list[dict] = []      # every error, for --errors-json
        self.latency: list[float] = []
        self.served = 0

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values()) + sum(self.errors.values())

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, detail[:400])
        self.log.append({'kind': kind, 'time': time.time(), 'detail': detail})


async def check_stream(resp: httpx.Response, body: dict, drop_after: int | None,
                       choices: dict[int, dict]) -> tuple[str, str]:
    """Reads an SSE stream, gathering its choices into ``choices``: ('dropped', '') when the client drops it,
    ('ok', '') when it is complete, else (error kind, detail)."""
    n, events, done = body.get('n', 1), 0, False
    async for line in resp.aiter_lines():
        if not line.startswith('data:'):
            continue
        events += 1
        if drop_after is not None and events >= drop_after:
            return 'dropped', ''
        data = line[5:].strip()
        if data == '[DONE]':
            done = True
            break
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            return 'stream_bad_event', data
        if 'error' in chunk:
            return 'stream_error_event', data
        gather(choices, chunk, 'messages' in body)
        for choice in chunk.get('choices', []):
            if choice.get('finish_reason') not in (None, *FINISH_REASONS):
                return f"finish_reason_{choice['finish_reason']}", data
    if drop_after is not None:
        return 'dropped', ''       # the stream ended before the client meant to drop it: it was served
    if not done:
        return 'stream_without_done', f'{events} events'
    finished = sum(1 for c in choices.values() if c['finish_reason'])
    if finished != n:
        return 'stream_missing_choices', f'{finished} of {n} choices finished'
    return 'ok', ''


async def post_and_drop(http: httpx.AsyncClient, path: str, body: dict, after: float) -> httpx.Response | None:
    """Posts ``body`` on a connection of its own and hangs up after ``after`` seconds unless answered by then:
    the response, or None when dropped.

    Not on ``http``'s pool: cancelling a request there (``task.cancel()``) can leave its connection taken for
    good (httpcore 1.0.9, encode/httpcore#1093); once all of a client's connections are taken so, each of its
    requests waits for one until it times out, and never reaches the server."""
    async with httpx.AsyncClient(base_url=http.base_url, timeout=http.timeout) as own:
        with anyio.move_on_after(after):
            return await own.post(path, json=body)
    return None


async def server_load(http: httpx.AsyncClient) -> str:
    """What the server runs and queues now, for the record of a timeout."""
    try:
        m = parse_metrics((await http.get('/metrics', timeout=10)).text)
    except httpx.HTTPError as exc:
        return f'server load unknown ({exc!r})'
    return f"server running {m['lmdeploy:num_requests_running']}, waiting {m['lmdeploy:num_requests_waiting']}"


async def one_request(http: httpx.AsyncClient, rng: random.Random, args, stats: Stats) -> None:
    if rng.random() < args.invalid:
        await one_invalid_request(http, invalid_request(rng, args.kinds), stats)
        return
    req = valid_request(rng, args.max_tokens, args.kinds, args.formats)
    path, body = req.path, req.body
    disconnect = rng.random() < args.disconnect
    start = time.perf_counter()
    choices: dict[int, dict] = {}
    try:
        with anyio.fail_after(args.request_timeout):
            if body['stream']:
                result = await stream_request(http, path, body, rng.randint(1, 6) if disconnect else None, choices)
            elif disconnect:    # hang up at a random point while waiting for the answer
                result = await post_and_drop(http, path, body, rng.uniform(0.0, 0.5))
                if result is None:
                    stats.outcomes['dropped_by_client'] += 1
                    return
            else:
                result = await http.post(path, json=body)
    except (httpx.HTTPError, TimeoutError) as exc:
        kind = 'timeout' if isinstance(exc, TimeoutError) else 'transport_error'
        stats.error(kind, f'{path} {exc!r} after {time.perf_counter() - start:.1f} s ({await server_load(http)}): '
                    f'{json.dumps(body)}')
        return
    if body['stream']:
        status, kind, detail = result
    else:
        status, kind, detail = result.status_code, 'ok', ''
        if status == 200:
            data = result.json()
            choices = {c['index']: c for c in data['choices']} if isinstance(data, dict) else {}
            reasons = [c.get('finish_reason') for c in choices.values()]
            if not isinstance(data, dict):
                kind, detail = 'not_an_object', result.text
            elif len(reasons) != body.get('n', 1):
                kind, detail = 'missing_choices', result.text
            elif any(r not in FINISH_REASONS for r in reasons):
                kind, detail = f'finish_reason_{reasons}', result.text
        else:
            detail = result.text
    if kind == 'ok' and req.check is not None:
        problem = req.check(list(choices.values()))
        if problem:
            kind, detail = f'bad_answer_{req.kind}', problem
    what = f'{path} {json.dumps(body)[:300]}'
    if status >= 500:
        stats.error('http_5xx', f'{what} -> {status} {detail}')
    elif status != 200:
        stats.error(f'http_{status}', f'{what} -> {status} {detail}')
    elif kind == 'dropped':
        stats.outcomes['dropped_by_client'] += 1
    elif kind != 'ok':
        stats.error(kind, f'{what} -> {detail}')
    else:
        stats.outcomes['served' if req.kind == 'base' else f'served_{req.kind}'] += 1
        stats.served += 1
        stats.latency.append(time.perf_counter() - start)


async def one_invalid_request(http: httpx.AsyncClient, req: Request, stats: Stats) -> None:
    path, body = req.path, req.body
    kwargs = {'content': body, 'headers': {'content-type': 'application/json'}} if isinstance(body, bytes) \
        else {'json': body}
    try:
        resp = await http.post(path, timeout=60, **kwargs)
    except httpx.HTTPError as exc:
        stats.error('transport_error', f'{path} {exc!r}')
        return
    if 400 <= resp.status_code < 500:
        stats.outcomes['invalid_rejected_4xx'] += 1
    elif resp.status_code >= 500:
        stats.error('http_5xx', f'{path} {str(body)[:200]} -> {resp.status_code} {resp.text}')
    else:
        stats.error('invalid_accepted', f'{path} {str(body)[:200]} -> {resp.status_code} {resp.text}')


async def stream_request(http, path, body, drop_after, choices):
    async with http.stream('POST', path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, 'http', resp.text
        kind, detail = await check_stream(resp, body, drop_after, choices)
        return 200, kind, detail


async def client_loop(url: str, seed: int, args, stats: Stats, stop_at: float) -> None:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=2)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as http:
        while time.monotonic() < stop_at:
            await one_request(http, rng, args, stats)


async def drive(url: str, args, stats: Stats, seconds: float, seed: int) -> None:
    stop_at = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(url, seed * 1000 + i, args, stats, stop_at) for i in range(args.clients)))
