"""Speed at real model scale on one GPU, in one call, as one table (random weights, no download):

  graphs   the default model's shape (135M): batch-1 decode tok/s with CUDA graphs on and off
  decode   Llama-3-8B's shape: decode step time at batch x context against the roofline
  moe      Qwen3-30B-A3B's shape: the same
  offline  Llama-3-8B's shape on a ShareGPT-like workload, against transformers ``generate`` (same weights)
  server   TTFT and TPOT under concurrent streams through ``lmdeploy serve api_server``

    python benchmark/gpu_scale.py [--parts decode,moe] [--out gpu_scale.txt] [--device cuda]
    python benchmark/gpu_scale.py --device cpu --tiny      # miniature shapes: checks the script in seconds
    python benchmark/gpu_scale.py --plan-only --free-gib 78  # which layers would run on a 78 GiB device

Each part has its own time budget (``--budgets``); a part that fails prints an error row and the next one
runs; the exit status is 1 if any part failed. Decode steps run on injected sequences whose context
counts as already computed (whatever their KV blocks hold), so no prompt is prefilled for them.

The roofline takes the copy bandwidth measured on the device at the start and the dense bf16 peak of the
device's datasheet (``gpu_device.py``'s table; ``--bandwidth`` and ``--tflops`` override them). A decode shape
whose weights and the KV cache of its ``--plan-batch`` rows at the longest context do not fit the device's free
memory runs with fewer layers (named in its rows, e.g. ``qwen3-30b-a3b/30L``), against the roofline of those
layers: its step times are not the whole model's, its ratios to the roofline carry over.
"""
from __future__ import annotations

import argparse
import gc
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch
from gpu_device import GiB, copy_tbs, device_spec, plan_layers, roofline_ms, spec_source
from scale_engine import decode_step_ms, run_engine, run_hf
from scale_server import server_latency
from transformers import AutoModelForCausalLM, PretrainedConfig
from workload import (default_shaped_config, llama3_8b_config, qwen3_30b_a3b_config, save_shaped_config,
                      sharegpt_like_workload)

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

# 285 s in all: gpu_check.sh gives this script 300 s, 15 s of them for its start-up
DEFAULT_BUDGETS = {'graphs': 20, 'decode': 45, 'moe': 55, 'offline': 110, 'server': 55}
DECODE_CACHE_FRACTION = 0.85  # the decode engines' cache_max_entry_count, which the memory plan counts on
WARM_OUTPUT = 16  # the offline part's warm-up outputs: every kernel and shape of a full batch, in seconds
COLUMNS = (('part', 8), ('case', 38), ('result', 30), ('reference', 28), ('ratio', 0))


class Table:
    """Prints rows as they come (flushed) and keeps the file at ``path`` up to date."""

    def __init__(self, path: str | None, title: str):
        self.path = path
        header = self._format([name for name, _ in COLUMNS])
        self._emit(f'{title}\n{header}\n{"-" * len(header)}', 'w')

    @staticmethod
    def _format(cells: list[str]) -> str:
        return ' | '.join(cell.ljust(width) for cell, (_, width) in zip(cells, COLUMNS)).rstrip()

    def _emit(self, text: str, mode: str = 'a') -> None:
        print(text, flush=True)
        if self.path:
            with open(self.path, mode) as f:
                f.write(text + '\n')

    def row(self, part: str, case: str, result: str, reference: str = '', ratio: str = '') -> None:
        self._emit(self._format([part, case, result, reference, ratio]))

    def note(self, text: str) -> None:
        self._emit(f'# {text}')


