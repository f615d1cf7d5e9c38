"""Scale-out benchmark: what more processes buy, measured in one run on this machine.

  proxy     32 concurrent streams into one api_server on one core, into two api_servers on one core each
            behind ``lmdeploy serve proxy``, into ``api_server --dp 2``, and (for reference) into one api_server
            on both cores: output tok/s, TTFT and TPOT
  overhead  the proxy's own cost: the p50 latency of small requests (a one-token completion, ``/v1/encode``)
            through the proxy minus straight to its node, in turns; the node on one core, the proxy and
            the client on the others

    python benchmark/scale.py [--parts proxy,overhead] [--model PATH] [--streams 32] [--input-len 128]
                              [--output-len 128] [--repeats 3]

Every server is a subprocess on 127.0.0.1 (pinned to its cores with CPU affinity, one torch thread per
core); the proxy and this client are not pinned, so on a two-core machine they share the nodes' cores.
All configurations start at once and, after a warm-up round each, are measured in turns; prompts are fresh
random token ids every run (no prefix-cache hits).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
from scale_server import MODEL_NAME, _die_with_parent, free_port, percentile, run_streams, stop, wait_ready
from tp import tp_part

STARTUP_BUDGET = 600.0
BLOCK_SIZE = 64  # with a KV cache of twice the workload's blocks, six servers fit in a few GB
OVERHEAD_REQUESTS = 500


def launch(args: list[str], cores: set[int] | None = None) -> subprocess.Popen:
    """``lmdeploy ARGS`` as a child that dies with this process (and keeps to ``cores``)."""
    def setup() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)
    return subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', *args], preexec_fn=setup,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, 'PYTHONUNBUFFERED': '1'})


class Servers:
    """Processes started for one configuration; ``url`` is where clients go. Stopped on exit."""

    def __init__(self, opts: argparse.Namespace):
        self.opts, self.procs, self.url = opts, [], ''

    def api_server(self, cores: set[int] | None, *flags: str, port: int | None = None) -> str:
        port = port or free_port()
        model = [self.opts.model] if self.opts.model else []
        blocks = 2 * self.opts.streams * -(-(self.opts.input_len + self.opts.output_len) // BLOCK_SIZE)
        self.procs.append(launch(['serve', 'api_server', *model, '--server-port', str(port), '--model-name',
                                  MODEL_NAME, '--dtype', self.opts.dtype, '--shutdown-timeout', '1',
                                  '--block-size', str(BLOCK_SIZE), '--num-gpu-blocks', str(blocks), '--log-level',
                                  'WARNING', *flags], cores))  # no access-log line per request in the timings
        url = f'http://127.0.0.1:{port}'
        wait_ready(url, self.procs[-1], time.monotonic() + STARTUP_BUDGET)
        return url

    def proxy(self, nodes: list[str], cores: set[int] | None = None) -> str:
        port = free_port()
        self.procs.append(launch(['serve', 'proxy', '--server-port', str(port), '--nodes', *nodes], cores))
        url = f'http://127.0.0.1:{port}'
        wait_ready(url, self.procs[-1], time.monotonic() + STARTUP_BUDGET)
        return url

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *_) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def one_server(servers: Servers, cores: list[int]) -> str:
    return servers.api_server({cores[0]}, '--num-threads', '1')


def one_server_two_cores(servers: Servers, cores: list[int]) -> str:
    return servers.api_server(set(cores[:2]), '--num-threads', '2')


def two_nodes_behind_proxy(servers: Servers, cores: list[int]) -> str:
    nodes = [servers.api_server({core}, '--num-threads', '1') for core in cores[:2]]
    return servers.proxy(nodes)


def data_parallel(servers: Servers, cores: list[int]) -> str:
    port = free_port(3)  # the replicas listen on the next two ports
    return servers.api_server(set(cores[:2]), '--dp', '2', port=port)


CONFIGS: dict[str, Callable[[Servers, list[int]], str]] = {
    'one server, 1 core': one_server,
    'two nodes + proxy, 1 core each': two_nodes_behind_proxy,
    'api_server --dp 2, 1 core each': data_parallel,
    'one server, 2 cores': one_server_two_cores,
}


def token_pool(url: str) -> list[int]:
    """Distinct token ids of the served model (from ``/v1/encode`` on random letters), to draw prompts from."""
    rng = random.Random(0)
    text = ' '.join(''.join(rng.choice('abcdefghijklmnopqrstuvwxyz') for _ in range(rng.randint(2, 9)))
                    for _ in range(3000))
    ids = httpx.post(f'{url}/v1/encode', json={'input': text}, timeout=60).json()['input_ids']
    return sorted(set(ids))


def workload(pool: list[int], streams: int, input_len: int, output_len: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.choice(pool) for _ in range(input_len)], output_len) for _ in range(streams)]


def measure(url: str, opts: argparse.Namespace, pool: list[int], seed: int) -> dict[str, float]:
    work = workload(pool, opts.streams, opts.input_len, opts.output_len, seed)
    results, seconds = asyncio.run(run_streams(url, work))
    ttft, tpot, tokens = zip(*results)
    return {'tok_s': sum(tokens) / seconds, 'ttft_p50': 1e3 * percentile(ttft, 0.5),
            'ttft_p99': 1e3 * percentile(ttft, 0.99), 'tpot_p50': 1e3 * percentile(tpot, 0.5)}


def latency_p50(urls: list[str], path: str, body: dict) -> list[float]:
    """p50 latency (ms) of ``POST path`` at each of ``urls``, in turns (warm-up requests left out)."""
    times: dict[str, list[float]] = {url: [] for url in urls}
    with httpx.Client(timeout=60) as client:
        for i in range(OVERHEAD_REQUESTS + 20):
            for url in urls if i % 2 else urls[::-1]:
                start = time.perf_counter()
                client.post(f'{url}{path}', json=body).raise_for_status()
                if i >= 20:
                    times[url].append(time.perf_counter() - start)
    return [1e3 * statistics.median(times[url]) for url in urls]


def proxy_part(opts: argparse.Namespace) -> None:
    """All configurations run side by side (idle ones take no CPU) and are measured in turns, ``--repeats``
    times; the medians are reported, so that the load of other jobs on the machine hits them alike."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit('the proxy part needs two cores')
    with contextlib.ExitStack() as stack:
        urls = {name: start(stack.enter_context(Servers(opts)), cores) for name, start in CONFIGS.items()}
        pool = token_pool(urls['one server, 1 core'])
        for url in urls.values():
            asyncio.run(run_streams(url, workload(pool, opts.streams, opts.input_len, 8, seed=-1)))
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
        for repeat in range(opts.repeats):
            for name, url in urls.items():
                runs[name].append(measure(url, opts, pool, seed=repeat))
    print(f'{opts.streams} streams x {opts.output_len} tokens, prompts of {opts.input_len} random tokens; '
          f'medians of {opts.repeats} runs in turns')
    print(f'{"configuration":34} {"tok/s":>8} {"TTFT p50":>9} {"TTFT p99":>9} {"TPOT p50":>9}  runs tok/s')
    rows = {name: {key: statistics.median(run[key] for run in found) for key in found[0]}
            for name, found in runs.items()}
    for name, row in rows.items():
        each = ', '.join(f'{run["tok_s"]:.0f}' for run in runs[name])
        print(f'{name:34} {row["tok_s"]:8.1f} {row["ttft_p50"]:7.0f}ms {row["ttft_p99"]:7.0f}ms '
              f'{row["tpot_p50"]:7.1f}ms  {each}')
    base = rows['one server, 1 core']
    for name in list(CONFIGS)[1:]:
        print(f'{name} / one server, 1 core: throughput x{rows[name]["tok_s"] / base["tok_s"]:.2f}, '
              f'TTFT p50 x{rows[name]["ttft_p50"] / base["ttft_p50"]:.2f}')


