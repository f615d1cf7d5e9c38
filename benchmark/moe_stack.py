"""Decode step time of a MoE model on the CPU with its decoder layers in the native stack (``MoEBlock``s,
``kernels/cpu/moe_block.cpp``) against their Python forward, in the same run, random bf16 weights, one thread:
``--family qwen3_moe``, a few layers at Qwen3-30B-A3B's shape (hidden 2048, 32 query and 4 KV heads of 128, 128
experts of 768 of which 8 per token, softmax routing); ``--family glm4_moe``, GLM-4.5's layers at a smaller shape
(hidden 2048, 16 query and 4 KV heads of 128 with q/k/v biases and half of each head rotating, a dense first layer
of 5632, then MoE layers of 64 experts of 768 of which 8 per token and one shared expert; DeepSeek-V3's routing:
sigmoid scores, a correction bias, 2 of 4 groups, scaling 2.5, an fp32 router); ``--family ernie4_5_moe``, ERNIE 4.5
MoE's layers at the same smaller shape (16 query and 4 KV heads of 128 rotating in neighbouring pairs, a dense first
layer of 5632, then MoE layers of 64 experts of 768 of which 6 per token and two shared experts; ERNIE's routing:
softmax scores, a correction bias choosing, the unbiased scores over their sum, an fp32 router); ``--family llama4``,
Llama 4's layers at that shape (``--layers 4``: three rope layers attending within chunks of 8192 with the L2 q/k
norm, then a NoPE layer whose queries the temperature scales; every second layer MoE, 16 experts of 768 of which one
per token, its sigmoid score scaling the expert's input, and a shared expert of 768; the others dense of 5632);
``--family gpt_oss``, gpt-oss's layers at that shape (32 query and 8 KV heads of 64 with q/k/v/o biases and sinks, a
sliding window of 128 in every other layer, YaRN; 32 experts of 768 of which 4 per token, a biased router, biased
experts in MXFP4 as gpt-oss's checkpoints hold them, the clamped SwiGLU); ``--family deepseek_v3``, DeepSeek-V3's
layers at that shape (multi-head latent attention: 16 heads, q_lora_rank 768, kv_lora_rank 512, 128 + 64 rotary
query/key features and 128 value features a head, YaRN; GLM-4.5's dense first layer and MoE layers); ``--family
olmoe``, OLMoE's layers at Qwen3-30B-A3B's attention shape (q and k RMS-normed over all heads together; 64 experts of
768 of which 8 per token, softmax routing without renormalization). The
step time is the calling thread's CPU time of the model's forward (``time.thread_time``: other jobs on a shared
machine take time slices but not figures), the best and the median over rounds in which the two paths alternate. On
a CPU with AMX, whose bf16 layers run on oneDNN (where the stack does not run), the layers run on the native bf16
GEMM here, as the tests of the stack run them.

    python benchmark/moe_stack.py [--family qwen3_moe] [--layers 2] [--experts 128] [--batches 1,16] [--steps 8]
                                  [--rounds 4]
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch
from safetensors.torch import save_file
from transformers import (DeepseekV3Config, Ernie4_5_MoeConfig, Glm4MoeConfig, GptOssConfig, Llama4TextConfig,
                          OlmoeConfig, PretrainedConfig, Qwen3MoeConfig)
from stack_timing import print_stack_against_layers, stack_engine
from workload import save_word_tokenizer


VOCAB = 1024
EXPERT_WIDTH = 768
YARN = {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': 4.0, 'original_max_position_embeddings': 1024,
        'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0}


def model_config(args: argparse.Namespace) -> PretrainedConfig:
    """The benchmarked family's config at its shape (see the module's docstring)."""
    common = dict(hidden_size=2048, num_hidden_layers=args.layers, num_key_value_heads=4, head_dim=128,
                  num_experts_per_tok=8, moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True, vocab_size=VOCAB,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    if args.family == 'qwen3_moe':
        return Qwen3MoeConfig(num_attention_heads=32, num_experts=args.experts, architectures=['Qwen3MoeForCausalLM'],
                              **common)
    if args.family == 'olmoe':
        return OlmoeConfig(num_attention_heads=32, num_experts=args.experts, intermediate_size=EXPERT_WIDTH,
                           architectures=['OlmoeForCausalLM'], **{**common, 'norm_topk_prob': False})
    if args.family == 'llama4':
        return Llama4TextConfig(hidden_size=2048, num_hidden_layers=args.layers, num_attention_heads=16,
                                num_key_value_heads=4, head_dim=128, num_local_experts=args.experts,
                                num_experts_per_tok=1, intermediate_size=EXPERT_WIDTH, intermediate_size_mlp=5632,
                                interleave_moe_layer_step=2, attention_chunk_size=8192, vocab_size=VOCAB,
                                max_position_embeddings=16384, tie_word_embeddings=False,
                                architectures=['Llama4ForCausalLM'])
    if args.family == 'gpt_oss':
        return GptOssConfig(hidden_size=2048, num_hidden_layers=args.layers, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=64, num_local_experts=args.experts, num_experts_per_tok=4,
                            intermediate_size=EXPERT_WIDTH, sliding_window=128, vocab_size=VOCAB,
                            max_position_embeddings=4096, tie_word_embeddings=False,
                            architectures=['GptOssForCausalLM'], quantization_config={'quant_method': 'mxfp4'})
    if args.family == 'ernie4_5_moe':
        common = {**common, 'num_experts_per_tok': 6}
        return Ernie4_5_MoeConfig(num_attention_heads=16, moe_num_experts=args.experts, moe_num_shared_experts=2,
                                  moe_layer_start_index=1, intermediate_size=5632, use_bias=False,
                                  architectures=['Ernie4_5_MoeForCausalLM'], **common)
    if args.family == 'deepseek_v3':  # its head_dim is its rotary part's
        common.pop('head_dim')
        return DeepseekV3Config(num_attention_heads=16, n_routed_experts=args.experts, n_shared_experts=1, n_group=4,
                                topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                intermediate_size=5632, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128, rope_parameters=YARN,
                                architectures=['DeepseekV3ForCausalLM'], **common)
    return Glm4MoeConfig(num_attention_heads=16, n_routed_experts=args.experts, n_shared_experts=1, n_group=4,
                         topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, intermediate_size=5632,
                         attention_bias=True, use_qk_norm=False, architectures=['Glm4MoeForCausalLM'], **common)


def save_model(path: str, args: argparse.Namespace) -> None:
    """A checkpoint of ``args.layers`` layers of ``args.family`` at its shape, random bf16 weights (GLM-4.5's and
    ERNIE's routers and correction biases in fp32, gpt-oss's experts in MXFP4, as their checkpoints hold them)."""
    config = model_config(args)
    config.save_pretrained(path)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).bfloat16()

    glm, ernie, llama4, gpt_oss, deepseek = (args.family == name for name in ('glm4_moe', 'ernie4_5_moe', 'llama4',
                                                                               'gpt_oss', 'deepseek_v3'))
    glm = glm or deepseek  # DeepSeek-V3's MLP layers are GLM-4.5's
    hidden, heads = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    state = {'model.embed_tokens.weight': rand(VOCAB, hidden, std=1.0), 'model.norm.weight': rand(hidden, std=0) + 1,
             'lm_head.weight': rand(VOCAB, hidden)}
    for i in range(args.layers):
        prefix = f'model.layers.{i}.'
        state |= {prefix + 'input_layernorm.weight': rand(hidden, std=0) + 1,
                  prefix + 'post_attention_layernorm.weight': rand(hidden, std=0) + 1}
        if deepseek:
            state |= latent_attention(prefix + 'self_attn.', config, rand)
        else:
            state |= {prefix + 'self_attn.q_proj.weight': rand(heads, hidden),
                      prefix + 'self_attn.k_proj.weight': rand(kv, hidden),
                      prefix + 'self_attn.v_proj.weight': rand(kv, hidden),
                      prefix + 'self_attn.o_proj.weight': rand(hidden, heads)}
        if (glm and not deepseek) or gpt_oss:
            state |= {prefix + f'self_attn.{name}_proj.bias': rand(size) for name, size in (('q', heads), ('k', kv),
                                                                                              ('v', kv))}
        if gpt_oss:
            state |= {prefix + 'self_attn.o_proj.bias': rand(hidden),
                      prefix + 'self_attn.sinks': rand(config.num_attention_heads, std=1.0),
                      prefix + 'mlp.router.weight': rand(args.experts, hidden),
                      prefix + 'mlp.router.bias': rand(args.experts)}
            state |= mxfp4_experts(prefix + 'mlp.experts.', args.experts, hidden, g)
            continue
        if args.family == 'olmoe':  # over all heads together
            state |= {prefix + 'self_attn.q_norm.weight': rand(heads, std=0) + 1,
                      prefix + 'self_attn.k_norm.weight': rand(kv, std=0) + 1}
        elif not (glm or ernie or llama4):
            state |= {prefix + f'self_attn.{name}_norm.weight': rand(config.head_dim, std=0) + 1 for name in 'qk'}
        if ((glm and i < config.first_k_dense_replace) or (ernie and i < config.moe_layer_start_index)
                or (llama4 and i not in config.moe_layers)):
            state |= {f'{prefix}mlp.{name}_proj.weight': rand(*shape) for name, shape in
                      (('gate', (5632, hidden)), ('up', (5632, hidden)), ('down', (hidden, 5632)))}
            continue
        expert_shapes = (('gate', (EXPERT_WIDTH, hidden)), ('up', (EXPERT_WIDTH, hidden)),
                         ('down', (hidden, EXPERT_WIDTH)))
        router = rand(args.experts, hidden).float() if glm or ernie else rand(args.experts, hidden)
        state[prefix + ('mlp.router.weight' if llama4 else 'mlp.gate.weight')] = router
        if llama4:
            state |= {f'{prefix}mlp.shared_expert.{name}_proj.weight': rand(*shape) for name, shape in expert_shapes}
        if glm:
            state[prefix + 'mlp.gate.e_score_correction_bias'] = rand(args.experts, std=0.1).float()
            state |= {f'{prefix}mlp.shared_experts.{name}_proj.weight': rand(*shape) for name, shape in expert_shapes}
        if ernie:
            state[prefix + 'mlp.moe_statics.e_score_correction_bias'] = rand(1, args.experts, std=0.01).float()
            state |= {f'{prefix}mlp.shared_experts.{name}_proj.weight': rand(*shape) for name, shape in
                      (('gate', (2 * EXPERT_WIDTH, hidden)), ('up', (2 * EXPERT_WIDTH, hidden)),
                       ('down', (hidden, 2 * EXPERT_WIDTH)))}
        for e in range(args.experts):
            state |= {f'{prefix}mlp.experts.{e}.{name}_proj.weight': rand(*shape) for name, shape in expert_shapes}
    save_file(state, os.path.join(path, 'model.safetensors'))
    save_word_tokenizer(path, VOCAB)
    with open(os.path.join(path, 'generation_config.json'), 'w') as f:
        json.dump({}, f)


def latent_attention(prefix: str, config: DeepseekV3Config,
                     rand: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's attention weights: its low-rank query projection, the latent's and rotary key's projection,
    their norms, the latent's up-projection and the output projection."""
    heads, hidden, latent = config.num_attention_heads, config.hidden_size, config.kv_lora_rank
    qk_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    return {prefix + 'q_a_proj.weight': rand(config.q_lora_rank, hidden),
            prefix + 'q_a_layernorm.weight': rand(config.q_lora_rank, std=0) + 1,
            prefix + 'q_b_proj.weight': rand(heads * qk_dim, config.q_lora_rank),
            prefix + 'kv_a_proj_with_mqa.weight': rand(latent + config.qk_rope_head_dim, hidden),
            prefix + 'kv_a_layernorm.weight': rand(latent, std=0) + 1,
            prefix + 'kv_b_proj.weight': rand(heads * (config.qk_nope_head_dim + config.v_head_dim), latent),
            prefix + 'o_proj.weight': rand(hidden, heads * config.v_head_dim)}


