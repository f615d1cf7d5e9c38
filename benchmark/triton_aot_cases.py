"""The cases ``triton_aot.py`` compiles: each calls Triton kernel wrappers of ``kernels/cuda`` on meta tensors of a
production model's shapes, in a given activation dtype: ``CASES`` the full sweep, ``QUICK_CASES`` a subset reaching
every kernel (``tests/test_triton_aot.py``)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.kernels.cuda import elementwise, gguf_linear, w8a8
from lmdeploy.pytorch.kernels.cuda.decode_attention import decode_attention
from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache
from lmdeploy.pytorch.kernels.cuda.fused_moe import Int4Experts, Mxfp4Experts, fused_moe, moe_routing
from lmdeploy.pytorch.kernels.cuda.gated_delta import gated_delta_decode
from lmdeploy.pytorch.kernels.cuda.gguf_linear import Q6KExperts, Q8Experts
from lmdeploy.pytorch.kernels.cuda.mla import fill_latent_cache, mla_decode_attention, mla_prefill_attention
from lmdeploy.pytorch.kernels.cuda.prefill_attention import prefill_attention
from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonW4A16Kernel

BLOCK_SIZE = 64  # PytorchEngineConfig.block_size's default
TABLE_WIDTH = 512  # pages per block-table row: 32k tokens
PREFILL_TOKENS = 2048  # a long chunk (BLOCK_M 64); a chunk of up to 32 rows takes BLOCK_M 16
DECODE_BATCHES = (1, 256)  # decode launches depend on the batch only through the grid
FLOAT = torch.float32


@dataclass(frozen=True)
class Case:
    """A named call of kernel wrappers in an activation dtype."""
    name: str
    run: Callable[[torch.dtype], object]


def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor of the shape without storage: what the wrappers need to pick a launch."""
    return torch.empty(shape, dtype=dtype, device='meta')


def ids(*shape: int) -> torch.Tensor:
    """Block tables, lengths and offsets: int64 as the model runner builds them."""
    return meta(*shape, dtype=torch.int64)


