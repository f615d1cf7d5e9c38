"""OpenMP parallel regions a batch-1 decode step opens: a served folder (e.g. ``benchmark/gguf_moe_rss.py``'s
``DIR/served``) loaded in bf16, greedy decode steps counted with a shim preloaded over libgomp's ``GOMP_parallel``
(the call that every ``#pragma omp parallel`` of the native kernels and of torch's ``at::parallel_for`` makes),
compiled here with the system's C compiler. Prints regions a step and the decode rate.

    python benchmark/omp_regions.py /tmp/moethreads/m8/served [--threads 2] [--steps 16]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHIM = r'''
#define _GNU_SOURCE
#include <dlfcn.h>
static unsigned long regions;
typedef void (*parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
void GOMP_parallel(void (*fn)(void *), void *data, unsigned threads, unsigned flags) {
  static parallel_fn real;
  if (!real) real = (parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  __atomic_add_fetch(&regions, 1, __ATOMIC_RELAXED);
  real(fn, data, threads, flags);
}
unsigned long omp_regions_opened(void) { return regions; }
'''


def build_shim(folder: Path) -> Path:
    source, shim = folder / 'shim.c', folder / 'omp_regions_shim.so'
    source.write_text(SHIM)
    subprocess.run(['cc', '-O2', '-shared', '-fPIC', str(source), '-o', str(shim), '-ldl'], check=True)
    return shim


def count(args: argparse.Namespace) -> None:
    from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    opened = ctypes.CDLL(None).omp_regions_opened
    opened.restype = ctypes.c_ulong
    engine = Engine(args.folder, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=16, block_size=16,
                                                     num_threads=args.threads, enable_prefix_caching=False),
                    show_progress=False)
    try:
        prompt = engine.tokenizer.encode('The printing press changed how books were made in Europe because')
        for steps in (2, args.steps):
            engine.add_request(prompt, GenerationConfig(max_new_tokens=steps + 1, ignore_eos=True, do_sample=False))
            engine.step()  # the prefill
            before, start = opened(), time.perf_counter()
            while engine.has_unfinished():
                engine.step()
            elapsed, regions = time.perf_counter() - start, opened() - before
        print(f'{args.threads} thread(s): {regions / args.steps:.0f} OpenMP regions a decode step, '
              f'{args.steps / elapsed:.2f} tok/s', flush=True)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('folder')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--steps', type=int, default=16)
    args = parser.parse_args()
    if os.environ.get('OMP_REGIONS_SHIM'):
        return count(args)
    with tempfile.TemporaryDirectory() as tmp:
        shim = build_shim(Path(tmp))
        env = dict(os.environ, LD_PRELOAD=str(shim), OMP_REGIONS_SHIM='1')
        subprocess.run([sys.executable, __file__, *sys.argv[1:]], check=True, env=env)


if __name__ == '__main__':
    main()
