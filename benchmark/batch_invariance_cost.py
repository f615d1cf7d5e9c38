"""What batch invariance costs: the default model (bf16, ``decode_int4`` on as for its Q4_1 file; ``--dtype float32``:
fp32, the fixed-order fp32 GEMM's), with ``--gemma`` Gemma 3 270M Q4_K_M in bf16 (its K-quant layers' GEMVs), with
``--moe`` a random-weight MoE model (:func:`save_moe_model`, its number of experts ``--experts``), with ``--gpt-oss``
a random gpt-oss with MXFP4 experts (:func:`save_gpt_oss_model`), or with ``--deepseek`` ``batch_invariance.py``'s
random DeepSeek-V3 (``moe_stack.py``'s: 2 layers at DeepSeek-V3's shapes, latent attention, 16 experts, an fp32
router), in two source trees, before and after, each round a fresh process per tree, the trees alternating, one
thread, the calling thread's CPU time (the engine computes in it with one thread: on a machine that other jobs load,
what each tree computes rather than what the scheduler gives it; cache sharing still counts).

    python benchmark/batch_invariance_cost.py --before /path/to/tree --after . [--rounds 3]
        [--gemma | --moe [--experts 32] | --gpt-oss | --deepseek]
        [--dtype bfloat16 | float32]

Per tree: ``b1 decode`` ms a step (one sequence, the median of its 64 decode steps), ``24-row decode``, ``64-row
decode`` and ``128-row decode`` ms a step (as many sequences decoding together, median of 24 steps), ``prefill
256`` ms for one prompt of 256 tokens (the median of 5), ``arrivals`` ms in all for 16 prompts of 64-184 tokens queued one a step, 32 new tokens each
(prefills share steps with decode rows: mixed steps), and ``batched`` ms in all for the same prompts queued at
once. With ``--prefill`` instead (prefix caching on): ``b1 decode`` and ``prefill N`` ms, one prompt of N = 2, 4,
16, 64, 256 and 1024 tokens prefilled alone (its one step, the median of 3), and ``2 after 256 cached`` ms, a prompt
of 258 tokens whose first 256 are cached (a chat's short follow-up turn: its step prefills 2 tokens): what the
large steps of block-quantized weights cost a short prompt. With ``--preempt`` instead: 16 prompts of 64-184 tokens
queued at once, 64 new tokens each, in a cache of 256 blocks of 16 (``roomy``: no preemption) and of 48 (``tight``:
sequences preempted and computed again): ms in all, steps and preemptions of each (what recomputing a preempted
sequence costs). Prints each round, then the best of each (the fewest, for counts) and the ratios after / before.

    python benchmark/batch_invariance_cost.py --before /path/to/tree --prefill --gpt-oss [--rounds 2]
    python benchmark/batch_invariance_cost.py --before /path/to/tree --preempt [--gpt-oss] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable

CHILD = r'''
import json, statistics, sys, time, torch
torch.set_num_threads(1)
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import default_model_path, gemma3_270m_path
from lmdeploy.pytorch.engine.engine import Engine

path = {'': default_model_path, 'gemma': gemma3_270m_path}.get(sys.argv[1], lambda: sys.argv[1])()
vocab, dtype = int(sys.argv[2]), sys.argv[3]
engine = Engine(path, PytorchEngineConfig(dtype=dtype, enable_prefix_caching=False, max_batch_size=128),
                show_progress=False)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, vocab, (64 + 8 * i,), generator=g).tolist() for i in range(16)]


def steps(gen, queue, per_step=0):
    """Thread CPU ms of each step, ``per_step`` prompts queued before each (0: all at once)."""
    times, waiting = [], list(queue)
    while waiting or engine.has_unfinished():
        for prompt in waiting[:per_step or len(waiting)]:
            engine.add_request(prompt, gen)
        waiting = waiting[per_step or len(waiting):]
        start = time.thread_time()
        engine.step()
        times.append(1e3 * (time.thread_time() - start))
    return times


steps(GenerationConfig(max_new_tokens=8, ignore_eos=True), prompts[:4])  # warm-up
b1 = steps(GenerationConfig(max_new_tokens=66, ignore_eos=True), prompts[:1])
decode = GenerationConfig(max_new_tokens=26, ignore_eos=True)
rows = {n: steps(decode, [p[:8] for p in (prompts * 8)[:n]]) for n in (24, 64, 128)}
long = torch.randint(3, vocab, (256,), generator=g).tolist()
prefill = [steps(GenerationConfig(max_new_tokens=1, ignore_eos=True), [long])[0] for _ in range(5)]
gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)
print(json.dumps({'b1 decode': statistics.median(b1[2:]),
                  **{f'{n}-row decode': statistics.median(times[2:]) for n, times in rows.items()},
                  'prefill 256': statistics.median(prefill), 'arrivals': sum(steps(gen, prompts, 1)),
                  'batched': sum(steps(gen, prompts))}))
'''
PREFILL_CHILD = CHILD[:CHILD.index('steps(GenerationConfig(max_new_tokens=8')].replace(
    'enable_prefix_caching=False', 'enable_prefix_caching=True') + r'''
steps(GenerationConfig(max_new_tokens=8, ignore_eos=True), prompts[:2])  # warm-up
b1 = steps(GenerationConfig(max_new_tokens=34, ignore_eos=True), prompts[:1])
first = GenerationConfig(max_new_tokens=1, ignore_eos=True)
prefill = {n: [steps(first, [torch.randint(3, vocab, (n,), generator=g).tolist()])[0] for _ in range(3)]
           for n in (2, 4, 16, 64, 256, 1024)}
cached = torch.randint(3, vocab, (256,), generator=g).tolist()
steps(GenerationConfig(max_new_tokens=2, ignore_eos=True), [cached])  # a finished prefill publishes no blocks
follow_up = [steps(first, [cached + torch.randint(3, vocab, (2,), generator=g).tolist()])[0] for _ in range(3)]
print(json.dumps({'b1 decode': statistics.median(b1[2:]),
                  **{f'prefill {n}': statistics.median(times) for n, times in prefill.items()},
                  '2 after 256 cached': statistics.median(follow_up)}))
'''
PREEMPT_CHILD = CHILD[:CHILD.index('engine = Engine(')] + r'''
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, vocab, (64 + 8 * i,), generator=g).tolist() for i in range(16)]
gen = GenerationConfig(max_new_tokens=64, ignore_eos=True)
result = {}
for cache, blocks in (('roomy', 256), ('tight', 48)):
    engine = Engine(path, PytorchEngineConfig(dtype=dtype, enable_prefix_caching=False, num_gpu_blocks=blocks,
                                              block_size=16), show_progress=False)
    for prompt in prompts[:2]:  # warm-up
        engine.add_request(prompt[:8], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    for prompt in prompts:
        engine.add_request(prompt, gen)
    start, count = time.thread_time(), 0
    while engine.has_unfinished():
        engine.step()
        count += 1
    result[f'{cache} ms'] = 1e3 * (time.thread_time() - start)
    result[f'{cache} steps'] = count
    result[f'{cache} preemptions'] = engine.scheduler.num_preemptions
    engine.close()
print(json.dumps(result))
'''
MOE_VOCAB = 1024


def save_moe_model(path: str, experts: int = 32) -> str:
    """A Qwen3-30B-A3B-like MoE scaled down to fit: hidden 1024, 4 layers of 16 query and 4 KV heads of 64 and
    ``experts`` experts of 384 of which 4 per token; random bf16 weights (N(0, 0.02)), a word-level tokenizer of
    1024."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from workload import save_word_tokenizer
    config = Qwen3MoeConfig(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                            head_dim=64, num_experts=experts, num_experts_per_tok=4, moe_intermediate_size=384,
                            intermediate_size=2816, norm_topk_prob=True, vocab_size=MOE_VOCAB,
                            max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, MOE_VOCAB)
    return path


