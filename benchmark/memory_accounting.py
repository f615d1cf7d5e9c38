"""Where a process's anonymous memory goes: the bytes of the tensors a model holds (each storage once), against
anonymous RSS and glibc malloc's own counts (``mallinfo2``). Used by
``benchmark/gguf_moe_rss.py --account``."""
from __future__ import annotations

import ctypes
import functools
import gc
from pathlib import Path

import torch

GIB = 2**30


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                                      'fsmblks', 'uordblks', 'fordblks', 'keepcost')]


def libc() -> ctypes.CDLL:
    lib = ctypes.CDLL('libc.so.6')
    lib.mallinfo2.restype = MallInfo2
    return lib


def anonymous_gib() -> float:
    """Anonymous resident memory of this process (``/proc/self/smaps_rollup``'s ``Anonymous``)."""
    rollup = Path('/proc/self/smaps_rollup').read_text()
    return int(next(line for line in rollup.splitlines() if line.startswith('Anonymous:')).split()[1]) / 2**20


def malloc_gib() -> dict[str, float]:
    """glibc's heap over all arenas: ``heap`` taken from the system by brk/arenas, ``mmapped`` in chunks of their
    own, ``in_use`` allocated in the heap, ``free`` heap bytes free (fragmentation once the heap is filled)."""
    info = libc().mallinfo2()
    return {'heap': info.arena / GIB, 'mmapped': info.hblkhd / GIB, 'in_use': info.uordblks / GIB,
            'free': info.fordblks / GIB}


def _children(obj: object) -> list:
    if isinstance(obj, torch.nn.Module):
        return list(vars(obj).values())
    if isinstance(obj, dict):
        return list(obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, functools.partial):
        return [obj.func, *obj.args, *obj.keywords.values()]
    if hasattr(obj, '__self__') and not isinstance(obj, type):
        return [obj.__self__]
    if callable(obj) and getattr(obj, '__closure__', None):
        return [cell.cell_contents for cell in obj.__closure__]
    if hasattr(obj, '__dict__') and not isinstance(obj, type):
        return list(vars(obj).values())
    return []


def storages(roots: list) -> dict[int, int]:
    """``{storage address: bytes}`` of every CPU tensor reachable from ``roots`` through modules, attributes,
    containers, bound methods and closures (each storage once, views counted by their storage; a oneDNN tensor by its
elements, keyed by the object)."""
    found, seen, stack = {}, set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == 'cpu' and obj.layout == torch._mkldnn:  # oneDNN's packed copy: no storage
                found[id(obj)] = obj.numel() * obj.element_size()
            elif obj.device.type == 'cpu':
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
            continue
        stack.extend(_children(obj))
    return found


def all_tensor_storages() -> dict[int, int]:
    """The storages of every CPU tensor the garbage collector tracks in the process."""
    return storages([obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)])


def gib(found: dict[int, int]) -> float:
    return sum(found.values()) / GIB