@dataclass
class Bench:
    args: argparse.Namespace
    table: Table
    tmp: str
    deadline: float = 0.0
    folders: dict[str, str] = field(default_factory=dict)

    @property
    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def folder(self, name: str, config: Callable[[], PretrainedConfig]) -> str:
        """A folder with ``config``'s config.json and tokenizer (made once)."""
        if name not in self.folders:
            self.folders[name] = save_shaped_config(f"{self.tmp}/{name.replace('/', '-')}", config())
        return self.folders[name]

    @property
    def dtype(self) -> str:
        """bf16 on CUDA; fp32 on the CPU, whose packed bf16 weights could not take transformers' weights."""
        return 'float32' if self.args.device == 'cpu' else 'bfloat16'

    def engine(self, folder: str, **kwargs) -> Engine:
        """An engine on the device with random weights."""
        kwargs.setdefault('session_len', self.args.session_len)
        if self.args.tiny:
            kwargs.setdefault('num_gpu_blocks', 96)
        # Overlapped steps are the default on CUDA; --tiny runs them on the CPU too.
        config = PytorchEngineConfig(device=self.args.device, dtype=self.dtype, load_format='dummy',
                                     overlap_schedule=True, **kwargs)
        return Engine(folder, config, show_progress=False)

    def free_bytes(self) -> int:
        """What the memory plan may fill: ``--free-gib``, else the device's free memory now."""
        if self.args.free_gib:
            return int(self.args.free_gib * GiB)
        if self.args.device.startswith('cuda'):
            return torch.cuda.mem_get_info()[0]
        return psutil.virtual_memory().available

    def planned(self, part: str, name: str, shape: Callable[[int | None], PretrainedConfig]
                ) -> tuple[str, Callable[[], PretrainedConfig]]:
        """(case name, config) of ``shape`` with as many layers as fit beside the KV cache of the decode rows
        that the plan must hold (:func:`plan_tokens`); the plan is noted in the table."""
        tokens = plan_tokens(self.args)
        plan = plan_layers(shape(None), self.free_bytes(), tokens, DECODE_CACHE_FRACTION)
        self.table.note(f'{part} memory plan: ' + plan.describe(name, tokens))
        if not plan.shrunk:
            return name, lambda: shape(None)
        return f'{name}/{plan.layers}L', lambda: shape(plan.layers)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ctx_label(ctx: int) -> str:
    return f'{ctx // 1024}k' if ctx % 1024 == 0 else str(ctx)


