"""Whether a prompt's output depends on what else shares its steps: per engine configuration, greedy tokens and
their logprobs of each prompt run with the others against the same prompt run alone on the same engine, printed
as a table of the prompts that differ (tokens, and logprobs bitwise).

    python benchmark/batch_invariance.py [--num-prompts 24] [--new-tokens 24] [--gemma] [--moe [--hidden 64]]
        [--threads 1] [--only fp32]

Prompts: random token ids (seed 1, ids below 40000, or the model's vocabulary), lengths 5 + 7 i. Two ways of
sharing:

- ``batched``: every prompt queued at once (their prefills share steps, then their decodes: 24 rows a step);
- ``arrivals``: one prompt queued per step, so each prompt's prefill shares a step with the decode rows of the
  prompts before it.

Configurations: the default model (Q4_1 GGUF) in bf16 with ``decode_int4`` as the engine sets it (on for Q4_1:
what ``lmdeploy chat`` and ``serve`` run), in bf16 with ``decode_int4`` off, in fp32; ``--gemma`` adds the real
Gemma 3 270M Q4_K_M in bf16 (253 MB, fetched once). ``--moe`` runs, instead, tiny random mixture-of-experts
models (:func:`moe_models`; ``--hidden``: the transformers ones' hidden size) in bf16 in the native decoder stack
(the engine's path), in bf16 in the layers' Python forward, in bf16 with ``decode_int4``, and in fp32. ``--only TEXT``: the configurations whose name holds it.
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from argparse import Namespace

import torch

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import default_model_path, gemma3_270m_path
from lmdeploy.pytorch.engine.engine import Engine

MOE_VOCAB = 1024  # the tiny MoE models' (moe_stack.py's too)
# (token ids, logprobs) of each step of one prompt
Outputs = list[tuple[list[int], object]]


def random_prompts(num_prompts: int, vocab: int = 40000) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (5 + 7 * i, ), generator=g).tolist() for i in range(num_prompts)]


def moe_models(folder: str, hidden: int = 64) -> dict[str, str]:
    """Tiny random MoE checkpoints saved in ``folder``, by name: Qwen3-MoE, Mixtral and Qwen2-MoE (transformers'
    random weights, hidden ``hidden``, 8 experts of 32 (Mixtral 96), top-2, 2 layers; Qwen2-MoE's shared expert of
    48 gated by a one-output projection), and ``moe_stack.py``'s gpt-oss (MXFP4 experts, biases, the clamped
    SwiGLU) and DeepSeek-V3 (grouped sigmoid routing, a shared expert) with one MoE layer of 8 (DeepSeek-V3: 16,
    top-8) experts at their shapes there (hidden 2048)."""
    from moe_stack import save_model
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from workload import save_word_tokenizer
    shape = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=MOE_VOCAB, max_position_embeddings=1024, num_experts_per_tok=2, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2)
    configs = {'Qwen3-MoE': Qwen3MoeConfig(**shape, num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                                           norm_topk_prob=True),
               'Mixtral': MixtralConfig(**shape, num_local_experts=8, intermediate_size=96),
               'Qwen2-MoE': Qwen2MoeConfig(**shape, num_experts=8, moe_intermediate_size=32, intermediate_size=96,
                                           shared_expert_intermediate_size=48)}
    paths = {}
    for name, config in configs.items():
        paths[name] = os.path.join(folder, name)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(paths[name])
        save_word_tokenizer(paths[name], MOE_VOCAB)
    for name, family, layers, experts in (('gpt-oss (MXFP4 experts)', 'gpt_oss', 1, 8),
                                           ('DeepSeek-V3', 'deepseek_v3', 2, 16)):
        paths[name] = os.path.join(folder, family)
        os.makedirs(paths[name])
        save_model(paths[name], Namespace(family=family, layers=layers, experts=experts))
    return paths


def run(engine: Engine, prompts: list[list[int]], gen: GenerationConfig, per_step: int) -> list[Outputs]:
    """Each prompt's outputs, ``per_step`` prompts queued before each step (all at once when 0)."""
    outs: list[Outputs] = [[] for _ in prompts]
    index: dict[int, int] = {}
    waiting = list(enumerate(prompts))
    while waiting or engine.has_unfinished():
        for i, prompt in waiting[:per_step or len(waiting)]:
            index[engine.add_request(prompt, gen)] = i
        waiting = waiting[per_step or len(waiting):]
        for out in engine.step():
            outs[index[out.seq_id]].append((list(out.token_ids), out.logprobs))
    return outs