@dataclass(frozen=True)
class AttentionShape:
    """A model's paged attention: query and KV heads, head dim and its features."""
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    chunk: int | None = None  # an attention chunk (Llama 4's chunked layers)

    def features(self) -> dict:
        sinks = meta(self.heads, dtype=FLOAT) if self.sinks else None
        return dict(sliding_window=self.window, logit_softcap=self.softcap, sinks=sinks, attention_chunk=self.chunk)

    def caches(self, policy: int, dtype: torch.dtype) -> tuple:
        """``(k_cache, v_cache, *quant)``: the cache tensors then, for an int8/int4 cache, scales and policy."""
        dim = self.head_dim // 2 if policy == 4 else self.head_dim
        codes = [meta(4096, self.kv_heads, BLOCK_SIZE, dim, dtype=torch.uint8 if policy else dtype) for _ in 'kv']
        if not policy:
            return tuple(codes)
        return (*codes, *[meta(4096, self.kv_heads, BLOCK_SIZE, 2, dtype=FLOAT) for _ in 'kv'], policy)

    def qkv(self, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k`` as the rotary kernel writes them (contiguous), ``v`` a view of the fused QKV projection."""
        fused = meta(tokens, self.heads + 2 * self.kv_heads, self.head_dim, dtype=dtype)
        return (meta(tokens, self.heads, self.head_dim, dtype=dtype),
                meta(tokens, self.kv_heads, self.head_dim, dtype=dtype), fused[:, self.heads + self.kv_heads:])


ATTENTION = (
    AttentionShape('llama3-8b', 32, 8, 128),
    AttentionShape('qwen3-30b-a3b', 32, 4, 128),
    AttentionShape('mistral-7b sliding', 32, 8, 128, window=4096),
    AttentionShape('gemma2-9b global', 16, 8, 256, softcap=50.0),
    AttentionShape('gemma2-9b sliding', 16, 8, 256, window=4096, softcap=50.0),
    AttentionShape('gemma3-12b sliding', 16, 8, 256, window=1024),
    AttentionShape('gpt-oss-20b global', 64, 8, 64, sinks=True),
    AttentionShape('gpt-oss-20b sliding', 64, 8, 64, window=128, sinks=True),
    AttentionShape('llama4-scout chunked', 40, 8, 128, chunk=8192),
)


def fill(shape: AttentionShape, policy: int, dtype: torch.dtype) -> None:
    _, k, v = shape.qkv(PREFILL_TOKENS, dtype)
    fill_kv_cache(k, v, *shape.caches(policy, dtype)[:2], ids(PREFILL_TOKENS), ids(PREFILL_TOKENS),
                  *shape.caches(policy, dtype)[2:])


def prefill(shape: AttentionShape, policy: int, chunk: int, dtype: torch.dtype) -> None:
    seqs = max(1, PREFILL_TOKENS // chunk // 8)
    q, k, v = shape.qkv(seqs * chunk, dtype)
    prefill_attention(q, k, v, *shape.caches(policy, dtype)[:2], ids(seqs, TABLE_WIDTH), ids(seqs), ids(seqs),
                      ids(seqs), chunk, shape.head_dim ** -0.5, *shape.caches(policy, dtype)[2:], **shape.features())


def decode(shape: AttentionShape, policy: int, dtype: torch.dtype) -> None:
    for batch in DECODE_BATCHES:
        q = meta(batch, shape.heads, shape.head_dim, dtype=dtype)
        decode_attention(q, *shape.caches(policy, dtype)[:2], ids(batch, TABLE_WIDTH), ids(batch),
                         shape.head_dim ** -0.5, *shape.caches(policy, dtype)[2:], **shape.features())


def mla(heads: int, tokens: int, policy: int, dtype: torch.dtype) -> None:
    """DeepSeek-V3's absorbed attention: kv_lora 512 + rope 64 per cached row; ``tokens`` 0 decodes. An int8/int4
    cache (``policy`` 8/4) is filled first."""
    if policy:
        cache = meta(4096, BLOCK_SIZE, 576 * policy // 8, dtype=torch.uint8)
        quant = (meta(4096, BLOCK_SIZE, 2, 2, dtype=FLOAT), policy)
        fill_latent_cache(meta(PREFILL_TOKENS, 576, dtype=dtype), cache, ids(PREFILL_TOKENS), ids(PREFILL_TOKENS),
                          *quant, v_dim=512)
    else:
        cache, quant = meta(4096, BLOCK_SIZE, 576, dtype=dtype), ()
    if tokens:
        seqs = max(1, PREFILL_TOKENS // tokens // 8)
        mla_prefill_attention(meta(seqs * tokens, heads, 576, dtype=dtype), meta(seqs * tokens, 576, dtype=dtype),
                              cache, ids(seqs, TABLE_WIDTH), ids(seqs), ids(seqs), ids(seqs), tokens, 0.1, 512, *quant)
    else:
        for batch in DECODE_BATCHES:
            mla_decode_attention(meta(batch, heads, 576, dtype=dtype), cache, ids(batch, TABLE_WIDTH), ids(batch),
                                 0.1, 512, *quant)


NORM_SIZES = (4096, 2880, 2048, 3584, 7168)  # hidden sizes of Llama-3-8B, gpt-oss-20b, Qwen3-30B-A3B, Gemma-2-9B, V3
ROTARY_SHAPES = ((32, 128), (8, 128), (16, 256), (64, 64), (128, 64), (1, 64))  # (heads, rotary dim)


def rows(norm_sizes: tuple[int, ...], rotary_shapes: tuple[tuple[int, int], ...], dtype: torch.dtype) -> None:
    """RMSNorm at hidden sizes (with and without the residual) and the per-head sizes (Qwen3's 128, MLA's latent
    512 and query 1536), rotary at (heads, dim), SiLU-and-mul and gpt-oss' clamped SwiGLU."""
    for hidden in norm_sizes:
        x = meta(PREFILL_TOKENS, hidden, dtype=dtype)
        elementwise.rms_norm(x, meta(hidden, dtype=dtype), 1e-6)
        elementwise.rms_norm(x, meta(hidden, dtype=dtype), 1e-6, residual=x)
    for dim in (128, 512, 1536) if len(norm_sizes) > 1 else ():
        elementwise.rms_norm(meta(PREFILL_TOKENS, 4, dim, dtype=dtype), meta(dim, dtype=dtype), 1e-6)
    for heads, dim in rotary_shapes:
        table = meta(PREFILL_TOKENS, dim, dtype=dtype)
        elementwise.apply_rotary(meta(PREFILL_TOKENS, heads, dim, dtype=dtype), table, table)
    elementwise.silu_and_mul(meta(PREFILL_TOKENS, 2 * 14336, dtype=dtype))
    elementwise.silu_and_mul(meta(PREFILL_TOKENS * 8, 2 * 768, dtype=dtype))
    elementwise.clamped_swiglu(meta(PREFILL_TOKENS * 4, 2 * 2880, dtype=dtype), ClampedSwiGLU(1.702, 7.0))


@dataclass(frozen=True)
class ExpertShape:
    """A MoE layer: experts, top-k, hidden and intermediate sizes; gpt-oss' biases and clamped SwiGLU."""
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    gpt_oss: bool = False
    torch_routing: bool = False  # DeepSeek-V3's grouped top-k is torch's: int64 ids

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (meta(self.experts, 2 * self.inter, self.hidden, dtype=dtype),
                meta(self.experts, self.hidden, self.inter, dtype=dtype))

    def int4(self, dtype: torch.dtype, act_order: bool, group: int = 128) -> tuple[Int4Experts, Int4Experts]:
        def experts(n: int, k: int) -> Int4Experts:
            return Int4Experts(meta(self.experts, k // 8, n, dtype=torch.int32),
                               meta(self.experts, k // group, n, dtype=dtype),
                               meta(self.experts, k // group, n, dtype=FLOAT), group,
                               meta(self.experts, k, dtype=torch.int32) if act_order else None)
        return experts(2 * self.inter, self.hidden), experts(self.hidden, self.inter)

    def mxfp4(self) -> tuple[Mxfp4Experts, Mxfp4Experts]:
        def experts(n: int, k: int) -> Mxfp4Experts:
            return Mxfp4Experts(meta(self.experts, n, k // 32, 16, dtype=torch.uint8),
                                meta(self.experts, n, k // 32, dtype=torch.uint8))
        return experts(2 * self.inter, self.hidden), experts(self.hidden, self.inter)


EXPERTS = (
    ExpertShape('qwen3-30b-a3b', 128, 8, 2048, 768),
    ExpertShape('gpt-oss-20b', 32, 4, 2880, 2880, gpt_oss=True),
    ExpertShape('deepseek-v3', 256, 8, 7168, 2048, torch_routing=True),
)
# Qwen3-30B-A3B: 1, 64, 512 and 4,096 tokens land in the four rows of MOE_CONFIGS (slots per expert <= 1, 8,
# 48, more); the other shapes take the first and last rows.
MOE_TOKENS = {'qwen3-30b-a3b': (1, 64, 512, 4096), 'gpt-oss-20b': (1, 4096), 'deepseek-v3': (1, 4096)}
# the quantized experts swept besides dense ones: AWQ/GPTQ's on Qwen3-30B-A3B, OpenAI's MXFP4 on gpt-oss-20b
QUANTIZED_EXPERTS = {'qwen3-30b-a3b': ('int4', 'int4 act-order', 'gguf q4_k_m', 'gguf q8_0'), 'gpt-oss-20b': ('mxfp4',)}


def gguf_experts(ggml_type: str, num_experts: int, n: int, k: int) -> Q6KExperts | Q8Experts:
    """Experts' Q6_K or Q8_0 blocks retiled as ``nn/quant/gguf_cuda.py`` retiles them."""
    if ggml_type == 'Q6_K':
        return Q6KExperts(*(meta(num_experts, n, k // per, dtype=dtype) for per, dtype in
                            ((8, torch.int32), (16, torch.int32), (16, torch.int8), (256, torch.float16))))
    return Q8Experts(meta(num_experts, n, k, dtype=torch.int8), meta(num_experts, n, k // 32, dtype=torch.float16))


def moe(shape: ExpertShape, weights: str, token_counts: tuple[int, ...], dtype: torch.dtype) -> None:
    """Routing (the model's router) and the fused MoE over ``weights``: 'dense', 'int4', 'int4 act-order', 'mxfp4',
    'gguf q4_k_m' (a GGUF Q4_K_M layer's Q4_K gate-and-up grids, Q6_K down) or 'gguf q8_0'."""
    if weights == 'mxfp4':
        gate_up, down = shape.mxfp4()
    elif weights == 'gguf q4_k_m':
        gate_up, down = shape.int4(dtype, False, group=32)[0], gguf_experts('Q6_K', shape.experts, shape.hidden,
                                                                             shape.inter)
    elif weights == 'gguf q8_0':
        gate_up = gguf_experts('Q8_0', shape.experts, 2 * shape.inter, shape.hidden)
        down = gguf_experts('Q8_0', shape.experts, shape.hidden, shape.inter)
    else:
        gate_up, down = shape.dense(dtype) if weights == 'dense' else shape.int4(dtype, weights == 'int4 act-order')
    extra = {}
    if shape.gpt_oss:
        extra = dict(gate_up_bias=meta(shape.experts, 2 * shape.inter, dtype=dtype),
                     down_bias=meta(shape.experts, shape.hidden, dtype=dtype), activation=ClampedSwiGLU(1.702, 7.0))
    for tokens in token_counts:
        if shape.torch_routing:
            topk_weights, topk_ids = meta(tokens, shape.top_k, dtype=FLOAT), ids(tokens, shape.top_k)
        else:
            topk_weights, topk_ids = moe_routing(meta(tokens, shape.experts, dtype=dtype), shape.top_k, True)
        fused_moe(meta(tokens, shape.hidden, dtype=dtype), gate_up, down, topk_weights, topk_ids, **extra)


LINEAR = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # Llama-3-8B's (N, K): qkv, o, gate_up, down
LINEAR_TOKENS = (1, 64, PREFILL_TOKENS)


def int8_linear(bias: bool, shapes: tuple[tuple[int, int], ...], token_counts: tuple[int, ...],
                dtype: torch.dtype) -> None:
    """W8A8: per-token activation quantization, then the int8 GEMM."""
    for n, k in shapes:
        for tokens in token_counts:
            w8a8.w8a8_linear(meta(tokens, k, dtype=dtype), meta(n, k, dtype=torch.int8), meta(n, 1, dtype=FLOAT),
                             meta(n, dtype=dtype) if bias else None)


def int4_linear(act_order: bool, shapes: tuple[tuple[int, int], ...], token_counts: tuple[int, ...],
                dtype: torch.dtype, group: int = 128) -> None:
    """W4A16 (AWQ/GPTQ, group 128): act-order permutes the activations (``TritonW4A16Kernel``)."""
    for n, k in shapes:
        kernel = TritonW4A16Kernel(meta(k // 8, n, dtype=torch.int32), meta(k // group, n, dtype=dtype),
                                   meta(k // group, n, dtype=FLOAT), group, ids(k) if act_order else None)
        for tokens in token_counts:
            kernel(meta(tokens, k, dtype=dtype), None)


# (N, K) of the GGUF layers a Q4_K_M file keeps Q6_K (v_proj, down_proj) in Llama-3-8B and TinyLlama-1.1B; a Q8_0
# file's every projection of Llama-3-8B
Q6K_LINEAR = ((1024, 4096), (4096, 14336), (256, 2048), (2048, 5632))
GGUF_TOKENS = (1, 16, 64, 512, PREFILL_TOKENS)


def gguf_blocks_linear(ggml_type: str, shapes: tuple[tuple[int, int], ...], token_counts: tuple[int, ...],
                       dtype: torch.dtype) -> None:
    """The Triton GEMMs on GGUF Q6_K and Q8_0 weights as ``nn/quant/gguf_cuda.py`` retiles them."""
    for n, k in shapes:
        for tokens in token_counts:
            x = meta(tokens, k, dtype=dtype)
            if ggml_type == 'Q6_K':
                gguf_linear.q6k_linear(x, meta(n, k // 8, dtype=torch.int32), meta(n, k // 16, dtype=torch.int32),
                                       meta(n, k // 16, dtype=torch.int8), meta(n, k // 256, dtype=torch.float16))
            else:
                gguf_linear.q8_0_linear(x, meta(n, k, dtype=torch.int8), meta(n, k // 32, dtype=torch.float16))


# tied GGUF token tables as LM heads (``TritonBlocks``): Gemma 3 270M's Q8_0 (262,144 x 640), Llama-3.2-1B's
# (128,256 x 2,048) in Q6_K and in Q4_K (its grid of 32 with fp32 scales and offsets, on the W4A16 GEMM)
TIED_TABLES = (('Q8_0', 262144, 640), ('Q6_K', 128256, 2048), ('Q4_K', 128256, 2048))
TIED_TOKENS = (1, 16, 64, 256, PREFILL_TOKENS)


def tied_tables(tables: tuple[tuple[str, int, int], ...], token_counts: tuple[int, ...], dtype: torch.dtype) -> None:
    """The LM head's GEMM on a tied table's blocks, retiled as ``nn/quant/gguf_cuda.py`` retiles them."""
    for ggml_type, n, k in tables:
        if ggml_type != 'Q4_K':
            gguf_blocks_linear(ggml_type, ((n, k),), token_counts, dtype)
            continue
        kernel = TritonW4A16Kernel(meta(k // 8, n, dtype=torch.int32), meta(k // 32, n, dtype=FLOAT),
                                   meta(k // 32, n, dtype=FLOAT), 32, None)
        for tokens in token_counts:
            kernel(meta(tokens, k, dtype=dtype), None)


def delta_decode(dtype: torch.dtype) -> None:
    """Qwen3-Next-80B-A3B's linear attention (16 key and 32 value heads of 128): one decode token of each sequence
    against a state pool of as many slots, at the decode batches."""
    for batch in DECODE_BATCHES:
        q, k = meta(batch, 16, 128, dtype=dtype), meta(batch, 16, 128, dtype=dtype)
        gated_delta_decode(q, k, meta(batch, 32, 128, dtype=dtype), meta(batch, 32, dtype=FLOAT),
                           meta(batch, 32, dtype=dtype), meta(batch, 32, 128, 128, dtype=FLOAT), ids(batch))


def _cases() -> list[Case]:
    cases = [Case('rows: norm, rotary, gated act', partial(rows, NORM_SIZES, ROTARY_SHAPES))]
    for shape in ATTENTION:
        for policy in (0, 8, 4):
            kv = f'kv{policy or 16}'
            cases += [Case(f'{shape.name} fill {kv}', partial(fill, shape, policy)),
                      Case(f'{shape.name} prefill {kv}', partial(prefill, shape, policy, PREFILL_TOKENS)),
                      Case(f'{shape.name} prefill 16 {kv}', partial(prefill, shape, policy, 16)),
                      Case(f'{shape.name} decode {kv}', partial(decode, shape, policy))]
    for heads in (128, 16):  # one GPU; a tensor-parallel rank of 8
        for policy in (0, 8, 4):
            kv = f' kv{policy}' if policy else ''
            cases += [Case(f'deepseek-v3 mla {heads}h prefill{kv}', partial(mla, heads, PREFILL_TOKENS, policy)),
                      Case(f'deepseek-v3 mla {heads}h prefill 16{kv}', partial(mla, heads, 16, policy)),
                      Case(f'deepseek-v3 mla {heads}h decode{kv}', partial(mla, heads, 0, policy))]
    for shape in EXPERTS:
        for weights in ('dense', *QUANTIZED_EXPERTS.get(shape.name, ())):
            cases.append(Case(f'{shape.name} moe {weights}', partial(moe, shape, weights, MOE_TOKENS[shape.name])))
    return cases + [Case('qwen3-next gated delta decode', delta_decode),
                    Case('llama3-8b w8a8', partial(int8_linear, False, LINEAR, LINEAR_TOKENS)),
                    Case('qwen2-style w8a8 + bias', partial(int8_linear, True, LINEAR, LINEAR_TOKENS)),
                    Case('llama3-8b w4a16 g128', partial(int4_linear, False, LINEAR, LINEAR_TOKENS)),
                    Case('llama3-8b w4a16 g128 act-order', partial(int4_linear, True, LINEAR, LINEAR_TOKENS)),
                    Case('llama3-8b, tinyllama gguf q6_k',
                         partial(gguf_blocks_linear, 'Q6_K', Q6K_LINEAR, GGUF_TOKENS)),
                    Case('llama3-8b gguf q8_0', partial(gguf_blocks_linear, 'Q8_0', LINEAR, GGUF_TOKENS)),
                    Case('gemma3, llama3.2-1b gguf tied tables', partial(tied_tables, TIED_TABLES, TIED_TOKENS))]


CASES = _cases()
_BY_NAME = {case.name: case for case in CASES}
# One compile per kernel where it can, at the shapes the sweep found hardest: Gemma's head dim 256 with every
# feature, int4 decode with sinks, MLA (int4 prefill and int8 decode: the fills too), the int4 MoE's widest tile (it
# was over the shared-memory limit) and the MXFP4 MoE's.
QUICK_CASES = [Case('rows (one size each)', partial(rows, (4096,), ((32, 128),))),
               _BY_NAME['gemma2-9b sliding fill kv8'], _BY_NAME['gemma2-9b sliding prefill kv16'],
               _BY_NAME['gpt-oss-20b sliding decode kv4'], _BY_NAME['deepseek-v3 mla 128h prefill'],
               _BY_NAME['deepseek-v3 mla 128h decode'], _BY_NAME['deepseek-v3 mla 128h prefill kv4'],
               _BY_NAME['deepseek-v3 mla 128h decode kv8'],
               Case('qwen3-30b-a3b moe int4, 4096 tokens', partial(moe, EXPERTS[0], 'int4', (4096,))),
               Case('gpt-oss-20b moe mxfp4, 4096 tokens', partial(moe, EXPERTS[1], 'mxfp4', (4096,))),
               _BY_NAME['qwen3-next gated delta decode'],
               Case('llama3-8b w8a8 gate_up, 64 tokens', partial(int8_linear, False, LINEAR[2:3], (64,))),
               Case('llama3-8b w4a16 g128 down, 64 tokens', partial(int4_linear, False, LINEAR[3:], (64,))),
               Case('llama3-8b gguf q6_k down, 2048 tokens', partial(gguf_blocks_linear, 'Q6_K', Q6K_LINEAR[1:2],
                                                                     (PREFILL_TOKENS,))),
               Case('llama3-8b gguf q8_0 down, 2048 tokens', partial(gguf_blocks_linear, 'Q8_0', LINEAR[3:],
                                                                     (PREFILL_TOKENS,)))]