def overhead_part(opts: argparse.Namespace) -> None:
    """The p50 latency of small requests through a proxy minus straight to its node. The node has the first
    core; the proxy and this client share the others (where there are others), as a deployed proxy has CPU
    time of its own: on a shared core the proxy's cost would be the node's compute holding it up."""
    cores = sorted(os.sched_getaffinity(0))
    rest = set(cores[1:]) or None
    with Servers(opts) as servers:
        node = servers.api_server({cores[0]}, '--num-threads', '1')
        proxy = servers.proxy([node], rest)
        if rest:
            os.sched_setaffinity(0, rest)
        pool = token_pool(node)
        completion = latency_p50([node, proxy], '/v1/completions', {'model': MODEL_NAME, 'prompt': pool[:16],
                                                                    'max_tokens': 1})
        encode = latency_p50([node, proxy], '/v1/encode', {'input': 'a short text to tokenize'})
    for what, (direct, proxied) in (('one-token completion', completion), ('/v1/encode', encode)):
        print(f'{what} p50 of {OVERHEAD_REQUESTS}: {direct:.2f} ms straight to the node, {proxied:.2f} ms through '
              f'the proxy: the proxy adds {proxied - direct:.2f} ms (target < 2 ms)')


PARTS: dict[str, Callable[[argparse.Namespace], None]] = {'proxy': proxy_part, 'overhead': overhead_part,
                                                          'tp': tp_part}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--parts', default=','.join(PARTS), help=f'comma-separated, of {sorted(PARTS)}')
    parser.add_argument('--model', default=None, help='model path (default: the bundled default model)')
    parser.add_argument('--dtype', default='bfloat16')
    parser.add_argument('--streams', type=int, default=32)
    parser.add_argument('--input-len', type=int, default=128)
    parser.add_argument('--output-len', type=int, default=128)
    parser.add_argument('--repeats', type=int, default=3)
    opts = parser.parse_args()
    for part in opts.parts.split(','):
        print(f'== {part}', flush=True)
        PARTS[part](opts)


if __name__ == '__main__':
    main()
