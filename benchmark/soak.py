"""Soak test: mixed traffic against a real ``lmdeploy serve api_server`` for a fixed time, then checks that
the server gave everything back.

    python benchmark/soak.py [--duration 600] [--model PATH] [--clients 8] [--url http://... --server-pid PID]

Without ``--url`` it starts the server itself, on a tiny random Llama it builds (the one of
tests/conftest.py) unless ``--model``. Traffic: chat and completions, streaming and not, ``n`` > 1, stop
words, logprobs (chat top_logprobs, completions logprobs and echo), prompts sharing a long prefix (the
prefix cache), ``--disconnect`` (30%) of the valid requests dropped by the client at a random point and
``--invalid`` (5%) invalid requests (each must get a 4xx).

It prints requests served, p50/p99 latency, outcomes and errors by kind, the server's RSS (at start, after
the warm-up and at the end) and the KV-cache usage after the drain (``lmdeploy:kv_cache_usage_perc``
of /metrics). It exits 1 unless: zero 5xx, every valid request answered in full (or dropped by its own
client), every invalid one a 4xx, no request running or waiting and KV usage 0 after the drain, /health
200, and RSS growth after the warm-up under ``--rss-tolerance`` (5%).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import anyio
import httpx
import psutil
from scale_server import free_port, stop

HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = ('hello world quick brown fox jumps over the lazy dog paged attention stores keys and values in blocks '
         'café naïve 世界 0123456789').split()
SHARED_PREFIX = ('You are a careful assistant. Paged attention stores keys and values in blocks; the quick brown '
                 'fox jumps over the lazy dog. ') * 3
MODEL_NAME = 'soak'


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float('nan')


def build_tiny_model(path: str) -> str:
    """The tiny random Llama of the tests, saved at ``path`` by a process of its own: torch stays out of this
    one, whose latencies would include each full garbage collection of torch's objects (0.2-0.4 s)."""
    code = 'import sys; sys.path.insert(0, sys.argv[1]); from conftest import save_tiny_model; ' \
           'save_tiny_model("llama", sys.argv[2])'
    subprocess.run([sys.executable, '-c', code, os.path.join(HERE, '..', 'tests'), path], check=True,
                   stdout=subprocess.DEVNULL)
    return path


def start_server(model: str, port: int, extra: list[str], log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', model, '--server-port', str(port),
           '--model-name', MODEL_NAME, *extra]
    log = open(log_path, 'w')
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f'{url}/health', timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f'the server did not start; see {log_path}')
        time.sleep(0.3)


def parse_metrics(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in (line.rsplit(' ', 1) for line in text.splitlines()
                                                   if line and not line.startswith('#'))}


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f'{url}/metrics', timeout=10).text)


def text(rng: random.Random, lo: int, hi: int) -> str:
    return ' '.join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def valid_request(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    """A random valid request: (path, body)."""
    chat = rng.random() < 0.6
    body: dict = {'model': MODEL_NAME, 'max_tokens': rng.randint(1, max_tokens), 'stream': rng.random() < 0.5,
                  'temperature': rng.choice([0.0, 0.7, 1.0])}
    prompt = (SHARED_PREFIX if rng.random() < 0.5 else '') + text(rng, 3, 30)
    if rng.random() < 0.2:
        body['n'] = rng.randint(2, 3)
    if rng.random() < 0.25:
        body['stop'] = rng.sample(WORDS, rng.randint(1, 3))
    if rng.random() < 0.2:
        body['ignore_eos'] = True
    if body['stream'] and rng.random() < 0.5:
        body['stream_options'] = {'include_usage': True}
    if chat:
        body['messages'] = [{'role': 'user', 'content': prompt}]
        if rng.random() < 0.25:
            body['logprobs'] = True
            body['top_logprobs'] = rng.randint(0, 3)
        return '/v1/chat/completions', body
    body['prompt'] = prompt
    if rng.random() < 0.25:
        body['logprobs'] = rng.randint(0, 3)
        body['echo'] = rng.random() < 0.5
    return '/v1/completions', body


def invalid_request(rng: random.Random) -> tuple[str, dict | bytes]:
    """A random invalid request: each must get a 4xx."""
    good = {'model': MODEL_NAME, 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4}
    kind = rng.randrange(8)
    if kind == 0:
        return '/v1/chat/completions', b'{"model": "soak", "messages": [{"role": "user", '   # malformed JSON
    if kind == 1:
        return '/v1/chat/completions', {**good, 'model': 'no-such-model'}
    if kind == 2:
        return '/v1/chat/completions', {**good, 'temperature': -1}
    if kind == 3:
        return '/v1/chat/completions', {**good, 'messages': []}
    if kind == 4:
        return '/v1/completions', {'model': MODEL_NAME, 'prompt': 'hi', 'max_tokens': 0}
    if kind == 5:
        return '/v1/completions', {'model': MODEL_NAME, 'prompt': 'word ' * 5000, 'max_tokens': 4}  # too long
    if kind == 6:
        return '/v1/chat/completions', {**good, 'stream_options': {'include_usage': True}}  # without stream
    return '/generate', {'input_ids': [10 ** 9], 'max_tokens': 4}                          # not a token


class Stats:
    def __init__(self):
        self.outcomes = collections.Counter()
        self.errors = collections.Counter()
        self.examples: dict[str, str] = {}
        self.log: list[dict] = []      # every error, for --errors-json
        self.latency: list[float] = []
        self.served = 0

    def error(self, kind: str, detail: str) -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, detail[:400])
        self.log.append({'kind': kind, 'time': time.time(), 'detail': detail})


