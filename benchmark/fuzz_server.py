"""Fuzzes a real ``lmdeploy serve api_server``: schemathesis over its OpenAPI schema, then hand-made hostile
requests, then dropped streams and concurrent aborts; after each phase the server must be idle.

    python benchmark/fuzz_server.py [--cases 3000] [--seed 0] [--timeout 30] [--model PATH]

The server (model name 'soak') runs on the tiny random Llama of tests/conftest.py (unless ``--model``) in fp32
with a short context (256 tokens), 4 sequences per batch and 24 KV blocks of 16 tokens, fewer than 2 full
contexts take, so that long requests wait for blocks. Schemathesis makes ``--cases`` valid and schema-violating
cases (see ``run_fuzz`` of tests/test_fuzz.py: token counts are clamped to 8 and ``n`` to 4); the hand-made
requests are those of benchmark/hostile_requests.py, sent one at a time and then all at once. Each request
gets ``--timeout`` seconds, so a hang is a finding.

A finding: a 5xx (but a 503 ``aborted`` for a request this script aborted), a dropped connection or timeout,
a 4xx without the OpenAI error body ``{"error": {"message", "type", "param", "code"}}``, an error event in a
stream (bad input must be refused before the stream starts), or a server that is not idle after a phase
(``/health`` not 200, requests running or waiting, KV blocks in use). It prints the counts and each finding,
and exits 1 if there was any.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import anyio
import httpx
from hostile_requests import HOSTILE, Case
from scale_server import free_port, stop
from soak import MODEL_NAME, build_tiny_model, metrics, start_server

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, '..', 'tests'))
from test_fuzz import run_fuzz, summary  # noqa: E402

ADMIN_KEY = 'fuzz-admin'
SERVER_FLAGS = ['--dtype', 'float32', '--session-len', '256', '--max-batch-size', '4', '--num-gpu-blocks', '24',
                '--block-size', '16', '--admin-api-keys', ADMIN_KEY, '--log-level', 'ERROR']


def idle_findings(url: str, phase: str) -> list[dict]:
    """What keeps the server from being idle after ``phase`` (blocks come back asynchronously: 15 s allowed)."""
    deadline = time.monotonic() + 15
    while True:
        try:
            health = httpx.get(f'{url}/health', timeout=10).status_code
            m = metrics(url)
        except httpx.TransportError as exc:
            return [{'phase': phase, 'kind': 'server gone', 'detail': repr(exc)}]
        busy = {k: m[k] for k in ('lmdeploy:num_requests_running', 'lmdeploy:num_requests_waiting',
                                  'lmdeploy:kv_cache_usage_perc') if m.get(k)}
        if health == 200 and not busy or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    found = [{'phase': phase, 'kind': 'unhealthy', 'detail': health}] if health != 200 else []
    return found + ([{'phase': phase, 'kind': 'not idle', 'detail': busy}] if busy else [])


def error_body_ok(response: httpx.Response) -> bool:
    try:
        error = response.json()['error']
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(error, dict) and set(error) == {'message', 'type', 'param', 'code'}
            and isinstance(error['message'], str) and error['message'] != '')


def judge(case: Case, response: httpx.Response, body_text: str, aborted: bool = False) -> str | None:
    """Why ``response`` to ``case`` is a finding, or None."""
    status = response.status_code
    if status >= 500 and not (aborted and status == 503):
        return f'{status}: {body_text[:300]}'
    if 400 <= status < 500 and not error_body_ok(response):
        return f'{status} without the OpenAI error body: {body_text[:300]}'
    if case.expect_ok and status != 200:
        return f'expected 200, got {status}: {body_text[:300]}'
    if status == 200 and 'text/event-stream' in response.headers.get('content-type', ''):
        for line in body_text.splitlines():
            if line.startswith('data: {"error"') and not (aborted and '"aborted"' in line):
                return f'error event: {line[:300]}'
    return None


async def send(http: httpx.AsyncClient, case: Case) -> str | None:
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    try:
        async with http.stream('POST', case.path, content=content,
                               headers={'content-type': 'application/json'}) as response:
            text = (await response.aread()).decode('utf-8', 'replace')
    except httpx.HTTPError as exc:
        return f'transport: {exc!r}'
    return judge(case, response, text)


async def hostile_phase(url: str, timeout: float) -> tuple[int, list[dict]]:
    """Each hand-made case alone, then all of them at once (which queue behind each other for 4 sequences
    at a time: each gets 10 timeouts)."""
    findings = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        for case in HOSTILE:
            why = await send(http, case)
            if why:
                findings.append({'phase': 'hostile', 'kind': case.label, 'detail': why})
    async with httpx.AsyncClient(base_url=url, timeout=10 * timeout) as http:
        results = await asyncio.gather(*(send(http, case) for case in HOSTILE))
        findings += [{'phase': 'hostile, concurrent', 'kind': case.label, 'detail': why}
                     for case, why in zip(HOSTILE, results) if why]
    return 2 * len(HOSTILE), findings


async def drop_stream(url: str, body: dict, after_events: int, timeout: float) -> str | None:
    """Streams ``body`` and hangs up after ``after_events`` events."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        try:
            async with http.stream('POST', '/v1/chat/completions', json=body) as response:
                if response.status_code != 200:
                    return f'{response.status_code}: {(await response.aread())[:300]!r}'
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith('data:')
                    if events >= after_events:
                        return None
        except httpx.HTTPError as exc:
            return f'transport: {exc!r}'
    return None


