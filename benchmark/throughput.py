"""Offline throughput of the engine against transformers ``generate``, in one run.

Workload: N prompts of random token ids (seed 0), input length uniform in [64, 256], output length
uniform in [64, 256], ``ignore_eos``. transformers runs static batches of 16, left-padded, bf16, and
is credited only with each prompt's own output length. Also prints batch-1 decode speed for both.

    python benchmark/throughput.py [--model PATH] [--num-prompts 64] [--dtype bfloat16] [--device cuda]

``--random-weights`` measures a random-weight model of the default model's exact shape instead (for a
machine without the default model and without network); the speed is the same.
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM
from workload import make_workload, save_default_shaped_model

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import resolve_model_path
from lmdeploy.pytorch.engine.engine import Engine


def run_engine(engine: Engine, workload) -> float:
    for prompt, n_out in workload:
        engine.add_request(prompt, GenerationConfig(max_new_tokens=n_out, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def engine_decode_rate(engine: Engine, prompt: list[int], n: int) -> float:
    engine.add_request(prompt, GenerationConfig(max_new_tokens=n + 1, ignore_eos=True))
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return n / (time.perf_counter() - start)


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int) -> None:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                   pad_token_id=pad_id, top_k=None, top_p=None, temperature=None)


def run_hf(model, workload, batch_size: int = 16) -> float:
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i:i + batch_size]
        hf_generate(model, [p for p, _ in batch], max(n for _, n in batch), pad_id=0)
    return time.perf_counter() - start


def hf_decode_rate(model, prompt: list[int], n: int) -> float:
    start = time.perf_counter()
    hf_generate(model, [prompt], 1, pad_id=0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    hf_generate(model, [prompt], n + 1, pad_id=0)
    return n / (time.perf_counter() - start - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='HF folder or .gguf (default: the bundled model)')
    parser.add_argument('--num-prompts', type=int, default=64)
    parser.add_argument('--dtype', default='auto')
    parser.add_argument('--decode-tokens', type=int, default=128)
    parser.add_argument('--skip-hf', action='store_true', help='measure only this engine')
    parser.add_argument('--device', default='cpu', help="this engine's and transformers' device: 'cpu' or 'cuda'")
    parser.add_argument('--random-weights', action='store_true',
                        help="a random-weight model of the default model's shape instead of --model")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_default_shaped_model(tmp) if args.random_weights else resolve_model_path(args.model)
        measure(model_dir, args)


def measure(model_dir: str, args: argparse.Namespace) -> None:
    engine = Engine(model_dir, PytorchEngineConfig(dtype=args.dtype, device=args.device), show_progress=False)
    workload = make_workload(args.num_prompts, engine.model_config.vocab_size)
    total_out = sum(n for _, n in workload)
    run_engine(engine, make_workload(4, engine.model_config.vocab_size, seed=1))  # warm-up
    ours = total_out / run_engine(engine, workload)
    ours_b1 = engine_decode_rate(engine, workload[0][0][:128], args.decode_tokens)
    print(f'lmdeploy      : {ours:8.1f} output tok/s   batch-1 decode {ours_b1:6.1f} tok/s')
    if args.skip_hf:
        return
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(args.device).eval()
    hf_generate(model, [workload[0][0]], 4, pad_id=0)  # warm-up
    theirs = total_out / run_hf(model, workload)
    theirs_b1 = hf_decode_rate(model, workload[0][0][:128], args.decode_tokens)
    print(f'transformers  : {theirs:8.1f} output tok/s   batch-1 decode {theirs_b1:6.1f} tok/s')
    print(f'ratio         : {ours / theirs:8.2f}x throughput     {ours_b1 / theirs_b1:6.2f}x batch-1 decode')


if __name__ == '__main__':
    main()
