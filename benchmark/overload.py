"""Overload: ten times more concurrent clients than ``--max-concurrent-requests``.

    python benchmark/overload.py [--model PATH] [--max-concurrent-requests 4] [--max-queue-size 0] \
        [--factor 10] [--seconds 30] [--max-tokens 32]

It starts ``lmdeploy serve api_server`` (the tiny random Llama of tests/conftest.py unless ``--model``) with
those limits, then runs two closed-loop phases of non-streaming chat requests (``max_tokens`` tokens,
``ignore_eos``): a baseline with as many clients as the server admits, and the overload with ``--factor``
times as many; a client that gets a 429 waits ``--backoff`` seconds and tries again. A poller reads
``num_requests_running`` / ``num_requests_waiting`` of /metrics every 0.1 s. It prints a table: requests
answered and rejected, admitted latency p50/p99, time to the 429 p50/p99/max, the most requests seen
running and waiting; and exits 1 on a 5xx or a transport error, a 429 slower than ``--reject-budget-ms``,
admitted p50 more than ``--latency-tolerance`` times the baseline's, or more waiting than the queue allows.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scale_server import free_port, stop  # noqa: E402
from soak import MODEL_NAME, build_tiny_model, drain, pct, start_server  # noqa: E402


class Phase:
    def __init__(self, name: str, clients: int):
        self.name, self.clients = name, clients
        self.ok: list[float] = []
        self.rejected: list[float] = []
        self.other = collections.Counter()
        self.max_running = 0
        self.max_waiting = 0


async def client(http: httpx.AsyncClient, body: dict, phase: Phase, stop_at: float, backoff: float) -> None:
    while time.monotonic() < stop_at:
        start = time.perf_counter()
        try:
            resp = await http.post('/v1/chat/completions', json=body)
        except httpx.HTTPError as exc:
            phase.other[type(exc).__name__] += 1
            continue
        elapsed = time.perf_counter() - start
        if resp.status_code == 200:
            phase.ok.append(elapsed)
        elif resp.status_code == 429:
            phase.rejected.append(elapsed)
            await asyncio.sleep(backoff)
        else:
            phase.other[resp.status_code] += 1


async def poller(url: str, phase: Phase, stop_at: float) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while time.monotonic() < stop_at:
            text = (await http.get('/metrics')).text
            for line in text.splitlines():
                if line.startswith('lmdeploy:num_requests_running '):
                    phase.max_running = max(phase.max_running, int(float(line.split()[1])))
                elif line.startswith('lmdeploy:num_requests_waiting '):
                    phase.max_waiting = max(phase.max_waiting, int(float(line.split()[1])))
            await asyncio.sleep(0.1)


async def run_phase(url: str, phase: Phase, seconds: float, body: dict, backoff: float) -> Phase:
    """Runs a phase with this process's garbage collector off: its full collections (100 ms and more for the
    cyclic garbage of 40 clients) would count in the latencies measured."""
    stop_at = time.monotonic() + seconds
    https = [httpx.AsyncClient(base_url=url, timeout=300) for _ in range(phase.clients)]
    gc.disable()
    try:
        await asyncio.gather(poller(url, phase, stop_at),
                             *(client(http, body, phase, stop_at, backoff) for http in https))
    finally:
        gc.enable()
        for http in https:
            await http.aclose()
    return phase


def ms(value: float) -> str:
    return '-' if value != value else f'{value * 1e3:.0f}' if value >= 0.01 else f'{value * 1e3:.1f}'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='model path (default: a tiny random Llama built here)')
    parser.add_argument('--max-concurrent-requests', type=int, default=4)
    parser.add_argument('--max-queue-size', type=int, default=0)
    parser.add_argument('--factor', type=int, default=10, help='overload clients = factor x max concurrent')
    parser.add_argument('--seconds', type=float, default=30, help='length of each phase')
    parser.add_argument('--max-tokens', type=int, default=32)
    parser.add_argument('--backoff', type=float, default=0.25, help='seconds a client waits after a 429')
    parser.add_argument('--reject-budget-ms', type=float, default=50, help='p99 time to a 429')
    parser.add_argument('--latency-tolerance', type=float, default=1.5,
                        help='allowed ratio of admitted p50 latency, overload / baseline')
    parser.add_argument('--server-args', default='--dtype float32 --num-gpu-blocks 512 --block-size 16')
    args = parser.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix='overload-')
    model = args.model or build_tiny_model(os.path.join(tmp, 'tiny-llama'))
    port = free_port()
    limits = ['--max-concurrent-requests', str(args.max_concurrent_requests),
              '--max-queue-size', str(args.max_queue_size)]
    proc = start_server(model, port, args.server_args.split() + limits, os.path.join(tmp, 'server.log'))
    url = f'http://127.0.0.1:{port}'
    body = {'model': MODEL_NAME, 'messages': [{'role': 'user', 'content': 'Tell me about paged attention.'}],
            'max_tokens': args.max_tokens, 'ignore_eos': True, 'temperature': 0}
    admitted = args.max_concurrent_requests
    try:
        asyncio.run(run_phase(url, Phase('warm-up', admitted), min(10.0, args.seconds), body, args.backoff))
        baseline = asyncio.run(run_phase(url, Phase('baseline', admitted), args.seconds, body, args.backoff))
        overload = asyncio.run(run_phase(url, Phase('overload', admitted * args.factor), args.seconds, body,
                                         args.backoff))
        after = drain(url)
        health = httpx.get(f'{url}/health', timeout=10).status_code
    finally:
        stop(proc)
    print(f'--max-concurrent-requests {args.max_concurrent_requests} --max-queue-size {args.max_queue_size}, '
          f'{args.seconds:.0f} s per phase, non-streaming chat of {args.max_tokens} tokens, '
          f'{args.backoff} s back-off after a 429')
    header = ('phase', 'clients', 'answered', 'req/s', 'p50 ms', 'p99 ms', '429s', '429 p50 ms', '429 p99 ms',
              '429 max ms', 'max running', 'max waiting', 'other')
    rows = [header]
    for p in (baseline, overload):
        rows.append((p.name, p.clients, len(p.ok), f'{len(p.ok) / args.seconds:.2f}', ms(pct(p.ok, .5)),
                     ms(pct(p.ok, .99)), len(p.rejected), ms(pct(p.rejected, .5)), ms(pct(p.rejected, .99)),
                     ms(max(p.rejected, default=float('nan'))), p.max_running, p.max_waiting,
                     dict(p.other) or '-'))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    for row in rows:
        print('| ' + ' | '.join(str(v).ljust(w) for v, w in zip(row, widths)) + ' |')
    ratio = pct(overload.ok, .5) / pct(baseline.ok, .5)
    print(f'admitted p50 overload/baseline: {ratio:.2f}; after the drain: kv_cache_usage_perc '
          f"{after.get('lmdeploy:kv_cache_usage_perc')}, running {after.get('lmdeploy:num_requests_running')}, "
          f"waiting {after.get('lmdeploy:num_requests_waiting')}; /health {health}")
    failures = []
    if baseline.other or overload.other:
        failures.append(f'unexpected answers: {dict(baseline.other + overload.other)}')
    if baseline.rejected:
        failures.append(f'{len(baseline.rejected)} 429s without overload')
    if not overload.rejected:
        failures.append('no 429 under overload')
    elif pct(overload.rejected, .99) * 1e3 > args.reject_budget_ms:
        failures.append(f'429 p99 {pct(overload.rejected, .99) * 1e3:.0f} ms > {args.reject_budget_ms} ms')
    if not ratio <= args.latency_tolerance:
        failures.append(f'admitted p50 grew {ratio:.2f}x under overload')
    if overload.max_waiting > args.max_queue_size or overload.max_running > args.max_concurrent_requests:
        failures.append('more requests running or waiting than the limits allow')
    if after.get('lmdeploy:kv_cache_usage_perc') != 0 or health != 200:
        failures.append('the server is not idle and healthy afterwards')
    print('PASS' if not failures else 'FAIL: ' + '; '.join(failures))
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