async def hang_up(url: str, path: str, body: dict, after: float) -> str | None:
    """Posts ``body`` and hangs up ``after`` seconds later, whatever the request is doing by then (queued,
    templating, compiling its grammar, prefilling, streaming)."""
    async with httpx.AsyncClient(base_url=url) as http:
        with anyio.move_on_after(after):
            try:
                async with http.stream('POST', path, json=body) as response:
                    await response.aread()
                    if response.status_code >= 500:
                        return f'{response.status_code}: {response.text[:300]}'
            except httpx.HTTPError as exc:
                return f'transport: {exc!r}'
    return None


def hang_up_cases() -> list[tuple[str, dict]]:
    """Requests that are slow in different places: many choices, long prompts (waiting for KV blocks), a
    grammar not compiled yet, a large fan-out."""
    long = {'model': MODEL_NAME, 'prompt': [7] * 240, 'max_tokens': 15, 'ignore_eos': True, 'n': 8}
    chat = {'model': MODEL_NAME, 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 30, 'n': 4}
    schema = {'type': 'object', 'properties': {'fresh': {'type': 'string', 'maxLength': 9}}, 'required': ['fresh']}
    cases = []
    for stream in (False, True):
        cases += [('/v1/completions', {**long, 'stream': stream}),
                  ('/v1/chat/completions', {**chat, 'stream': stream}),
                  ('/v1/completions', {'model': MODEL_NAME, 'prompt': ['a'] * 32, 'n': 4, 'max_tokens': 8,
                                       'stream': stream}),
                  ('/v1/chat/completions', {**chat, 'stream': stream, 'response_format': {
                      'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': schema}}})]
    return cases


