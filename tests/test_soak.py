"""A short soak of benchmark/soak.py (issue 18): mixed traffic against a real server process for
``SOAK_SECONDS`` (30 s; the full run is ``python benchmark/soak.py``, 10 minutes), then zero 5xx, every
valid request answered or dropped by its own client (and each answer checked against its format or tool
choice), KV usage 0 after the drain, RSS growth after the warm-up under 5% and an idle server after it.
The traffic is the base mix and the agent kinds (tool calls, structured outputs, reasoning, images)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys

import httpx
import pytest
from server_helpers import serve, slow_down, tiny_engine

BENCHMARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark')
sys.path.insert(0, BENCHMARK)
import soak  # noqa: E402
import soak_client  # noqa: E402
import soak_watch  # noqa: E402

SOAK_SECONDS = float(os.environ.get('SOAK_SECONDS', '30'))


@pytest.fixture(scope='module')
def slow_server(tiny_llama):
    engine = tiny_engine(tiny_llama)
    slow_down(engine, 0.005)
    yield from serve(engine, model_name=soak.MODEL_NAME)


def test_dropped_requests_leave_the_client_usable(slow_server):
    """The soak's clients drop requests without losing connections of their pool: after 200 requests dropped
    mid-way, a client whose pool holds a single connection is still answered at once (a request cancelled on
    the pool itself can keep its connection taken for good, and then every later request of the client waits
    for a connection until it times out)."""
    rng = random.Random(0)
    body = {'model': soak.MODEL_NAME, 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 50,
            'ignore_eos': True}

    async def main():
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=60, limits=limits) as http:
            dropped = [await soak_client.post_and_drop(http, '/v1/chat/completions', body,
                                                       rng.uniform(0.0, 0.05)) is None for _ in range(200)]
            answer = await http.post('/v1/chat/completions', json={**body, 'max_tokens': 1},
                                     timeout=httpx.Timeout(60, pool=5))
            return sum(dropped), answer.status_code

    dropped, status = asyncio.run(main())
    assert dropped >= 150 and status == 200


@pytest.mark.slow
def test_soak(capsys):
    """The base mix and all the agent traffic on one server the soak starts: the tiny Qwen2-VL with the hermes
    and qwen3 parsers (its template ignores tools: the tool model's run is the full soak's)."""
    rc = soak.main(['--kinds', ','.join(soak.KINDS), '--model-kind', 'qwen2_vl', '--duration', str(SOAK_SECONDS),
                    '--warmup', str(SOAK_SECONDS * 0.3), '--sample-every', '2', '--idle-seconds', '2',
                    '--formats', '200'])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
    assert all(f'served_{kind}' in out for kind in soak.KINDS), out


def test_rss_trend_tells_a_leak_from_a_plateau():
    """The soak's RSS slope by half: a linear climb keeps its slope, a climb that levels off loses it."""
    linear = [{'seconds': t, 'rss_mb': 500 + t / 20, 'children_rss_mb': 100} for t in range(0, 600, 10)]
    plateau = [{'seconds': t, 'rss_mb': 500, 'children_rss_mb': min(t, 200) / 20} for t in range(0, 600, 10)]
    assert soak_watch.rss_trend(linear) == ('rss slope (with its children): +3.00 MiB/min in the first half, '
                                            '+3.00 MiB/min in the second')
    assert soak_watch.rss_trend(plateau).endswith('+0.00 MiB/min in the second')


PROBED = """import json
import sys
import tracemalloc
from dataclasses import dataclass

import memory_probe


@dataclass
class Kept:
    data: bytearray


probe = memory_probe.Probe(sys.argv[1], trace=True)
try:
    first = probe.record()
    kept = [Kept(bytearray(1024)) for _ in range(2000)]
    second = probe.record(trim=True)
finally:
    tracemalloc.stop()
print(json.dumps([first, second, len(kept)]))
"""


def test_memory_probe_records(tmp_path):
    """A record of benchmark/memory_probe.py: the RSS and glibc's heap, the live objects by type, with
    tracemalloc the sites grown since the record before, and after malloc_trim the RSS again. In a process of
    its own: in the suite's, each record's collection and count of every object took seconds."""
    out, script = tmp_path / 'probe.jsonl', tmp_path / 'probed.py'
    script.write_text(PROBED)
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([BENCHMARK, os.environ.get('PYTHONPATH', '')])}
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second, kept = json.loads(proc.stdout)
    assert 'grown' not in first and first['rss_mib'] > 0 and first['glibc_mib']['in_use'] > 0
    assert any('probed.py' in site and int(site.split()[-4]) >= 2000 for site in second['grown']), second['grown']
    assert second['types']['Kept'] == 2000 and kept == 2000
    assert 0 < second['trim']['rss_mib_after'] <= second['trim']['rss_mib_before']
    assert [json.loads(line)['time'] for line in out.read_text().splitlines()] == [first['time'], second['time']]
