"""Decode step time of an AWQ checkpoint on the CPU (bf16): its layers in the native decoder stack, every step on
the native int4 GEMV over the checkpoint's grid, against the layers' Python forward on the same kernels and on
torch's int4 kernel for every step (how AWQ and GPTQ checkpoints ran before they had a place in the stack), in the
same run, one thread. The
model: a random Qwen3 at Qwen3-0.6B's widths (hidden 1024, MLP 3072, 16 query and 8 KV heads of 128; ``--layers``
of them, a 1024-word vocabulary), its projections quantized round-to-nearest in groups of 128 (``lmdeploy lite``'s
packer). The step time is the calling thread's CPU time of the model's forward (``time.thread_time``: other jobs on a
shared machine take time slices but not figures), best and median over rounds in which the two paths alternate; the
tok/s figures are 1000 over them.

    python benchmark/awq_stack.py [--layers 28] [--batches 1,8] [--steps 16] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from safetensors.torch import load_file, save_file
from stack_timing import DecodeStepTimer, run_requests
from transformers import AutoModelForCausalLM, Qwen3Config
from workload import save_word_tokenizer

from lmdeploy.lite.auto_awq import quantize
from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant.int4_cpu import TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.w4a16 import Int4GroupFormat

VOCAB, GROUP = 1024, 128


def save_awq_model(path: str, layers: int) -> None:
    """A random Qwen3 at Qwen3-0.6B's widths with ``layers`` layers, as an AWQ checkpoint."""
    config = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=VOCAB, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    weights = load_file(os.path.join(path, 'model.safetensors'))
    state = quantize({name: tensor.float() for name, tensor in weights.items()}, GROUP)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, os.path.join(path, 'model.safetensors'),
              metadata={'format': 'pt'})
    with open(os.path.join(path, 'config.json')) as f:
        hf_config = json.load(f)
    hf_config['quantization_config'] = {'quant_method': 'awq', 'bits': 4, 'group_size': GROUP, 'zero_point': True,
                                        'version': 'gemm'}
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json.dump(hf_config, f)
    save_word_tokenizer(path, VOCAB)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({}, f)


def engine_with_torch_kernels(path: str) -> tuple[Engine, dict[int, TorchInt4Kernel]]:
    """The engine of ``path`` and, by the id of each projection's CPU kernel, torch's int4 kernel on its grid."""
    torch_kernels, kernel_of = {}, Int4GroupFormat.cpu_kernel

    def recorded(grid, gate_up: bool, dtype: torch.dtype):
        kernel = kernel_of(grid, gate_up, dtype)
        torch_kernels[id(kernel)] = TorchInt4Kernel.of_grid(grid, dtype)
        return kernel

    Int4GroupFormat.cpu_kernel = staticmethod(recorded)
    try:
        engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_threads=1, num_gpu_blocks=256, block_size=16,
                                                  max_batch_size=16, enable_prefix_caching=False), show_progress=False)
    finally:
        Int4GroupFormat.cpu_kernel = staticmethod(kernel_of)
    return engine, torch_kernels


def layers_before(model: torch.nn.Module, torch_kernels: dict[int, TorchInt4Kernel]) -> dict[Linear, object]:
    """Each projection's kernel for the layers' forward as it ran before: torch's int4 kernel for every step."""
    return {module: torch_kernels[id(module.kernel)] for module in model.layers.modules()
            if isinstance(module, Linear) and id(module.kernel) in torch_kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--layers', type=int, default=28)
    parser.add_argument('--batches', default='1,8')
    parser.add_argument('--steps', type=int, default=16, help='decode steps per round')
    parser.add_argument('--rounds', type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        save_awq_model(path, args.layers)
        engine, torch_kernels = engine_with_torch_kernels(path)
    timer = DecodeStepTimer(engine)
    stack = timer.model.native_stack
    if stack is None:
        raise SystemExit('the AWQ layers do not run in the native stack here (no native kernels)')
    before = layers_before(timer.model, torch_kernels)
    after = {module: module.kernel for module in before}
    print(f'AWQ Qwen3 at Qwen3-0.6B widths, {args.layers} layers, group {GROUP}, bf16, 1 thread; ms per decode step '
          '(thread CPU time of the forward)')
    modes = {'stack': (stack, after), 'layers': (None, after), 'layers, torch int4': (None, before)}
    print('| batch | ' + ' | '.join(f'{mode} best / median' for mode in modes) + ' | tok/s (best), ' +
          ' / '.join(modes) + ' |')
    print('| --- ' * (len(modes) + 2) + '|')
    g = torch.Generator().manual_seed(1)
    for batch in map(int, args.batches.split(',')):
        timer.times.clear()
        prompts = [torch.randint(3, VOCAB, (16,), generator=g).tolist() for _ in range(batch)]
        for _ in range(args.rounds):
            for timer.label, (native_stack, kernels) in modes.items():
                timer.model.native_stack = native_stack
                for module, kernel in kernels.items():
                    module.kernel = kernel
                run_requests(engine, prompts, args.steps)
        times = [(min(timer.times[mode]), statistics.median(timer.times[mode])) for mode in modes]
        print(f'| {batch} | ' + ' | '.join(f'{best:.1f} / {median:.1f} ms' for best, median in times) + ' | ' +
              ' / '.join(f'{batch * 1e3 / best:.1f}' for best, _ in times) + ' |', flush=True)
    for module, kernel in after.items():
        module.kernel = kernel
    timer.model.native_stack = stack


if __name__ == '__main__':
    main()