def plan_tokens(args: argparse.Namespace) -> int:
    """KV tokens that the memory plan keeps room for: the largest decode batch up to ``--plan-batch`` at the
    longest context, in whole blocks, as :func:`decode_step_ms` asks for them."""
    batch = max((b for b in args.batches if b <= args.plan_batch), default=min(args.batches))
    block_size = PytorchEngineConfig.block_size
    return batch * -(-(max(args.contexts) + args.warmup_steps + args.steps) // block_size) * block_size


def decode_rows(bench: Bench, part: str, name: str, config: Callable[[], PretrainedConfig], eager: bool,
                batches: list[int], contexts: list[int], **engine_kwargs) -> None:
    """One row per (batch, context): step time against the roofline."""
    args = bench.args
    engine = bench.engine(bench.folder(name, config), eager_mode=eager, enable_prefix_caching=False, **engine_kwargs)
    mode = 'eager' if eager else 'graphs'
    for batch in batches:
        for ctx in contexts:
            case = f'{name} b={batch} ctx={ctx_label(ctx)} {mode}'
            if bench.out_of_time:
                bench.table.row(part, case, 'skipped (part budget spent)')
                continue
            ms = decode_step_ms(engine, batch, ctx, args.warmup_steps, args.steps)
            if ms is None:
                bench.table.row(part, case, 'n/a (KV does not fit)')
                continue
            roof = roofline_ms(config(), batch, ctx, args.bandwidth * 1e12, args.tflops * 1e12)
            ratio = f'{ms / roof:.2f}x' + (f' ({100 * roof / ms:.0f}% of roofline)' if batch == 1 else '')
            bench.table.row(part, case, f'{ms:.2f} ms/step {batch * 1e3 / ms:.0f} tok/s', f'roofline {roof:.2f} ms',
                            ratio)


def part_graphs(bench: Bench) -> None:
    config = (lambda: llama3_8b_config(tiny=True)) if bench.args.tiny else default_shaped_config
    folder = bench.folder('smollm-135m', config)
    rates = {}
    for eager in (False, True):
        engine = bench.engine(folder, eager_mode=eager, max_batch_size=8, enable_prefix_caching=False,
                              num_gpu_blocks=64)
        rates[eager] = 1e3 / decode_step_ms(engine, 1, 512, bench.args.warmup_steps, bench.args.graph_steps)
        del engine
        release()
    bench.table.row('graphs', '135M-shape b=1 ctx=512 decode', f'graphs on {rates[False]:.0f} tok/s',
                    f'graphs off {rates[True]:.0f} tok/s', f'{rates[False] / rates[True]:.2f}x (target >= 3x)')


def part_decode(bench: Bench) -> None:
    args = bench.args
    name, config = bench.planned('decode', 'llama3-8b', lambda layers: llama3_8b_config(args.tiny, layers))
    decode_rows(bench, 'decode', name, config, False, args.batches, args.contexts,
                max_batch_size=max(args.batches), cache_max_entry_count=DECODE_CACHE_FRACTION)
    release()
    block_size = PytorchEngineConfig.block_size
    blocks = -(-(max(args.contexts) + args.warmup_steps + args.steps + 1) // block_size) + 1
    decode_rows(bench, 'decode', name, config, True, [1], args.contexts, max_batch_size=1, num_gpu_blocks=blocks)


def part_moe(bench: Bench) -> None:
    args = bench.args
    name, config = bench.planned('moe', 'qwen3-30b-a3b', lambda layers: qwen3_30b_a3b_config(args.tiny, layers))
    decode_rows(bench, 'moe', name, config, False, args.batches, args.contexts, max_batch_size=max(args.batches),
                cache_max_entry_count=DECODE_CACHE_FRACTION)


def rate(tokens: int, seconds: float, done: bool) -> str:
    return f'{tokens / seconds:.0f} tok/s' + ('' if done else f' (budget hit after {tokens} tokens)')


def part_offline(bench: Bench) -> None:
    """transformers first, alone on the device (its padded batch's cache of up to 100 x 3,072 tokens takes 37.5
    GiB, which beside the engine would not fit an 80 GB H100); then the engine on its weights."""
    args = bench.args
    config = llama3_8b_config(args.tiny)
    clips = dict(input_clip=(args.min_input, args.max_input), output_clip=(args.min_output, args.max_output))
    work = sharegpt_like_workload(args.num_prompts, config.vocab_size, seed=0, **clips)
    warm = sharegpt_like_workload(max(8, args.hf_batch_size), config.vocab_size, seed=1,
                                  input_clip=clips['input_clip'], output_clip=(args.min_output, WARM_OUTPUT))
    piece = work[:args.hf_prompts]
    with torch.device(args.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, bench.dtype)).eval()
    run_hf(hf, warm, args.hf_batch_size, bench.deadline)
    theirs = run_hf(hf, piece, args.hf_batch_size, bench.deadline)
    weights = hf.state_dict()  # kept on the device while the engine is built: its cache leaves room for them
    del hf
    release()
    engine = bench.engine(bench.folder('llama3-8b', lambda: config), max_batch_size=args.max_batch_size,
                          enable_prefix_caching=False, cache_max_entry_count=DECODE_CACHE_FRACTION)
    engine.runner.model.load_weights(weights.items())
    del weights
    release()
    run_engine(engine, warm, bench.deadline)
    ours = run_engine(engine, piece, bench.deadline)
    ratio = (ours[0] / ours[1]) / (theirs[0] / theirs[1]) if theirs[0] and ours[0] else float('nan')
    bench.table.row('offline', f'llama3-8b {len(piece)} prompts', f'lmdeploy {rate(*ours)}',
                    f'transformers {rate(*theirs)}', f'{ratio:.1f}x (target >= 15x; same weights)')
    tokens, seconds, done = run_engine(engine, work, bench.deadline)
    bench.table.row('offline', f'llama3-8b {len(work)} prompts', f'lmdeploy {rate(tokens, seconds, done)}',
                    f'{len(work) / seconds:.2f} req/s, {seconds:.1f} s')


def part_server(bench: Bench) -> None:
    args = bench.args
    config = llama3_8b_config(args.tiny)
    folder = bench.folder('llama3-8b', lambda: config)
    clips = dict(input_clip=(args.min_input, args.max_input), output_clip=(args.min_output, args.max_output))
    work = sharegpt_like_workload(args.num_prompts, config.vocab_size, seed=0, **clips)[:args.streams]
    flags = ['--device', args.device, '--load-format', 'dummy', '--dtype', bench.dtype,
             '--session-len', str(args.session_len), '--max-batch-size', str(args.streams),
             '--disable-prefix-caching', *(['--num-gpu-blocks', '96'] if args.tiny else [])]
    result = server_latency(folder, flags, work, bench.deadline, f'{bench.tmp}/server.log')
    case = f'llama3-8b {len(work)} streams'
    bench.table.row('server', f'{case} TTFT', f"p50 {result['ttft_p50']:.0f} ms", f"p99 {result['ttft_p99']:.0f} ms")
    bench.table.row('server', f'{case} TPOT', f"p50 {result['tpot_p50']:.1f} ms", f"p99 {result['tpot_p99']:.1f} ms",
                    f"{result['tokens_per_s']:.0f} output tok/s")


PARTS = {'graphs': part_graphs, 'decode': part_decode, 'moe': part_moe, 'offline': part_offline,
         'server': part_server}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda text: [int(x) for x in text.split(',')]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--parts', default=','.join(PARTS), help='comma-separated, of: ' + ', '.join(PARTS))
    parser.add_argument('--out', default=None, help='also write the table to this file')
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--tiny', action='store_true', help='miniature shapes and workloads (checks the script)')
    parser.add_argument('--budgets', default='', help='seconds per part, e.g. decode=60,offline=120 (defaults: '
                        + ','.join(f'{k}={v}' for k, v in DEFAULT_BUDGETS.items()) + ')')
    parser.add_argument('--bandwidth', type=float, default=None,
                        help='roofline memory bandwidth, TB/s (default: a copy measured on the device)')
    parser.add_argument('--tflops', type=float, default=None,
                        help="roofline bf16 TFLOP/s (default: the device's datasheet, dense)")
    parser.add_argument('--plan-batch', type=int, default=64,
                        help='the decode batch whose KV at the longest context the memory plan keeps room for')
    parser.add_argument('--free-gib', type=float, default=None,
                        help="memory the plan may fill (default: the device's free memory)")
    parser.add_argument('--plan-only', action='store_true', help='print the memory plan of the decode shapes only')
    parser.add_argument('--batches', type=ints, default=None, help='decode batch sizes (default 1,16,64,256)')
    parser.add_argument('--contexts', type=ints, default=None, help='decode contexts (default 1024,8192)')
    parser.add_argument('--warmup-steps', type=int, default=3)
    parser.add_argument('--steps', type=int, default=None, help='timed decode steps (default 10)')
    parser.add_argument('--graph-steps', type=int, default=None, help='timed steps of the graphs part (default 200)')
    parser.add_argument('--session-len', type=int, default=16384)
    parser.add_argument('--num-prompts', type=int, default=None, help='offline workload (default 1000)')
    parser.add_argument('--hf-prompts', type=int, default=None, help='the slice run by both (default 100)')
    parser.add_argument('--hf-batch-size', type=int, default=None, help="transformers' batch (default 100)")
    parser.add_argument('--max-batch-size', type=int, default=256, help="the offline engine's")
    parser.add_argument('--streams', type=int, default=None, help='concurrent server streams (default 64)')
    parser.add_argument('--min-input', type=int, default=4)
    parser.add_argument('--max-input', type=int, default=None, help='input length clip (default 2048)')
    parser.add_argument('--min-output', type=int, default=4)
    parser.add_argument('--max-output', type=int, default=None, help='output length clip (default 1024)')
    args = parser.parse_args(argv)
    full, tiny = dict(batches=[1, 16, 64, 256], contexts=[1024, 8192], steps=10, graph_steps=200, num_prompts=1000,
                      hf_prompts=100, hf_batch_size=100, streams=64, max_input=2048, max_output=1024), dict(
        batches=[1, 4, 16], contexts=[64, 512], steps=4, graph_steps=10, num_prompts=24, hf_prompts=8,
        hf_batch_size=4, streams=6, max_input=96, max_output=24)
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    budgets = dict(DEFAULT_BUDGETS)
    budgets.update({k: float(v) for k, v in (item.split('=') for item in args.budgets.split(',') if item)})
    args.budgets = budgets
    args.parts = args.parts.split(',')
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f'unknown parts: {sorted(unknown)}')
    if args.device.startswith('cuda') and not args.free_gib and not torch.cuda.is_available():
        parser.error('no CUDA device here: give --device cpu, or --free-gib with --plan-only')
    return args