async def check_stream(resp: httpx.Response, body: dict, drop_after: int | None) -> tuple[str, str]:
    """Reads an SSE stream: ('dropped', '') when the client drops it, ('ok', '') when it is complete,
    else (error kind, detail)."""
    n, events, finished, done = body.get('n', 1), 0, set(), False
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
        for choice in chunk.get('choices', []):
            if choice.get('finish_reason'):
                finished.add(choice['index'])
                if choice['finish_reason'] not in ('stop', 'length'):
                    return f"finish_reason_{choice['finish_reason']}", data
    if drop_after is not None:
        return 'dropped', ''       # the stream ended before the client meant to drop it: it was served
    if not done:
        return 'stream_without_done', f'{events} events'
    if len(finished) != n:
        return 'stream_missing_choices', f'{len(finished)} of {n} choices finished'
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
    invalid = rng.random() < args.invalid
    if invalid:
        path, body = invalid_request(rng)
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
        return
    path, body = valid_request(rng, args.max_tokens)
    disconnect = rng.random() < args.disconnect
    start = time.perf_counter()
    try:
        with anyio.fail_after(args.request_timeout):
            if body['stream']:
                result = await stream_request(http, path, body, rng.randint(1, 6) if disconnect else None)
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
            reasons = [c.get('finish_reason') for c in data['choices']]
            if len(reasons) != body.get('n', 1):
                kind, detail = 'missing_choices', result.text
            elif any(r not in ('stop', 'length') for r in reasons):
                kind, detail = f'finish_reason_{reasons}', result.text
        else:
            detail = result.text
    if status >= 500:
        stats.error('http_5xx', f'{path} {json.dumps(body)[:200]} -> {status} {detail}')
    elif status != 200:
        stats.error(f'http_{status}', f'{path} {json.dumps(body)[:200]} -> {status} {detail}')
    elif kind == 'dropped':
        stats.outcomes['dropped_by_client'] += 1
    elif kind != 'ok':
        stats.error(kind, f'{path} {json.dumps(body)[:200]} -> {detail}')
    else:
        stats.outcomes['served'] += 1
        stats.served += 1
        stats.latency.append(time.perf_counter() - start)


