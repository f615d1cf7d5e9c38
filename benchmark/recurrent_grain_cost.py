"""What the recurrent prefill grain costs under small budgets: a random Qwen3.5 (bf16, 4 layers, three
linear-attention ones then a full-attention one, hidden 512), 16 prompts of 64-184 tokens queued one a step, 16 new
tokens each, ``max_batch_size`` 64, for each ``--budgets`` value of ``max_prefill_token_num``; in two source trees,
before and after, each round a fresh process per tree, the trees alternating, one thread, the calling thread's CPU
time (as ``batch_invariance_cost.py``). Per tree and budget: ms in all, steps, and how many prompts' greedy tokens
differ from their runs alone (the invariance the grain buys).

    python benchmark/recurrent_grain_cost.py --before /path/to/tree --after . [--budgets 100,48] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from batch_invariance_cost import compare_trees

CHILD = r'''
import json, sys, time, torch
torch.set_num_threads(1)
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine

path, budgets = sys.argv[1], [int(b) for b in sys.argv[2].split(',')]
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 1024, (64 + 8 * i,), generator=g).tolist() for i in range(16)]
gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)


def arrivals(engine, queue, per_step):
    """Each prompt's tokens, thread CPU ms in all and steps, ``per_step`` prompts queued before each step."""
    outs, index, waiting, steps = [[] for _ in queue], {}, list(queue), 0
    start = time.thread_time()
    while waiting or engine.has_unfinished():
        for prompt in waiting[:per_step]:
            index[engine.add_request(prompt, gen)] = len(index)
        waiting = waiting[per_step:]
        for out in engine.step():
            outs[index[out.seq_id]].extend(out.token_ids)
        steps += 1
    return outs, 1e3 * (time.thread_time() - start), steps


result = {}
for budget in budgets:
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=256, block_size=16,
                                              max_prefill_token_num=budget), show_progress=False)
    arrivals(engine, [p[:8] for p in prompts[:2]], 2)  # warm-up
    outs, ms, steps = arrivals(engine, prompts, 1)
    alone = [arrivals(engine, [prompt], 1)[0][0] for prompt in prompts]
    result[f'budget {budget}: ms'] = ms
    result[f'budget {budget}: steps'] = steps
    result[f'budget {budget}: prompts apart from alone'] = sum(a != b for a, b in zip(outs, alone))
    engine.close()
print(json.dumps(result))
'''


def save_qwen35(path: str) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig
    from workload import save_word_tokenizer
    config = Qwen3_5TextConfig(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                               head_dim=64, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                               linear_value_head_dim=64, linear_conv_kernel_dim=4, intermediate_size=1536,
                               vocab_size=1024, max_position_embeddings=4096, tie_word_embeddings=False,
                               pad_token_id=None, architectures=['Qwen3_5ForCausalLM'])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, 1024)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({}, f)
    return path


def measure(tree: str, model: str, budgets: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-c', CHILD, model, budgets], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.abspath(tree))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--before', required=True, help='the source tree before')
    parser.add_argument('--after', default='.', help='the source tree after')
    parser.add_argument('--budgets', default='100,48', help='max_prefill_token_num values, comma-separated')
    parser.add_argument('--rounds', type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = save_qwen35(folder)
        compare_trees(args.before, args.after, args.rounds, lambda tree: measure(tree, model, args.budgets))


if __name__ == '__main__':
    main()
