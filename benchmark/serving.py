"""Serving benchmark: N concurrent streaming clients against ``lmdeploy serve api_server``, then the same
workload through the offline engine; prints throughput, TTFT/TPOT (median, p99) and the offline/server ratio.

    python benchmark/serving.py [--model PATH] [--num-prompts 32] [--output-len 128] [--url http://...]

Without ``--url`` it starts the server itself (a subprocess on the default model unless ``--model``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import torch

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


WARMUP_TOKENS = 16


def prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (length,), generator=g).tolist() for _ in range(num)]


def rates(runs: list[dict]) -> str:
    return ', '.join(f"{run['tokens'] / run['elapsed']:.1f}" for run in runs)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float('nan')


async def one_stream(http: httpx.AsyncClient, ids: list[int], output_len: int) -> tuple[float, float, int]:
    """(ttft, tpot, output tokens) of one streamed /generate request."""
    body = {'input_ids': ids, 'max_tokens': output_len, 'ignore_eos': True, 'stream': True}
    start, first, tokens = time.perf_counter(), None, 0
    async with http.stream('POST', '/generate', json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith('data:') and line != 'data: [DONE]':
                chunk = json.loads(line[5:])
                tokens += len(chunk['token_ids'])
                if first is None and chunk['token_ids']:
                    first = time.perf_counter()
    end = time.perf_counter()
    return first - start, (end - first) / max(tokens - 1, 1), tokens


async def run_server_clients(url: str, work: list[list[int]], output_len: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=1024)) as http:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_stream(http, ids, output_len) for ids in work))
        elapsed = time.perf_counter() - start
    ttft, tpot, tokens = zip(*results)
    return {'elapsed': elapsed, 'tokens': sum(tokens), 'ttft': list(ttft), 'tpot': list(tpot)}


def run_offline(engine: Engine, work: list[list[int]], output_len: int) -> dict:
    config = GenerationConfig(max_new_tokens=output_len, ignore_eos=True)
    start, tokens = time.perf_counter(), 0
    for ids in work:
        engine.add_request(ids, config)
    while engine.has_unfinished():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return {'elapsed': time.perf_counter() - start, 'tokens': tokens}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = args.port
    cmd = [sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', *([args.model] if args.model else []),
           '--server-port', str(port), '--dtype', args.dtype, '--max-batch-size', str(args.max_batch_size),
           '--log-level', 'WARNING']  # no access-log line per request in the timings
    proc = subprocess.Popen(cmd, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f'{url}/health').status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError('the server did not start')
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='model path (default: the bundled default model)')
    parser.add_argument('--url', default=None, help='a running server (default: start one)')
    parser.add_argument('--port', type=int, default=23334)
    parser.add_argument('--num-prompts', type=int, default=32)
    parser.add_argument('--input-len', type=int, default=128)
    parser.add_argument('--output-len', type=int, default=128)
    parser.add_argument('--dtype', default='auto')
    parser.add_argument('--max-batch-size', type=int, default=64)
    parser.add_argument('--repeats', type=int, default=3,
                        help='server and offline runs alternate this many times (fresh prompts each time); '
                             'the medians are reported, so that the VM drifting affects both sides alike')
    args = parser.parse_args()
    engine = Engine(args.model, PytorchEngineConfig(dtype=args.dtype, max_batch_size=args.max_batch_size),
                    show_progress=False)
    vocab = engine.model_config.vocab_size
    # Warm-up with the same shapes: the first run of each GEMM shape pays for oneDNN's kernel generation,
    # in the server and offline alike. Every run gets its own prompts, so the prefix cache cannot help.
    warmup = prompts(args.num_prompts, args.input_len, vocab, seed=1000)
    proc, url = (None, args.url) if args.url else start_server(args)
    servers, offlines = [], []
    try:
        asyncio.run(run_server_clients(url, warmup, WARMUP_TOKENS))
        run_offline(engine, warmup, WARMUP_TOKENS)
        for repeat in range(args.repeats):
            work = prompts(args.num_prompts, args.input_len, vocab, seed=repeat)
            servers.append(asyncio.run(run_server_clients(url, work, args.output_len)))
            offlines.append(run_offline(engine, work, args.output_len))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    server_tps = statistics.median(run['tokens'] / run['elapsed'] for run in servers)
    offline_tps = statistics.median(run['tokens'] / run['elapsed'] for run in offlines)
    ttft = [t for run in servers for t in run['ttft']]
    tpot = [t for run in servers for t in run['tpot']]
    print(f'{args.num_prompts} streams x {args.output_len} tokens (prompts of {args.input_len} random tokens), '
          f'median of {args.repeats} alternating runs')
    print(f'server : {server_tps / args.output_len:.2f} req/s, {server_tps:.1f} output tok/s  (runs: {rates(servers)})')
    print(f'         TTFT median {statistics.median(ttft) * 1e3:.1f} ms, p99 {pct(ttft, .99) * 1e3:.1f} ms; '
          f'TPOT median {statistics.median(tpot) * 1e3:.1f} ms, p99 {pct(tpot, .99) * 1e3:.1f} ms')
    print(f'offline: {offline_tps / args.output_len:.2f} req/s, {offline_tps:.1f} output tok/s  (runs: {rates(offlines)})')
    print(f'offline/server throughput ratio: {offline_tps / server_tps:.3f} (target <= 1.15)')


if __name__ == '__main__':
    main()