async def stream_request(http, path, body, drop_after):
    async with http.stream('POST', path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, 'http', resp.text
        kind, detail = await check_stream(resp, body, drop_after)
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


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return float('nan')
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2 ** 20


def drain(url: str, timeout: float = 60) -> dict[str, float]:
    """Waits until nothing runs or waits; returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m.get('lmdeploy:num_requests_running', 0) == 0 and m.get('lmdeploy:num_requests_waiting', 0) == 0
        if (idle and m.get('lmdeploy:kv_cache_usage_perc', 0) == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--duration', type=float, default=600, help='seconds of traffic, warm-up included')
    parser.add_argument('--warmup', type=float, default=None,
                        help='seconds of traffic before the RSS baseline (default: a quarter, at most 60 s)')
    parser.add_argument('--model', default=None, help='model path (default: a tiny random Llama built here)')
    parser.add_argument('--url', default=None, help='a running server (default: start one)')
    parser.add_argument('--server-pid', type=int, default=None, help='with --url: its pid, for the RSS')
    parser.add_argument('--clients', type=int, default=8, help='concurrent clients')
    parser.add_argument('--max-tokens', type=int, default=24, help='max_tokens of a request: 1..this')
    parser.add_argument('--disconnect', type=float, default=0.3, help='share of valid requests the client drops')
    parser.add_argument('--invalid', type=float, default=0.05, help='share of invalid requests')
    parser.add_argument('--rss-tolerance', type=float, default=0.05, help='allowed RSS growth after the warm-up')
    parser.add_argument('--request-timeout', type=float, default=60,
                        help='seconds a request may take before it counts as a timeout')
    parser.add_argument('--errors-json', default=None, help='write every error (with its request) here')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--server-args', default='--dtype float32 --session-len 1024 --num-gpu-blocks 512 '
                        '--block-size 16', help='extra flags of lmdeploy serve api_server it starts')
    args = parser.parse_args(argv)
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 4)
    proc, tmp = None, tempfile.mkdtemp(prefix='soak-')
    log_path = os.path.join(tmp, 'server.log')
    stats = Stats()
    try:
        if args.url:
            url, pid = args.url, args.server_pid
        else:
            model = args.model or build_tiny_model(os.path.join(tmp, 'tiny-llama'))
            port = free_port()
            proc = start_server(model, port, args.server_args.split(), log_path)
            url, pid = f'http://127.0.0.1:{port}', proc.pid
        rss_start = rss_mb(pid)
        t0 = time.monotonic()
        asyncio.run(drive(url, args, stats, warmup, args.seed))
        drain(url)
        rss_warm = rss_mb(pid)
        warm_latency, stats.latency = stats.latency, []     # latency is reported after the warm-up
        asyncio.run(drive(url, args, stats, max(0.0, args.duration - warmup), args.seed + 1))
        traffic_s = time.monotonic() - t0
        after = drain(url)
        rss_end = rss_mb(pid)
        health = httpx.get(f'{url}/health', timeout=10).status_code
    finally:
        if proc is not None:
            stop(proc)
    kv = after.get('lmdeploy:kv_cache_usage_perc', float('nan'))
    running = after.get('lmdeploy:num_requests_running', float('nan'))
    waiting = after.get('lmdeploy:num_requests_waiting', float('nan'))
    growth = (rss_end - rss_warm) / rss_warm
    total = sum(stats.outcomes.values()) + sum(stats.errors.values())
    print(f'soak: {traffic_s:.0f} s of traffic ({warmup:.0f} s warm-up), {args.clients} clients, '
          f'{total} requests')
    print(f'  served in full: {stats.served} ({stats.served / traffic_s:.2f} req/s); latency after the warm-up '
          f'p50 {pct(stats.latency, .5) * 1e3:.0f} ms, p99 {pct(stats.latency, .99) * 1e3:.0f} ms '
          f'(warm-up: p50 {pct(warm_latency, .5) * 1e3:.0f} ms, p99 {pct(warm_latency, .99) * 1e3:.0f} ms)')
    print(f'  outcomes: {dict(stats.outcomes)}')
    print(f'  errors by kind: {dict(stats.errors) or "none"}')
    for kind, example in stats.examples.items():
        print(f'    {kind}: {example}')
    print(f'  server RSS: start {rss_start:.0f} MiB, after warm-up {rss_warm:.0f} MiB, end {rss_end:.0f} MiB '
          f'({growth * 100:+.1f}% after warm-up)')
    print(f'  after the drain: kv_cache_usage_perc {kv}, running {running}, waiting {waiting}; /health {health}')
    failures = []
    if stats.errors:
        failures.append(f'errors: {dict(stats.errors)}')
    if kv != 0 or running != 0 or waiting != 0:
        failures.append('the server is not idle after the drain')
    if health != 200:
        failures.append(f'/health {health}')
    if pid is not None and growth >= args.rss_tolerance:
        failures.append(f'RSS grew {growth * 100:.1f}% after the warm-up')
    if not stats.served:
        failures.append('nothing was served')
    if args.errors_json:
        with open(args.errors_json, 'w') as f:
            json.dump(stats.log, f, indent=1)
    print('PASS' if not failures else 'FAIL: ' + '; '.join(failures))
    if failures and proc is not None:
        print(f'  server log: {log_path}')
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