def roofline_title(args: argparse.Namespace, device: str) -> str:
    """Sets ``args.bandwidth`` and ``args.tflops`` where not given, and says where each came from."""
    spec = device_spec(device)[0]
    if args.bandwidth is None:
        args.bandwidth = copy_tbs(args.device, GiB if args.device.startswith('cuda') else 2**26)
        bandwidth = f'{args.bandwidth:.3g} TB/s copy measured now ({spec.hbm_tbs} TB/s datasheet)'
    else:
        bandwidth = f'{args.bandwidth} TB/s (--bandwidth)'
    if args.tflops is None:
        args.tflops = spec.bf16_tflops
        tflops = f'{args.tflops:.0f} TFLOP/s dense bf16 ({spec_source(device)})'
    else:
        tflops = f'{args.tflops:.0f} TFLOP/s (--tflops)'
    return f'roofline: {bandwidth}, {tflops}'


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `timeout` still stops the server
    if args.plan_only:
        where = f'{args.free_gib} GiB (--free-gib)' if args.free_gib else args.device
        bench = Bench(args, Table(args.out, f'gpu_scale memory plan for {where}'), '')
        for part, name, shape in (('decode', 'llama3-8b', llama3_8b_config),
                                  ('moe', 'qwen3-30b-a3b', qwen3_30b_a3b_config)):
            bench.planned(part, name, lambda layers, shape=shape: shape(args.tiny, layers))
        return 0
    device = torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        title = (f'gpu_scale on {device}, torch {torch.__version__}{" (tiny shapes)" if args.tiny else ""}; '
                 f'{roofline_title(args, device)}; random {"fp32" if args.device == "cpu" else "bf16"} weights')
        bench = Bench(args, Table(args.out, title), tmp)
        table = bench.table
        for name in args.parts:
            start = time.monotonic()
            bench.deadline = start + args.budgets[name]
            try:
                PARTS[name](bench)
            except Exception as exc:  # one part's failure must not stop the others
                traceback.print_exc()
                table.row(name, 'ERROR', f'{type(exc).__name__}: {exc}'.replace('\n', ' ')[:300])
                failed.append(name)
            release()
            held = f', {torch.cuda.memory_allocated() / 2**30:.1f} GiB held' if torch.cuda.is_available() else ''
            print(f'# {name}: {time.monotonic() - start:.0f} s{held}', file=sys.stderr, flush=True)
    if failed:
        print(f'FAILED parts: {", ".join(failed)}', flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
