"""What Ministral 3's position-scaled queries add to a decode step on the CPU: the thread CPU time of the step's
factors (``position_query_scale``, once per step) and of one layer's multiply (``q * factor``, the aten op the native
decoder stack calls), against the whole decode step of a Ministral 3 in the native decoder stack (bf16, a few
layers of hidden 3072, 32 query and 8 KV heads of 128, MLP 9216, random weights), one thread. Step times are the
calling thread's CPU time of the model's forward (``time.thread_time``: other jobs on a shared machine take time
slices but not figures), best and median over the steps. Two engines, one with the scale and one without, differ
end to end by as much as two identical engines do (a few percent, from where their weights lie), so the added work
is timed on its own.

    python benchmark/query_scale_cpu.py [--layers 2] [--batches 1,16] [--steps 16]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from stack_timing import DecodeStepTimer, run_requests, stack_engine
from transformers import Ministral3Config, PreTrainedTokenizerFast


VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 1024, 3072, 32, 8, 128, 9216


def save_model(path: str, layers: int) -> None:
    """A Ministral 3 checkpoint of ``layers`` layers (``llama_4_scaling_beta`` 0.1, the hub's), random bf16 weights
    (seed 0), and a tokenizer of one word per id."""
    rope = {'rope_type': 'yarn', 'rope_theta': 1e6, 'factor': 16.0, 'original_max_position_embeddings': 256,
            'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1}
    Ministral3Config(hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers, num_attention_heads=HEADS,
                     num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, max_position_embeddings=4096,
                     rope_parameters=rope, architectures=['Ministral3ForCausalLM']).save_pretrained(path)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).bfloat16()

    ones = lambda: torch.ones(HIDDEN, dtype=torch.bfloat16)  # noqa: E731
    state = {'model.embed_tokens.weight': rand(VOCAB, HIDDEN, std=1.0), 'model.norm.weight': ones(),
             'lm_head.weight': rand(VOCAB, HIDDEN)}
    shapes = {'self_attn.q_proj': (HEADS * HEAD_DIM, HIDDEN), 'self_attn.k_proj': (KV_HEADS * HEAD_DIM, HIDDEN),
              'self_attn.v_proj': (KV_HEADS * HEAD_DIM, HIDDEN), 'self_attn.o_proj': (HIDDEN, HEADS * HEAD_DIM),
              'mlp.gate_proj': (MLP, HIDDEN), 'mlp.up_proj': (MLP, HIDDEN), 'mlp.down_proj': (HIDDEN, MLP)}
    for i in range(layers):
        state |= {f'model.layers.{i}.{norm}.weight': ones() for norm in ('input_layernorm', 'post_attention_layernorm')}
        state |= {f'model.layers.{i}.{name}.weight': rand(*shape) for name, shape in shapes.items()}
    save_file(state, os.path.join(path, 'model.safetensors'))
    words = models.WordLevel({f't{i}': i for i in range(VOCAB)}, unk_token='t0')
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), eos_token='t2').save_pretrained(path)


def op_us(call, repeats: int = 2000) -> float:
    """Best of three: thread CPU microseconds per call."""
    times = []
    for _ in range(3):
        start = time.thread_time()
        for _ in range(repeats):
            call()
        times.append((time.thread_time() - start) / repeats * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--layers', type=int, default=2)
    parser.add_argument('--batches', default='1,16')
    parser.add_argument('--steps', type=int, default=16, help='decode steps per batch')
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = stack_engine(lambda path: save_model(path, args.layers))
    timer = DecodeStepTimer(engine)
    model = timer.model
    print(f'Ministral 3, {args.layers} layers of hidden {HIDDEN}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, MLP {MLP}, '
          'bf16, native decoder stack, 1 thread (thread CPU time)')
    print('| batch | decode step best (ms) | median (ms) | factors per step (us) | multiply per layer (us) | '
          'added share of the step |')
    print('| --- | --- | --- | --- | --- | --- |')
    g = torch.Generator().manual_seed(1)
    for batch in map(int, args.batches.split(',')):
        timer.times.clear()  # prompts past the factor's first step (256 positions):
        run_requests(engine, [torch.randint(3, VOCAB, (300,), generator=g).tolist() for _ in range(batch)], args.steps)
        steps = timer.times['']
        positions = torch.arange(300, 300 + batch)
        factors_us = op_us(lambda: model.query_scale(positions).to(torch.bfloat16))
        factors = model.query_scale(positions).to(torch.bfloat16).view(-1, 1, 1)
        q = torch.randn(batch, HEADS + 2 * KV_HEADS, HEAD_DIM).bfloat16()[:, :HEADS]  # the stack's view of q
        multiply_us = op_us(lambda: q.mul(factors))
        best = min(steps)
        added = (factors_us + args.layers * multiply_us) / 1e3 / best
        print(f'| {batch} | {best:.2f} | {statistics.median(steps):.2f} | {factors_us:.1f} | {multiply_us:.1f} | '
              f'{added:.3%} |', flush=True)


if __name__ == '__main__':
    main()
