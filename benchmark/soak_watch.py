"""What the soak (benchmark/soak.py) watches of the server process: memory, open files, threads and CPU, and
the server's own /metrics, sampled every few seconds; and its CPU use once idle."""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import httpx
import psutil

WATCHED_METRICS = ('lmdeploy:kv_cache_usage_perc', 'lmdeploy:num_requests_running', 'lmdeploy:num_requests_waiting',
                   'lmdeploy:grammar_cache_entries', 'lmdeploy:grammar_cache_bytes')


@dataclass
class Sample:
    seconds: float       # since the watch began
    rss_mb: float        # the server process
    children_rss_mb: float
    fds: int             # open file descriptors of the server process
    threads: int
    children: int
    cpu_seconds: float   # user + system of the server process so far
    metrics: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in (line.rsplit(' ', 1) for line in text.splitlines()
                                                   if line and not line.startswith('#'))}


def sample(pid: int, url: str, since: float) -> Sample:
    proc = psutil.Process(pid)
    with proc.oneshot():
        rss, fds, threads, cpu = proc.memory_info().rss, proc.num_fds(), proc.num_threads(), proc.cpu_times()
    children = proc.children(recursive=True)
    children_rss = 0
    for child in children:
        try:
            children_rss += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    try:
        m = parse_metrics(httpx.get(f'{url}/metrics', timeout=10).text)
    except httpx.HTTPError:
        m = {}
    return Sample(time.monotonic() - since, rss / 2 ** 20, children_rss / 2 ** 20, fds, threads, len(children),
                  cpu.user + cpu.system, {k: m[k] for k in WATCHED_METRICS if k in m})


class Watcher:
    """Samples the server ``pid`` every ``every`` seconds on a thread of its own until :meth:`stop`."""

    def __init__(self, pid: int, url: str, every: float):
        self.pid, self.url, self.every = pid, url, every
        self.samples: list[Sample] = []
        self._since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name='soak-watch')
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.samples.append(sample(self.pid, self.url, self._since))
            except psutil.Error:
                return
            if self._stop.wait(self.every):
                return

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return [asdict(s) for s in self.samples]


def idle_cpu(pid: int, seconds: float, top: int = 3) -> tuple[float, list[tuple[str, float]]]:
    """The CPU share (of one core) the idle server ``pid`` uses over ``seconds``, and its ``top`` busiest
    threads (name (id), share)."""
    proc = psutil.Process(pid)

    def per_thread() -> dict[int, float]:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}

    before, cpu_before, start = per_thread(), sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    after, cpu_after, wall = per_thread(), sum(proc.cpu_times()[:2]), time.monotonic() - start
    busy = sorted(((after[t] - before.get(t, 0.0)) / wall, t) for t in after)[::-1][:top]
    return (cpu_after - cpu_before) / wall, [(f'{_thread_name(pid, t)} ({t})', share) for share, t in busy]


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f'/proc/{pid}/task/{tid}/comm') as f:
            return f.read().strip()
    except OSError:
        return '?'


def summary(samples: list[dict], baseline: float) -> list[str]:
    """Lines on how the samples taken after ``baseline`` seconds (the warm-up) changed: first, max, last."""
    after = [s for s in samples if s['seconds'] >= baseline] or samples
    if not after:
        return []
    lines = [rss_trend(after)] if len(after) >= 4 else []
    for name, unit in (('rss_mb', ' MiB'), ('children_rss_mb', ' MiB'), ('fds', ''), ('threads', ''),
                       ('children', '')):
        values = [s[name] for s in after]
        lines.append(f'{name}: {values[0]:.0f} -> max {max(values):.0f} -> {values[-1]:.0f}{unit}')
    for name in WATCHED_METRICS[3:]:
        values = [s['metrics'].get(name) for s in after if name in s['metrics']]
        if values:
            lines.append(f'{name}: {values[0]:.0f} -> max {max(values):.0f} -> {values[-1]:.0f}')
    return lines


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of (seconds, value) points, per minute."""
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 60 if spread else 0.0


def rss_trend(samples: list[dict]) -> str:
    """How fast the server's RSS (with its children) grew in the first and the second half of ``samples``: a
    leak keeps its slope, an allocator settling flattens."""
    points = [(s['seconds'], s['rss_mb'] + s['children_rss_mb']) for s in samples]
    half = len(points) // 2
    return (f'rss slope (with its children): {slope_per_minute(points[:half]):+.2f} MiB/min in the first half, '
            f'{slope_per_minute(points[half:]):+.2f} MiB/min in the second')
