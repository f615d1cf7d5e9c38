"""``gpu_scale.py``'s server part: starts ``lmdeploy serve api_server`` as a subprocess on 127.0.0.1, streams
concurrent ``/v1/completions`` requests into it with httpx and measures TTFT and TPOT."""
from __future__ import annotations

import asyncio
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from lmdeploy.serve.ports import free_port

MODEL_NAME = 'bench'
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child must not take the loader's lock


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel kills it when the benchmark process dies, however."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def stream_one(client: httpx.AsyncClient, prompt: list[int], n_out: int) -> tuple[float, float, int]:
    """(TTFT s, TPOT s, output tokens) of one streamed completion: TTFT up to the first chunk with text,
    TPOT = (last chunk - first chunk) / (tokens - 1), tokens from the closing usage chunk."""
    body = {'model': MODEL_NAME, 'prompt': prompt, 'max_tokens': n_out, 'ignore_eos': True, 'temperature': 0,
            'stream': True, 'stream_options': {'include_usage': True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream('POST', '/v1/completions', json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f'HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}')
        async for line in resp.aiter_lines():
            if not line.startswith('data: ') or line == 'data: [DONE]':
                continue
            chunk = json.loads(line[6:])
            if 'error' in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get('usage'):
                tokens = chunk['usage']['completion_tokens']
            if chunk['choices'] and chunk['choices'][0]['text']:
                last = time.perf_counter()
                first = first or last
    if first is None or tokens != n_out:
        raise RuntimeError(f'a stream returned {tokens} tokens ({n_out} asked for) and text: {first is not None}')
    return first - start, (last - first) / max(tokens - 1, 1), tokens


async def run_streams(url: str, work: list[tuple[list[int], int]]) -> tuple[list[tuple[float, float, int]], float]:
    """All of ``work`` at once; each stream's (TTFT, TPOT, tokens) and the seconds until the last ended."""
    limits = httpx.Limits(max_connections=len(work) + 8, max_keepalive_connections=len(work) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, prompt, n) for prompt, n in work))
        return results, time.perf_counter() - start


def wait_ready(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while True:
        try:
            if httpx.get(f'{url}/health', timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f'the server exited with status {proc.returncode} before it was ready')
        if time.monotonic() > deadline:
            raise TimeoutError('the server was not ready within the part budget')
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains within its --shutdown-timeout), SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_latency(model_dir: str, flags: list[str], work: list[tuple[list[int], int]], deadline: float,
                   log_path: str) -> dict[str, float]:
    """TTFT/TPOT p50 and p99 (ms) and output tok/s of ``work`` streamed all at once into a server started
    on ``model_dir`` with ``flags``, after a short warm-up round; the server's log goes to ``log_path``
    (its tail is printed when the part fails)."""
    port = free_port()
    url = f'http://127.0.0.1:{port}'
    cmd = [sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', model_dir, '--server-name', '127.0.0.1',
           '--server-port', str(port), '--model-name', MODEL_NAME, '--shutdown-timeout', '1',
           '--log-level', 'WARNING', *flags]  # no access-log line per request in the timings
    with open(log_path, 'w') as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    try:
        wait_ready(url, proc, deadline)
        asyncio.run(run_streams(url, [(prompt[:64], 8) for prompt, _ in work[:4]]))
        results, seconds = asyncio.run(run_streams(url, work))
    except BaseException:
        with open(log_path) as log:
            print(f'--- server log tail ({" ".join(cmd)}):\n{log.read()[-3000:]}', file=sys.stderr, flush=True)
        raise
    finally:
        stop(proc)
    ttft, tpot, tokens = zip(*results)
    return {'ttft_p50': 1e3 * percentile(ttft, 0.5), 'ttft_p99': 1e3 * percentile(ttft, 0.99),
            'tpot_p50': 1e3 * percentile(tpot, 0.5), 'tpot_p99': 1e3 * percentile(tpot, 0.99),
            'tokens_per_s': sum(tokens) / seconds}
