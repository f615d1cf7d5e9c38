"""Offline throughput of the engine against transformers ``generate``, like with like, in one run.

Workload: N prompts of random token ids (seed 0), input length uniform in [64, 256], output length
uniform in [64, 256], ``ignore_eos``. Every side must produce exactly the tokens asked for (checked).

- ``lmdeploy``: the engine in the given dtype (auto: bf16) with ``decode_int4`` off and prefix caching
  off, warmed up on 4 full-size requests.
- ``transformers``: ``generate`` in the engine's dtype, static batches of 16, left-padded, the prompts
  sorted by output length first (each batch runs as many steps as its longest output, so sorting is
  what a user who knows the lengths does), credited only with each prompt's own output length; warmed
  up on a full batch of 16 full-size prompts (64 new tokens).
- ``lmdeploy 4-bit``: the engine with ``decode_int4`` on (small steps on 4-bit weights, the default for
  Q4_1 GGUF models such as the default model; CPU, bf16). Not bf16, so its ratio is to the bf16 engine,
  never to transformers. ``--skip-int4`` leaves it out.
- ``lmdeploy quantized``: with ``--quant-policy N`` (KV cache, passed to ``PytorchEngineConfig`` only
  when N != 0) and/or ``--quant-model PATH`` (a quantized checkpoint of the same model), the engine so
  configured, with its ratio to the bf16 engine. ``decode_int4`` stays off unless ``--quant-model`` is
  given (then the engine's default applies), so that a KV-only run differs from bf16 in the KV cache alone.

Each row also gives batch-1 decode tokens/s (the prefill excluded).

    python benchmark/throughput.py [--model PATH] [--num-prompts 64] [--dtype auto] [--device cuda]
        [--quant-policy 8] [--quant-model PATH] [--skip-int4] [--skip-hf]

``--random-weights`` measures a random-weight model of the default model's exact shape instead (for a
machine without the default model and without network); the speed is the same.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM
from workload import Workload, make_workload, save_default_shaped_model

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import resolve_model_path
from lmdeploy.pytorch.engine.engine import Engine

HF_BATCH_SIZE = 16
LABEL_WIDTH = 44


def run_engine(engine: Engine, workload: Workload) -> float:
    """Seconds to serve ``workload``; asserts that every request produced exactly its output length."""
    asked = {engine.add_request(prompt, GenerationConfig(max_new_tokens=n_out, ignore_eos=True)): n_out
             for prompt, n_out in workload}
    produced = dict.fromkeys(asked, 0)
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            produced[out.seq_id] += len(out.token_ids)
    elapsed = time.perf_counter() - start
    wrong = {seq_id: (produced[seq_id], n) for seq_id, n in asked.items() if produced[seq_id] != n}
    assert not wrong, f'the engine produced other token counts than asked (produced, asked): {wrong}'
    return elapsed


def engine_decode_rate(engine: Engine, prompt: list[int], n: int) -> float:
    """Decode tokens/s at batch 1: ``n`` tokens timed after the step that prefills and samples the first."""
    engine.add_request(prompt, GenerationConfig(max_new_tokens=n + 1, ignore_eos=True))
    produced = 0
    while produced == 0:
        produced += sum(len(out.token_ids) for out in engine.step())
    start = time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(out.token_ids) for out in engine.step())
    elapsed = time.perf_counter() - start
    assert produced == n + 1, f'the engine produced {produced} tokens at batch 1, asked {n + 1}'
    return (produced - 1) / elapsed


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new: int, pad_id: int) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``max_new`` tokens for each left-padded prompt; returns the new tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, pad_token_id=pad_id, top_k=None, top_p=None, temperature=None)
    new = out[:, width:]
    eos = model.generation_config.eos_token_id
    eos_ids = torch.tensor(eos if isinstance(eos, list) else [] if eos is None else [eos], device=new.device)
    assert new.shape == (len(prompts), max_new) and not torch.isin(new, eos_ids).any(), \
        f'transformers produced {tuple(new.shape)} new tokens (or an EOS), asked {(len(prompts), max_new)}'
    return new


def run_hf(model, workload: Workload, batch_size: int = HF_BATCH_SIZE) -> float:
    """Seconds for static batches of ``batch_size``, prompts sorted by output length."""
    ordered = sorted(workload, key=lambda item: item[1])
    start = time.perf_counter()
    for i in range(0, len(ordered), batch_size):
        batch = ordered[i:i + batch_size]
        hf_generate(model, [p for p, _ in batch], max(n for _, n in batch), pad_id=0)
    return time.perf_counter() - start


def hf_decode_rate(model, prompt: list[int], n: int) -> float:
    """Decode tokens/s at batch 1, less the prefill and first token (timed alone)."""
    start = time.perf_counter()
    hf_generate(model, [prompt], 1, pad_id=0)
    first = time.perf_counter() - start
    start = time.perf_counter()
    hf_generate(model, [prompt], n + 1, pad_id=0)
    return n / (time.perf_counter() - start - first)


def row(label: str, offline: float, batch1: float) -> None:
    print(f'{label:<{LABEL_WIDTH}}: {offline:8.1f} output tok/s   batch-1 decode {batch1:6.1f} tok/s', flush=True)


def ratio_row(label: str, num: tuple[float, float], den: tuple[float, float]) -> None:
    print(f'{label:<{LABEL_WIDTH}}: {num[0] / den[0]:8.2f}x throughput      {num[1] / den[1]:6.2f}x batch-1 decode',
          flush=True)


def measure_engine(model_dir: str, config: PytorchEngineConfig, args: argparse.Namespace) -> tuple[float, float, str]:
    """(offline output tok/s, batch-1 decode tok/s, dtype name) of one engine, closed afterwards."""
    engine = Engine(model_dir, config, show_progress=False)
    try:
        vocab_size = engine.model_config.vocab_size
        workload = make_workload(args.num_prompts, vocab_size)
        run_engine(engine, make_workload(4, vocab_size, seed=1))  # warm-up on full-size requests
        offline = sum(n for _, n in workload) / run_engine(engine, workload)
        batch1 = engine_decode_rate(engine, workload[0][0][:128], args.decode_tokens)
        return offline, batch1, str(engine.model_config.dtype).removeprefix('torch.')
    finally:
        engine.close()
        del engine
        gc.collect()


def measure_hf(model_dir: str, dtype: torch.dtype, args: argparse.Namespace) -> tuple[float, float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    workload = make_workload(args.num_prompts, model.config.vocab_size)
    warm = make_workload(HF_BATCH_SIZE, model.config.vocab_size, seed=1)
    hf_generate(model, [p for p, _ in warm], 64, pad_id=0)  # warm-up on a full batch
    offline = sum(n for _, n in workload) / run_hf(model, workload)
    return offline, hf_decode_rate(model, workload[0][0][:128], args.decode_tokens)


def measure(model_dir: str, quant_dir: str | None, args: argparse.Namespace) -> None:
    base = dict(dtype=args.dtype, device=args.device, enable_prefix_caching=False)
    *ours, dtype = measure_engine(model_dir, PytorchEngineConfig(**base, decode_int4=False), args)
    row(f'lmdeploy {dtype}', *ours)
    if not args.skip_int4 and args.device == 'cpu' and dtype == 'bfloat16':
        int4 = measure_engine(model_dir, PytorchEngineConfig(**base, decode_int4=True), args)[:2]
        row('lmdeploy 4-bit small steps (decode_int4)', *int4)
        ratio_row('  ratio 4-bit / lmdeploy bf16', int4, ours)
    if args.quant_policy or quant_dir:
        extra = {'quant_policy': args.quant_policy} if args.quant_policy else {}
        config = PytorchEngineConfig(**base, decode_int4=None if quant_dir else False, **extra)
        quant = measure_engine(quant_dir or model_dir, config, args)[:2]
        what = [f'quant_policy {args.quant_policy}'] * bool(args.quant_policy) + [args.quant_model] * bool(quant_dir)
        row(f'lmdeploy quantized ({", ".join(what)})', *quant)
        ratio_row(f'  ratio quantized / lmdeploy {dtype}', quant, ours)
    if args.skip_hf:
        return
    theirs = measure_hf(model_dir, getattr(torch, dtype), args)
    row(f'transformers {dtype}', *theirs)
    ratio_row(f'  ratio lmdeploy / transformers, both {dtype}', ours, theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='HF folder or .gguf (default: the bundled model)')
    parser.add_argument('--num-prompts', type=int, default=64)
    parser.add_argument('--dtype', default='auto')
    parser.add_argument('--decode-tokens', type=int, default=128)
    parser.add_argument('--skip-hf', action='store_true', help='measure only this engine')
    parser.add_argument('--skip-int4', action='store_true', help='leave out the decode_int4 row')
    parser.add_argument('--quant-policy', type=int, default=0, help='KV cache quantization of the quantized row')
    parser.add_argument('--quant-model', default=None,
                        help='a quantized checkpoint (HF folder or .gguf) of the same model for the quantized row')
    parser.add_argument('--device', default='cpu', help="this engine's and transformers' device: 'cpu' or 'cuda'")
    parser.add_argument('--random-weights', action='store_true',
                        help="a random-weight model of the default model's shape instead of --model")
    args = parser.parse_args()
    if args.quant_policy and 'quant_policy' not in {f.name for f in dataclasses.fields(PytorchEngineConfig)}:
        parser.error('this lmdeploy has no PytorchEngineConfig.quant_policy yet')
    quant_dir = resolve_model_path(args.quant_model) if args.quant_model else None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_default_shaped_model(tmp) if args.random_weights else resolve_model_path(args.model)
        measure(model_dir, quant_dir, args)


if __name__ == '__main__':
    main()