async def abort_phase(url: str, timeout: float) -> tuple[int, list[dict]]:
    """Streams dropped by their clients, clients hanging up at different times, requests aborted by session
    id while they run, ``abort_all`` while others run, and aborts of sessions that do not exist."""
    findings, sent = [], 0
    chat = {'model': MODEL_NAME, 'messages': [{'role': 'user', 'content': 'tell me a story'}], 'max_tokens': 120,
            'ignore_eos': True, 'stream': True, 'n': 2}
    drops = [drop_stream(url, chat, after, timeout) for after in (1, 1, 2, 3, 5, 8, 13, 21)]
    sent += len(drops)
    findings += [{'phase': 'dropped streams', 'kind': 'stream', 'detail': why}
                 for why in await asyncio.gather(*drops) if why]
    hang_ups = [hang_up(url, path, body, after) for after in (0.01, 0.1, 0.3, 1.0, 3.0)
                for path, body in hang_up_cases()]
    sent += len(hang_ups)
    findings += [{'phase': 'hang-ups', 'kind': 'hang-up', 'detail': why}
                 for why in await asyncio.gather(*hang_ups) if why]

    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        async def run(case: Case) -> str | None:
            try:
                response = await http.post(case.path, json=case.body)
            except httpx.HTTPError as exc:
                return f'transport: {exc!r}'
            return judge(case, response, response.text, aborted=True)

        async def abort(body: dict, key: str | None = None, delay: float = 0.3) -> str | None:
            await asyncio.sleep(delay)
            headers = {'authorization': f'Bearer {key}'} if key else {}
            response = await http.post('/abort_request', json=body, headers=headers)
            return judge(Case('abort', '/abort_request', body), response, response.text)

        for stream in (False, True):
            long = {**chat, 'stream': stream, 'n': 1}
            runs = [run(Case('aborted by session', '/v1/chat/completions', {**long, 'session_id': 7000 + i}))
                    for i in range(4)]
            aborts = [abort({'session_id': 7000 + i}, delay=0.1 * i) for i in range(4)]
            aborts += [abort({'session_id': 7000 + i}, delay=0.2) for i in range(4)]   # twice, at once
            aborts += [abort({'session_id': 10 ** 12}), abort({'abort_all': True}),                # 403: no key
                       abort({'abort_all': True}, ADMIN_KEY, delay=0.5), abort({'abort_all': True}, ADMIN_KEY)]
            others = [run(Case('aborted by abort_all', '/v1/completions',
                               {'model': MODEL_NAME, 'prompt': 'x ' * 100, 'max_tokens': 100, 'ignore_eos': True,
                                'stream': stream, 'n': 3}))]
            results = await asyncio.gather(*runs, *aborts, *others)
            sent += len(results)
            findings += [{'phase': 'aborts', 'kind': f'stream={stream}', 'detail': why} for why in results if why]
    return sent, findings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--cases', type=int, default=3000, help='schemathesis cases (0: none)')
    parser.add_argument('--seed', type=int, default=0, help="hypothesis' seed for the schemathesis cases")
    parser.add_argument('--timeout', type=float, default=30.0, help='seconds each request may take')
    parser.add_argument('--model', default=None, help='model to serve (default: the tiny random Llama)')
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix='lmdeploy-fuzz-')
    model = args.model or build_tiny_model(os.path.join(tmp, 'tiny-llama'))
    port = free_port()
    url = f'http://127.0.0.1:{port}'
    proc = start_server(model, port, SERVER_FLAGS, os.path.join(tmp, 'server.log'))
    findings, counts = [], {}
    try:
        start = time.monotonic()
        if args.cases:
            stats = run_fuzz(url, args.cases, MODEL_NAME, timeout=args.timeout, seed=args.seed)
            print(f'schemathesis: {summary(stats)}\n  {time.monotonic() - start:.0f} s', flush=True)
            findings += [{'phase': 'schemathesis', 'kind': f"{f['operation']} {f['kind']}", 'detail': f}
                         for f in stats['findings']]
            findings += idle_findings(url, 'schemathesis')
            counts['schemathesis'] = stats['cases']
        for name, phase in (('hostile', hostile_phase), ('aborts', abort_phase)):
            start = time.monotonic()
            sent, found = asyncio.run(phase(url, args.timeout))
            counts[name] = sent
            findings += found + idle_findings(url, name)
            print(f'{name}: {sent} requests, {len(found)} findings, {time.monotonic() - start:.0f} s', flush=True)
        alive = proc.poll() is None
    finally:
        stop(proc)
    if not alive:
        findings.append({'phase': 'end', 'kind': 'server exited', 'detail': proc.returncode})
    print(f'requests: {counts}; findings: {len(findings)} (server log: {tmp}/server.log)')
    for f in findings:
        print('  ' + json.dumps(f, default=str)[:600])
    return 1 if findings else 0


if __name__ == '__main__':
    sys.exit(main())
