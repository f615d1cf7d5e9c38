"""Soak test: mixed traffic against a real ``lmdeploy serve api_server`` for a fixed time, then checks that
the server gave everything back.

    python benchmark/soak.py [--duration 600] [--model PATH] [--clients 8] [--kinds tools,structured,reasoning]
                             [--url http://... --server-pid PID]

Without ``--url`` it starts the server itself, on a tiny random model it builds (``--model-kind``: the Llama
of tests/conftest.py, the tool model of tests/tool_models.py or the Qwen2-VL of tests/vl_models.py) unless
``--model``. Traffic (benchmark/soak_traffic.py): chat and completions, streaming and not, ``n`` > 1, stop
words, logprobs (chat top_logprobs, completions logprobs and echo), prompts sharing a long prefix (the prefix
cache), and with ``--kinds`` tool calls, structured outputs, reasoning and images; ``--disconnect`` (30%) of
the valid requests dropped by the client at a random point and ``--invalid`` (5%) invalid requests (each
must get a 4xx).

It prints requests served, p50/p99 latency, outcomes and errors by kind, the server's RSS (at start, after
the warm-up and at the end), how its memory, open files, threads, children and grammar cache went (sampled
every ``--sample-every`` seconds; benchmark/soak_watch.py), the KV-cache usage after the drain
(``lmdeploy:kv_cache_usage_perc`` of /metrics) and its CPU use once idle. It exits 1 unless: zero 5xx, every
valid request answered in full (or dropped by its own client) and its answer valid (a structured output
matches its format, a forced tool call names its function with arguments of its schema...), every invalid
one a 4xx, no request running or waiting and KV usage 0 after the drain, /health 200, RSS growth after the
warm-up under ``--rss-tolerance`` (5%) and the idle server under ``--idle-cpu-limit``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
from scale_server import free_port, stop
from soak_client import Stats, drive
from soak_traffic import KINDS, MODEL_NAME
from soak_watch import Watcher, idle_cpu, parse_metrics, summary

HERE = os.path.dirname(os.path.abspath(__file__))
# How a tiny model of each kind is saved (by a process of its own; code run with tests/ on the path)
MODEL_BUILDERS = {
    'llama': 'from conftest import save_tiny_model; save_tiny_model("llama", path)',
    'tool': 'from tool_models import save_tool_model; save_tool_model(path)',
    'qwen2_vl': 'from vl_models import save_tiny_vl_model; save_tiny_vl_model("qwen2_vl", path)'}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float('nan')


def build_tiny_model(path: str, kind: str = 'llama') -> str:
    """The tiny random model of the tests of ``kind`` (see :data:`MODEL_BUILDERS`), saved at ``path`` by a
    process of its own: torch stays out of this one, whose latencies would include each full garbage
    collection of torch's objects (0.2-0.4 s)."""
    code = f'import sys; sys.path.insert(0, sys.argv[1]); path = sys.argv[2]; {MODEL_BUILDERS[kind]}'
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


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f'{url}/metrics', timeout=10).text)


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--duration', type=float, default=600, help='seconds of traffic, warm-up included')
    parser.add_argument('--warmup', type=float, default=None,
                        help='seconds of traffic before the RSS baseline (default: a quarter, at most 60 s)')
    parser.add_argument('--model', default=None, help='model path (default: a tiny random model built here)')
    parser.add_argument('--model-kind', choices=sorted(MODEL_BUILDERS), default=None,
                        help='the tiny model to build without --model (default: qwen2_vl with images, tool with '
                        'tools or reasoning, else llama)')
    parser.add_argument('--kinds', default='', help=f'agent traffic to add, comma-separated: {", ".join(KINDS)}')
    parser.add_argument('--formats', type=int, default=1000,
                        help='distinct schemas, tool sets, regexes and choice lists the agent traffic draws from')
    parser.add_argument('--tool-call-parser', default='hermes', help='of the server it starts, with tools')
    parser.add_argument('--reasoning-parser', default='qwen3', help='of the server it starts, with reasoning')
    parser.add_argument('--url', default=None, help='a running server (default: start one)')
    parser.add_argument('--server-pid', type=int, default=None, help='with --url: its pid, for the RSS')
    parser.add_argument('--clients', type=int, default=8, help='concurrent clients')
    parser.add_argument('--max-tokens', type=int, default=24, help='max_tokens of a request: 1..this')
    parser.add_argument('--disconnect', type=float, default=0.3, help='share of valid requests the client drops')
    parser.add_argument('--invalid', type=float, default=0.05, help='share of invalid requests')
    parser.add_argument('--rss-tolerance', type=float, default=0.05, help='allowed RSS growth after the warm-up')
    parser.add_argument('--sample-every', type=float, default=10,
                        help='seconds between samples of the server (RSS, files, threads, /metrics)')
    parser.add_argument('--samples-json', default=None, help='write the samples here')
    parser.add_argument('--idle-seconds', type=float, default=5, help='how long to measure the idle CPU use')
    parser.add_argument('--idle-cpu-limit', type=float, default=0.1,
                        help='CPU (share of one core) the server may use when idle after the drain')
    parser.add_argument('--request-timeout', type=float, default=60,
                        help='seconds a request may take before it counts as a timeout')
    parser.add_argument('--errors-json', default=None, help='write every error (with its request) here')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--server-args', default='--dtype float32 --session-len 1024 --num-gpu-blocks 512 '
                        '--block-size 16', help='extra flags of lmdeploy serve api_server it starts')
    args = parser.parse_args(argv)
    args.kinds = tuple(k for k in args.kinds.split(',') if k)
    if set(args.kinds) - set(KINDS):
        parser.error(f'--kinds: unknown {sorted(set(args.kinds) - set(KINDS))}; known: {", ".join(KINDS)}')
    if args.model_kind is None:
        args.model_kind = 'qwen2_vl' if 'images' in args.kinds else \
            'tool' if {'tools', 'reasoning'} & set(args.kinds) else 'llama'
    return args


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = args.server_args.split()
    if 'tools' in args.kinds:  # the tools' schemas go into the prompt: tokens of the tiny vocabulary are short
        flags += ['--tool-call-parser', args.tool_call_parser, '--session-len', '4096']
    if 'reasoning' in args.kinds:
        flags += ['--reasoning-parser', args.reasoning_parser]
    return flags


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 4)
    proc, tmp, watcher = None, tempfile.mkdtemp(prefix='soak-'), None
    log_path = os.path.join(tmp, 'server.log')
    stats = Stats()
    try:
        if args.url:
            url, pid = args.url, args.server_pid
        else:
            model = args.model or build_tiny_model(os.path.join(tmp, f'tiny-{args.model_kind}'), args.model_kind)
            port = free_port()
            proc = start_server(model, port, server_flags(args), log_path)
            url, pid = f'http://127.0.0.1:{port}', proc.pid
        watcher = Watcher(pid, url, args.sample_every) if pid is not None else None
        rss_start = rss_mb(pid)
        t0 = time.monotonic()
        asyncio.run(drive(url, args, stats, warmup, args.seed))
        drain(url)
        rss_warm = rss_mb(pid)
        warm_latency, stats.latency = stats.latency, []     # latency is reported after the warm-up
        warm_requests = stats.requests
        asyncio.run(drive(url, args, stats, max(0.0, args.duration - warmup), args.seed + 1))
        traffic_s = time.monotonic() - t0
        after = drain(url)
        rss_end = rss_mb(pid)
        idle = idle_cpu(pid, args.idle_seconds) if pid is not None else (float('nan'), [])
        health = httpx.get(f'{url}/health', timeout=10).status_code
    finally:
        samples = watcher.stop() if watcher is not None else []
        if proc is not None:
            stop(proc)
    if args.samples_json:
        with open(args.samples_json, 'w') as f:
            json.dump(samples, f, indent=1)
    kv = after.get('lmdeploy:kv_cache_usage_perc', float('nan'))
    running = after.get('lmdeploy:num_requests_running', float('nan'))
    waiting = after.get('lmdeploy:num_requests_waiting', float('nan'))
    growth = (rss_end - rss_warm) / rss_warm
    total = stats.requests
    after_warmup = total - warm_requests
    print(f'soak: {traffic_s:.0f} s of traffic ({warmup:.0f} s warm-up), {args.clients} clients, '
          f'{total} requests; kinds: base{"".join(", " + k for k in args.kinds)}; load {os.getloadavg()[0]:.1f}')
    print(f'  served in full: {stats.served} ({stats.served / traffic_s:.2f} req/s); latency after the warm-up '
          f'p50 {pct(stats.latency, .5) * 1e3:.0f} ms, p99 {pct(stats.latency, .99) * 1e3:.0f} ms '
          f'(warm-up: p50 {pct(warm_latency, .5) * 1e3:.0f} ms, p99 {pct(warm_latency, .99) * 1e3:.0f} ms)')
    print(f'  outcomes: {dict(stats.outcomes)}')
    print(f'  errors by kind: {dict(stats.errors) or "none"}')
    for kind, example in stats.examples.items():
        print(f'    {kind}: {example}')
    print(f'  server RSS (with its children): start {rss_start:.0f} MiB, after warm-up {rss_warm:.0f} MiB, '
          f'end {rss_end:.0f} MiB ({growth * 100:+.1f}% after warm-up, '
          f'{(rss_end - rss_warm) / max(after_warmup, 1) * 1000:+.2f} MiB per 1,000 of its {after_warmup} requests)')
    for line in summary(samples, warmup):
        print(f'  after the warm-up, {line}')
    print(f'  after the drain: kv_cache_usage_perc {kv}, running {running}, waiting {waiting}; /health {health}; '
          f'idle CPU {idle[0] * 100:.1f}% of a core (busiest threads: '
          f'{", ".join(f"{name} {share * 100:.1f}%" for name, share in idle[1])})')
    failures = []
    if stats.errors:
        failures.append(f'errors: {dict(stats.errors)}')
    if kv != 0 or running != 0 or waiting != 0:
        failures.append('the server is not idle after the drain')
    if health != 200:
        failures.append(f'/health {health}')
    if pid is not None and growth >= args.rss_tolerance:
        failures.append(f'RSS grew {growth * 100:.1f}% after the warm-up')
    if pid is not None and idle[0] > args.idle_cpu_limit:
        failures.append(f'the idle server used {idle[0] * 100:.1f}% of a core')
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
