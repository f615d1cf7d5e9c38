"""Decode step time of ERNIE 4.5 dense at ERNIE-4.5-0.3B's shape (hidden 1024, 18 layers, 16 query and 2 KV heads
of 128, MLP 3072, rotary over neighbouring pairs; a 1024-word vocabulary) on the CPU with its layers in the native
decoder stack against their Python forward, in the same run, random bf16 weights, one thread; ``--family olmo2`` or
``olmo3``: OLMo 2's layers (post-norms only, q/k norms over all heads) or OLMo 3's (three sliding-window layers of
four, window 4096) at the same shape but for heads of 64 (OLMo's configs derive it from the hidden size);
``arcee`` or ``apertus``: their ungated MLPs (ReLU², xIELU) at that shape; ``hunyuan``: Hunyuan-A13B's layers (q/k
norms after the rotary; MoE layers of 8 experts of 3072, 2 a token, and the shared MLP) at that shape. The step
time is the calling thread's CPU time of the model's forward (``time.thread_time``: other jobs on a shared machine
take time slices but not figures), the best and the median over rounds in which the two paths alternate. On a CPU
with AMX, whose bf16 layers run on oneDNN (where the stack does not run), the layers run on the native bf16 GEMM
here, as the tests of the stack run them.

    python benchmark/ernie_stack.py [--family ernie4_5] [--layers 18] [--batches 1,16] [--steps 8] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import (ApertusConfig, ArceeConfig, AutoModelForCausalLM, Ernie4_5Config, HunYuanMoEV1Config,
                          Olmo2Config, Olmo3Config, PretrainedConfig)
from stack_timing import print_stack_against_layers, stack_engine
from workload import save_word_tokenizer


VOCAB = 1024


FAMILIES = {'ernie4_5': lambda **shape: Ernie4_5Config(**shape, head_dim=128, use_bias=False),
            'olmo2': Olmo2Config, 'olmo3': lambda **shape: Olmo3Config(**shape, sliding_window=4096),
            'arcee': ArceeConfig, 'apertus': ApertusConfig,
            'hunyuan': lambda **shape: HunYuanMoEV1Config(**shape, head_dim=64, num_experts=8, moe_topk=2)}


def save_model(path: str, family: str, layers: int) -> None:
    """A random bf16 model of ``family`` at ERNIE-4.5-0.3B's shape with ``layers`` layers."""
    config: PretrainedConfig = FAMILIES[family](hidden_size=1024, intermediate_size=3072, num_hidden_layers=layers,
                                                num_attention_heads=16, num_key_value_heads=2, vocab_size=VOCAB,
                                                max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--family', choices=sorted(FAMILIES), default='ernie4_5')
    parser.add_argument('--layers', type=int, default=18)
    parser.add_argument('--batches', default='1,16')
    parser.add_argument('--steps', type=int, default=8, help='decode steps per round')
    parser.add_argument('--rounds', type=int, default=4)
    args = parser.parse_args()
    engine = stack_engine(lambda path: save_model(path, args.family, args.layers))
    print(f'{args.family} at ERNIE-4.5-0.3B shape, {args.layers} layers, bf16, 1 thread; ms per decode step (thread '
          'CPU time of the forward)')
    print_stack_against_layers(engine, VOCAB, args.batches, args.steps, args.rounds)


if __name__ == '__main__':
    main()