def differing(shared: list[Outputs], alone: list[Outputs]) -> tuple[int, int]:
    """The prompts whose tokens differ, and those whose tokens or logprobs differ."""
    tokens = sum(1 for a, b in zip(shared, alone) if [t for t, _ in a] != [t for t, _ in b])
    return tokens, sum(1 for a, b in zip(shared, alone) if a != b)


def measure(path: str, config: PytorchEngineConfig, prompts: list[list[int]], gen: GenerationConfig,
            layers: bool = False) -> dict:
    """``batched`` and ``arrivals``: the prompts that differ from their run alone (:func:`differing`); ``layers``:
    the decoder layers run their Python forward rather than the native stack."""
    engine = Engine(path, config, show_progress=False)
    if layers:
        engine.runner.model.native_stack = None
    try:
        alone = [run(engine, [prompt], gen, 0)[0] for prompt in prompts]
        return {name: differing(run(engine, prompts, gen, per_step), alone)
                for name, per_step in (('batched', 0), ('arrivals', 1))}
    finally:
        engine.close()
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--num-prompts', type=int, default=24)
    parser.add_argument('--new-tokens', type=int, default=24)
    parser.add_argument('--gemma', action='store_true', help='also Gemma 3 270M Q4_K_M in bf16')
    parser.add_argument('--moe', action='store_true', help='tiny random MoE models instead (see moe_models)')
    parser.add_argument('--threads', type=int, default=None, help="torch's threads (default: its own)")
    parser.add_argument('--only', default='', help='only the configurations whose name holds this text')
    parser.add_argument('--hidden', type=int, default=64,
                        help="with --moe: the hidden size of Qwen3-MoE, Mixtral and Qwen2-MoE (default 64)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = random_prompts(args.num_prompts, MOE_VOCAB if args.moe else 40000)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=5)
    with tempfile.TemporaryDirectory() as folder:
        configs = moe_configs(moe_models(folder, args.hidden)) if args.moe else default_configs(args.gemma)
        configs = [config for config in configs if args.only in config[0]]
        print_table(configs, prompts, gen, args)


def default_configs(gemma: bool) -> list[tuple[str, str, dict, bool]]:
    configs = [('default model, bf16, decode_int4 auto', default_model_path(), dict(dtype='bfloat16'), False),
               ('default model, bf16, decode_int4 off', default_model_path(),
                dict(dtype='bfloat16', decode_int4=False), False),
               ('default model, fp32', default_model_path(), dict(dtype='float32'), False)]
    if gemma:
        configs.append(('Gemma 3 270M Q4_K_M, bf16', gemma3_270m_path(), dict(dtype='bfloat16'), False))
    return configs


def moe_configs(paths: dict[str, str]) -> list[tuple[str, str, dict, bool]]:
    """Each MoE model in bf16 in the native stack, in the layers' forward, with ``decode_int4``, and in fp32."""
    return [config for name, path in paths.items() for config in (
        (f'{name}, bf16, native stack', path, dict(dtype='bfloat16'), False),
        (f'{name}, bf16, layers', path, dict(dtype='bfloat16'), True),
        (f'{name}, bf16, decode_int4', path, dict(dtype='bfloat16', decode_int4=True), False),
        (f'{name}, fp32', path, dict(dtype='float32'), False))]


def print_table(configs: list[tuple[str, str, dict, bool]], prompts: list[list[int]], gen: GenerationConfig,
                args: argparse.Namespace) -> None:
    print(f'{args.num_prompts} prompts, {args.new_tokens} greedy tokens each, logprobs=5; '
          'prompts that differ from the same prompt run alone: tokens / tokens or logprobs (bitwise)')
    print(f'| configuration | batched | arrivals | seconds |\n| --- | --- | --- | --- |')
    for name, path, options, layers in configs:
        start = time.perf_counter()
        result = measure(path, PytorchEngineConfig(**options), prompts, gen, layers)
        cells = ' | '.join(f'{tokens} / {any_diff}' for tokens, any_diff in result.values())
        print(f'| {name} | {cells} | {time.perf_counter() - start:.0f} |', flush=True)


if __name__ == '__main__':
    main()
