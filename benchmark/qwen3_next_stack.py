"""Decode step time of Qwen3-Next / Qwen3.5 on the CPU with their decode-only steps in the native decoder stack
(Gated DeltaNet layers, ``kernels/cpu/linear_attention.cpp``; gated full attention; MoE blocks) against the layers'
Python forward, in the same run, random bf16 weights, one thread. ``--layers 4`` (the default) is one
full-attention layer after three linear-attention ones, the checkpoints' pattern, at Qwen3-Next-80B-A3B's widths:
hidden 2048; linear attention with 16 key and 32 value heads of 128 and a 4-tap convolution; full attention with 16
query and 2 KV heads of 256, a quarter of each rotating; ``--family qwen3_next``: MoE of ``--experts`` experts of 512
(the checkpoint has 512), 10 per token, and a sigmoid-gated shared expert of 512; ``--family qwen3_5``: a dense MLP
of 6144. Timing as ``stack_timing.py``'s (thread CPU time of the forward, the two paths alternating round by round).

    python benchmark/qwen3_next_stack.py [--family qwen3_next] [--layers 4] [--experts 64] [--batches 1,16]
                                         [--steps 8] [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from stack_timing import print_stack_against_layers, stack_engine
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3_5TextConfig, Qwen3NextConfig
from workload import save_word_tokenizer

VOCAB = 1024


def model_config(args: argparse.Namespace) -> PretrainedConfig:
    """The benchmarked family's config at its shape (see the module's docstring)."""
    common = dict(hidden_size=2048, num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=2,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=VOCAB, max_position_embeddings=4096,
                  tie_word_embeddings=False, pad_token_id=None)
    if args.family == 'qwen3_5':
        return Qwen3_5TextConfig(intermediate_size=6144, architectures=['Qwen3_5ForCausalLM'], **common)
    return Qwen3NextConfig(num_experts=args.experts, num_experts_per_tok=10, moe_intermediate_size=512,
                           shared_expert_intermediate_size=512, norm_topk_prob=True,
                           architectures=['Qwen3NextForCausalLM'], **common)


def save_model(path: str, args: argparse.Namespace) -> None:
    """A checkpoint of ``args.layers`` layers of ``args.family``, transformers' random initialization in bf16."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(args), dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_word_tokenizer(path, VOCAB)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--family', choices=('qwen3_next', 'qwen3_5'), default='qwen3_next')
    parser.add_argument('--layers', type=int, default=4, help='decoder layers, every fourth full attention')
    parser.add_argument('--experts', type=int, default=64, help='routed experts (qwen3_next)')
    parser.add_argument('--batches', default='1,16')
    parser.add_argument('--steps', type=int, default=8, help='decode steps per round')
    parser.add_argument('--rounds', type=int, default=4)
    args = parser.parse_args()
    engine = stack_engine(lambda path: save_model(path, args))
    mlp = f'{args.experts} experts of 512, top-10, a shared expert' if args.family == 'qwen3_next' else 'dense 6144'
    print(f'{args.family}, {args.layers} layers (every fourth full attention), {mlp}, 1 thread; ms per decode step '
          '(thread CPU time of the forward)')
    print_stack_against_layers(engine, VOCAB, args.batches, args.steps, args.rounds)


if __name__ == '__main__':
    main()
