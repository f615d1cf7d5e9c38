"""Where a server's memory goes: runs an ``lmdeploy`` command (``serve api_server ...``) in this process with
two signal handlers that append a record of the process's memory to ``--out`` (JSON lines):

    python benchmark/memory_probe.py --out probe.jsonl [--tracemalloc] serve api_server MODEL ...
    kill -USR1 PID   # a record
    kill -USR2 PID   # a record, then malloc_trim(0) and the RSS after it

A record holds the RSS, glibc's heap (``mallinfo2``: bytes of its arenas, in use and free), the live
gc-tracked objects by type (after a collection) and the largest containers. With ``--tracemalloc`` the first
record starts tracemalloc and each later one lists the allocation sites that grew most since the one before
(Python objects, bytes and numpy arrays; not torch's tensors). What ``malloc_trim`` gives back was memory
glibc held free, not a leak. The handlers run on the main thread between two bytecodes, as any Python signal
handler: attaching a debugger to call into a busy server instead can deadlock it (gdb did, on the soak).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import linecache
import runpy
import signal
import sys
import time
import tracemalloc

MALLINFO_FIELDS = ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks', 'fsmblks', 'uordblks', 'fordblks',
                   'keepcost')
CONTAINERS = (dict, list, set, collections.deque, collections.OrderedDict, collections.defaultdict)


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO_FIELDS]


def rss_mib() -> float:
    with open('/proc/self/status') as f:
        return next(int(line.split()[1]) for line in f if line.startswith('VmRSS')) / 1024


def glibc_heap_mib(libc: ctypes.CDLL) -> dict[str, float]:
    """glibc's heap: ``arena`` (obtained from the system, all arenas), ``in_use``, ``free`` (held in the
    arenas) and ``mmapped`` (large blocks, given back on free)."""
    info = libc.mallinfo2()
    return {'arena': info.arena / 2 ** 20, 'in_use': info.uordblks / 2 ** 20, 'free': info.fordblks / 2 ** 20,
            'mmapped': info.hblkhd / 2 ** 20}


class Probe:
    """Writes a record per signal to ``out``; see the module's docstring."""

    def __init__(self, out: str, trace: bool, top: int = 20):
        self.out, self.trace, self.top = out, trace, top
        self.libc = ctypes.CDLL('libc.so.6')
        self.libc.mallinfo2.restype = MallInfo2
        self.snapshot: tracemalloc.Snapshot | None = None

    def record(self, trim: bool = False) -> dict:
        rec = {'time': time.time(), 'rss_mib': rss_mib(), 'glibc_mib': glibc_heap_mib(self.libc),
               'collected': gc.collect()}
        objects = gc.get_objects()
        rec['gc_objects'] = len(objects)
        rec['types'] = dict(collections.Counter(type(o).__qualname__ for o in objects).most_common(self.top * 2))
        largest = sorted(((len(o), i) for i, o in enumerate(objects) if type(o) in CONTAINERS), reverse=True)
        rec['largest_containers'] = [(size, type(objects[i]).__qualname__, repr(objects[i])[:120])
                                     for size, i in largest[:self.top]]
        del objects, largest
        if self.trace:
            if not tracemalloc.is_tracing():
                tracemalloc.start(8)
            snapshot = tracemalloc.take_snapshot().filter_traces(  # not its own allocations, nor the source lines
                [tracemalloc.Filter(False, module) for module in (tracemalloc.__file__, linecache.__file__, __file__)])
            if self.snapshot is not None:
                stats = snapshot.compare_to(self.snapshot, 'traceback')
                rec['grown_kib'] = sum(stat.size_diff for stat in stats) / 1024
                rec['grown'] = ['\n'.join(stat.traceback.format()[-4:]) + f'\n  {stat.size_diff / 1024:+.0f} KiB '
                                f'{stat.count_diff:+d} blocks' for stat in stats[:self.top]]
                del stats
            self.snapshot = snapshot
            rec['traced_mib'] = tracemalloc.get_traced_memory()[0] / 2 ** 20
        if trim:
            before = rss_mib()
            self.libc.malloc_trim(0)
            rec['trim'] = {'rss_mib_before': before, 'rss_mib_after': rss_mib(),
                           'glibc_mib_after': glibc_heap_mib(self.libc)}
        with open(self.out, 'a') as f:
            f.write(json.dumps(rec) + '\n')
        return rec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', required=True, help='JSON lines file the records are appended to')
    parser.add_argument('--tracemalloc', action='store_true', help='trace allocations from the first record on')
    parser.add_argument('command', nargs=argparse.REMAINDER, help='the lmdeploy command, e.g. serve api_server MODEL')
    args = parser.parse_args()
    probe = Probe(args.out, args.tracemalloc)
    signal.signal(signal.SIGUSR1, lambda signum, frame: probe.record())
    signal.signal(signal.SIGUSR2, lambda signum, frame: probe.record(trim=True))
    sys.argv = ['lmdeploy', *args.command]
    runpy.run_module('lmdeploy.cli.main', run_name='__main__')


if __name__ == '__main__':
    main()