def save_gpt_oss_model(path: str) -> str:
    """A random gpt-oss of hidden 1024: 4 layers (16 query and 4 KV heads of 64, a window of 128 every other layer),
    32 experts of 1024 of which 4 per token as random MXFP4 blocks (weights up to 6 / 128) with bf16 biases; the rest
    random bf16 (transformers' initialization), a word-level tokenizer of 1024."""
    import json as json_
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig
    from workload import save_word_tokenizer
    config = GptOssConfig(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                          head_dim=64, num_local_experts=32, num_experts_per_tok=4, intermediate_size=1024,
                          sliding_window=128, vocab_size=MOE_VOCAB, max_position_embeddings=4096,
                          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    tensors = load_file(os.path.join(path, 'model.safetensors'))
    for name in [n for n in tensors if n.endswith(('experts.gate_up_proj', 'experts.down_proj'))]:
        rows, inputs = tensors.pop(name).shape[:0:-1]  # stored [E, in, out]
        tensors[name + '_blocks'] = torch.randint(0, 256, (32, rows, inputs // 32, 16), generator=g, dtype=torch.uint8)
        tensors[name + '_scales'] = torch.randint(118, 121, (32, rows, inputs // 32), generator=g, dtype=torch.uint8)
    save_file(tensors, os.path.join(path, 'model.safetensors'), metadata={'format': 'pt'})
    with open(os.path.join(path, 'config.json')) as f:
        saved = json_.load(f)
    saved['quantization_config'] = {'quant_method': 'mxfp4', 'modules_to_not_convert': [
        'model.layers.*.self_attn', 'model.layers.*.mlp.router', 'model.embed_tokens', 'lm_head']}
    with open(os.path.join(path, 'config.json'), 'w') as f:
        json_.dump(saved, f)
    save_word_tokenizer(path, MOE_VOCAB)
    return path


def save_deepseek_model(path: str) -> str:
    """``batch_invariance.py``'s DeepSeek-V3 (``moe_stack.py``'s ``save_model``: 2 layers, 16 experts)."""
    from argparse import Namespace
    from moe_stack import save_model
    save_model(path, Namespace(family='deepseek_v3', layers=2, experts=16))
    return path


def measure(tree: str, model: str, vocab: int, child: str, dtype: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-c', child, model, str(vocab), dtype], env=env, capture_output=True,
                         text=True, check=True, cwd=os.path.abspath(tree))
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_trees(before: str, after: str, rounds: int, measure_tree: Callable[[str], dict[str, float]]) -> None:
    """Measures the trees ``before`` and ``after`` in alternating order for ``rounds`` rounds, then prints each
    figure's best of the rounds for both and their ratio."""
    results: dict[str, list[dict[str, float]]] = {'before': [], 'after': []}
    for round_ in range(rounds):
        for name in ('before', 'after') if round_ % 2 == 0 else ('after', 'before'):
            results[name].append(measure_tree(before if name == 'before' else after))
            print(name, round_, {k: round(v, 2) for k, v in results[name][-1].items()}, flush=True)
    print('| thread CPU ms (or a count), best of rounds | before | after | after / before |\n| --- | --- | --- | --- |')
    for key in results['before'][0]:
        best_before, best_after = (min(r[key] for r in results[name]) for name in ('before', 'after'))
        ratio = f'{best_after / best_before:.3f}' if best_before else '-'
        print(f'| {key} | {best_before:.2f} | {best_after:.2f} | {ratio} |')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--before', required=True, help='the source tree before')
    parser.add_argument('--after', default='.', help='the source tree after')
    parser.add_argument('--rounds', type=int, default=3)
    models = parser.add_mutually_exclusive_group()
    models.add_argument('--gemma', action='store_true', help='Gemma 3 270M Q4_K_M instead of the default model')
    models.add_argument('--moe', action='store_true', help='the random-weight MoE model instead of the default one')
    models.add_argument('--deepseek', action='store_true', help='the random-weight DeepSeek-V3 instead')
    parser.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
    models.add_argument('--gpt-oss', action='store_true', help='the random gpt-oss with MXFP4 experts instead')
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument('--prefill', action='store_true',
                       help='prefills of 2-1024 tokens, 2 after 256 cached, and batch-1 decode only')
    modes.add_argument('--preempt', action='store_true', help='16 prompts in a cache too small for them only')
    parser.add_argument('--experts', type=int, default=32,
                        help="with --moe: its experts (60, Qwen1.5-MoE-A2.7B's, a router off the 16-row panels)")
    args = parser.parse_args()
    child = PREFILL_CHILD if args.prefill else PREEMPT_CHILD if args.preempt else CHILD
    with tempfile.TemporaryDirectory() as folder:
        model, vocab = ((save_moe_model(folder, args.experts), MOE_VOCAB) if args.moe else
                        (save_gpt_oss_model(folder), MOE_VOCAB) if args.gpt_oss else
                        (save_deepseek_model(folder), MOE_VOCAB) if args.deepseek else
                        ('gemma' if args.gemma else '', 40000))
        compare_trees(args.before, args.after, args.rounds,
                      lambda tree: measure(tree, model, vocab, child, args.dtype))


if __name__ == '__main__':
    main()