def mxfp4_experts(prefix: str, experts: int, hidden: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as its checkpoints hold them: ``gate_up_proj`` (gate and up rows alternating) and
    ``down_proj`` as random MXFP4 blocks and scales (weights up to 6 / 128), and their bf16 biases."""
    state = {}
    for name, rows, inputs in (('gate_up_proj', 2 * EXPERT_WIDTH, hidden), ('down_proj', hidden, EXPERT_WIDTH)):
        state[f'{prefix}{name}_blocks'] = torch.randint(0, 256, (experts, rows, inputs // 32, 16), generator=g,
                                                        dtype=torch.uint8)
        state[f'{prefix}{name}_scales'] = torch.randint(118, 121, (experts, rows, inputs // 32), generator=g,
                                                        dtype=torch.uint8)
        state[f'{prefix}{name}_bias'] = (torch.randn(experts, rows, generator=g) * 0.02).bfloat16()
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--family', choices=('qwen3_moe', 'glm4_moe', 'ernie4_5_moe', 'llama4', 'gpt_oss',
                                             'deepseek_v3', 'olmoe'),
                        default='qwen3_moe')
    parser.add_argument('--layers', type=int, default=2,
                        help="decoder layers (GLM-4.5's, DeepSeek-V3's and ERNIE's first one dense, Llama 4's every "
                             "second one)")
    parser.add_argument('--experts', type=int, default=None,
                        help='routed experts (default: 128, GLM-4.5, DeepSeek-V3, ERNIE: 64, gpt-oss: 32, Llama 4: 16)')
    parser.add_argument('--batches', default='1,16')
    parser.add_argument('--steps', type=int, default=8, help='decode steps per round')
    parser.add_argument('--rounds', type=int, default=4)
    args = parser.parse_args()
    args.experts = args.experts or {'qwen3_moe': 128, 'llama4': 16, 'gpt_oss': 32}.get(args.family, 64)
    engine = stack_engine(lambda path: save_model(path, args))
    top_k = model_config(args).num_experts_per_tok
    print(f'{args.family}, {args.layers} layers, {args.experts} experts of 2048 -> {EXPERT_WIDTH}, top-{top_k}, '
          '1 thread; ms per decode step (thread CPU time of the forward)')
    print_stack_against_layers(engine, VOCAB, args.batches, args.steps, args.rounds)


if __name__ == '__main__':
    main()
