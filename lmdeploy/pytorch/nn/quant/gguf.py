"""GGUF Q4_K, Q5_K, Q6_K and Q8_0 linear weights as llama.cpp stores them (``quant_method: gguf``, written by
``weights/gguf.py``): ``qweight uint8 [N, K / B, block bytes]``, each row's blocks of ``B`` inputs. A file's
``ggml_types`` names each layer kept so and its type; its other layers were dequantized at conversion.

- Q8_0 (``B = 32``, 34 bytes): an fp16 scale ``d`` and 32 int8 codes, ``W = d * q``. Held as int8 codes
  and fp32 scales, dequantized on each call (in fp32, then to the activations' dtype) for ``F.linear``; in
  bf16 on the CPU, small steps run on the native 8-bit GEMV instead
  (``kernels/cpu/linear_q8.cpp``: the same blocks, the activations in fp32); on CUDA every step on the Triton
  Q8_0 GEMM (:mod:`lmdeploy.pytorch.nn.quant.gguf_cuda`: the codes and the file's fp16 scales).
- Q4_K (``B = 256``, 144 bytes): fp16 ``d`` and ``dmin``, eight 6-bit scales ``sc`` and mins ``m``, 256
  4-bit codes; ``W = q * (d * sc) - dmin * m`` per 32 inputs: a 4-bit grid of groups of 32 (exact in
  fp32), served by the 4-bit kernels (:mod:`lmdeploy.pytorch.nn.quant.w4a16`); in bf16 on the CPU small steps
  on the native Q4_K GEMV (:mod:`lmdeploy.pytorch.nn.quant.q4k_cpu`: the codes
  and the file's scales as they are, exactly its weights), larger ones dequantize that copy for the call
  (``q4k_dequantize``; no other copy kept), as Q5_K, in the native decoder stack too.
- Q5_K (``B = 256``, 176 bytes): Q4_K's ``d``, ``dmin``, ``sc`` and ``m`` and 5-bit codes (``qh`` the fifth bits);
  ``W = u * (d * sc) - dmin * m`` per 32 inputs. In bf16 on the CPU small steps
  on the native Q5_K GEMV (:mod:`lmdeploy.pytorch.nn.quant.q5k_cpu`: the file's bits retiled, its weights exactly),
  larger ones dequantize that copy for the call (no bf16 copy kept); elsewhere (fp32, CUDA, no AVX512-BF16) the
  blocks dequantized on each call; a MoE layer's Q5_K experts likewise, each routed expert as a dense layer.
- Q6_K (``B = 256``, 210 bytes): 6-bit codes ``u``, an int8 scale ``sc`` per 16 inputs and an fp16 ``d``;
  ``W = (u - 32) * (d * sc)``. In bf16 on the CPU, small steps run on the
  native Q6_K GEMV (``kernels/cpu/linear_q6k.cpp``: the file's codes and scales retiled, its weights exactly),
  larger ones dequantize that copy for the call (no bf16 copy kept), as Q5_K; on CUDA every step on the
  Triton Q6_K GEMM (the file's bits retiled, 0.82 bytes a weight); otherwise int8 codes and fp32 scales
  dequantized on each call. A file's Q6_K output layer (Q4_K_M's) runs its small steps on the
  GEMV the same way.

A MoE layer's experts (``ffn_{gate,up,down}_exps``, one ``qweight`` per expert and projection) keep their blocks
the same way, each projection in its own type (:class:`GgufExpertsFormat`): in bf16 on the CPU each routed
expert runs Q4_K, Q5_K, Q6_K and Q8_0 as dense layers of those types do (small steps on the type's GEMV, Q4_K's
gate and up with their SiLU epilogue; large steps dequantized per call); on CUDA the Triton fused MoE
on every projection's blocks (Q4_K's grids, Q6_K's and Q8_0's retiled as for the dense GEMMs);
otherwise each routed expert is dequantized on its call.

Small steps, in bf16 on the CPU: a layer's or an expert's decode rows in an engine step, however many share it, and
never its prefill rows (``decode_rows_on_gemv``, see :func:`~lmdeploy.pytorch.step_context.small_step`: a prompt's
output does not depend on its batch); outside a step, up to the type's ``gemv_max_rows`` rows.

A stacked layer (q/k/v, gate/up) whose parts differ in type (Q4_K_M's Q6_K ``attn_v`` beside Q4_K ``attn_q`` and
``attn_k``) keeps each part as its blocks on its type's kernel (:class:`GgufPartsFormat`).

In fp32 on the CPU (``dtype='float32'``, asked for: ``auto`` is bf16) every layer's and expert's blocks are
dequantized once at load (:func:`dequantized_kernel`: packed for the fixed-order fp32 GEMM where it is built), not on
each call: the same fp32 weights, so the same logits, at the memory of the fp32 model that was asked for (4 bytes a
weight, as transformers' reading of the file).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmdeploy.pytorch.nn.quant.base import (ExpertKernel, Layout, LinearKernel, LinearOptions, WeightFormat,
                                            new_parameter, register_format)
from lmdeploy.pytorch.nn.quant.cpu_fp32 import native_fp32_kernel
from lmdeploy.pytorch.nn.quant.dense import DenseFormat, DenseKernel
from lmdeploy.pytorch.nn.quant.gguf_blocks import (BLOCKS, Q8_0Gemv, Q8Kernel, dequantize_blocks, int8_unpack,
                                                   q4_k_grid, q6_k_lm_head_kernel)
from lmdeploy.pytorch.nn.quant.parts import PartsKernel
from lmdeploy.pytorch.nn.quant.q4k_cpu import Q4KGemv
from lmdeploy.pytorch.nn.quant.q5k_cpu import Q5KGemv
from lmdeploy.pytorch.nn.quant.q6k_cpu import Q6KGemv
from lmdeploy.pytorch.nn.quant.w4a16 import Int4GroupFormat, Int4Grid, PerExpertKernel, ReferenceKernel
from lmdeploy.pytorch.weights.gguf_types import engine_layer, part_index
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource, one_thread, read_shard, release_free_heap

if TYPE_CHECKING:
    from lmdeploy.pytorch.nn.linear import Linear
    from lmdeploy.pytorch.nn.moe import ExpertProjection, FusedExperts


class DequantizedKernel(LinearKernel):
    """A layer's blocks dequantized once at load: ``F.linear`` on its fp32 weight (fp32 models on the CPU)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)


def dequantized_kernel(weight: torch.Tensor) -> LinearKernel:
    """The kernel of a layer's fp32 weight dequantized at load: the native fixed-order fp32 GEMM's packed copy where
    it is built (rows independent of their number), else :class:`DequantizedKernel`."""
    return native_fp32_kernel(weight) or DequantizedKernel(weight)


def fp32_on_cpu(options: LinearOptions, device: str) -> bool:
    """Whether blocks on ``device`` are dequantized once at load: fp32 on the CPU."""
    return options.dtype == torch.float32 and device == 'cpu'


class GgufFormat(Int4GroupFormat):
    """A GGUF linear weight of one type, Q4_K, Q5_K, Q6_K or Q8_0, as its blocks."""

    def __init__(self, ggml_type: str):
        if ggml_type not in BLOCKS:
            raise ValueError(f'GGUF linear weights of types {sorted(BLOCKS)} are served as blocks, not {ggml_type}')
        super().__init__(32)
        self.ggml_type = ggml_type
        self.block_inputs, self.block_bytes = BLOCKS[ggml_type]
        self.split_granule = self.block_inputs

    def params(self) -> tuple[str, ...]:
        return ('qweight',)

    def create_weights(self, layer: Linear) -> None:
        if layer.in_features % self.block_inputs:
            raise ValueError(f'a {self.ggml_type} layer needs inputs in blocks of {self.block_inputs}, '
                             f'not {layer.in_features}')
        layer.qweight = new_parameter((layer.out_features, layer.in_features // self.block_inputs, self.block_bytes),
                                      Layout(0, 1, 1, self.block_inputs), torch.uint8)

    def unpack(self, layer: Linear) -> Int4Grid:
        return q4_k_grid(layer.qweight)

    def dequantize(self, layer: Linear) -> torch.Tensor:
        return dequantize_blocks(layer.qweight, self.ggml_type)

    def make_kernel(self, layer: Linear, options: LinearOptions) -> LinearKernel:
        if fp32_on_cpu(options, layer.qweight.device.type):
            kernel = dequantized_kernel(self.dequantize(layer))
            layer.qweight = None
            return kernel
        cpu_bf16 = options.dtype == torch.bfloat16 and layer.qweight.device.type == 'cpu'
        if self.ggml_type == 'Q4_K':
            native = Q4KGemv.of_blocks(layer.qweight, layer.gate_up_panels) if cpu_bf16 else None
            if native is None:
                return super().make_kernel(layer, options)
            layer.qweight = None
            return native.layer_kernel()
        if self.ggml_type == 'Q5_K':  # dequantized on each call where the native GEMV does not run it
            native = Q5KGemv.of(layer.qweight) if cpu_bf16 else None
            if native is None:
                return ReferenceKernel(self, layer)
            layer.qweight = None
            return native.layer_kernel()
        if cpu_bf16 and self.ggml_type == 'Q6_K':
            native = Q6KGemv.of(layer.qweight)
            if native is not None:
                layer.qweight = None
                return native.layer_kernel()
        if options.dtype is None:
            return ReferenceKernel(self, layer)
        if layer.qweight.device.type == 'cuda':
            from lmdeploy.pytorch.nn.quant.gguf_cuda import TRITON_KERNELS
            kernel = TRITON_KERNELS[self.ggml_type](layer.qweight)
            layer.qweight = None
            return kernel
        codes, scales = int8_unpack(layer.qweight, self.ggml_type)
        native = Q8_0Gemv.of(codes, scales) if cpu_bf16 and self.ggml_type == 'Q8_0' else None
        kernel = native.layer_kernel() if native is not None else Q8Kernel(codes, scales)
        layer.qweight = None
        return kernel


class GgufExpertsFormat(WeightFormat):
    """A MoE layer's experts from a GGUF file: each projection (``gate_up``, ``down``) in its type's
    :class:`GgufFormat`, or dense where the file's type is not served as blocks (or gate and up differ)."""

    def __init__(self, formats: dict[str, WeightFormat]):
        self.formats = formats

    def expert_format(self, proj: str) -> WeightFormat:
        return self.formats[proj]

    def create_weights(self, layer: Linear) -> None:
        raise TypeError('GgufExpertsFormat holds the experts of a MoE layer, not a linear layer')

    def make_kernel(self, layer: Linear, options: LinearOptions) -> LinearKernel:
        raise TypeError('GgufExpertsFormat holds the experts of a MoE layer, not a linear layer')

    def make_expert_kernel(self, experts: FusedExperts, options: LinearOptions) -> ExpertKernel:
        device = getattr(experts, experts.param_name('down', experts.kinds['down'][0])).device.type
        on_triton = not any(isinstance(f, GgufFormat) and f.ggml_type == 'Q5_K' for f in self.formats.values())
        if options.dtype is not None and device == 'cuda' and on_triton:
            kernel = self.triton_kernel(experts)
        elif options.dtype == torch.bfloat16 and device == 'cpu':
            with one_thread():  # each expert's blocks retiled by a few small ops
                kernels = {proj: [self.cpu_kernel(proj, experts.projection(proj, e))
                                  for e in range(experts.num_experts)] for proj in self.formats}
            kernel = PerExpertKernel(experts.num_experts, lambda proj, expert: kernels[proj][expert])
        elif fp32_on_cpu(options, device):
            kernels = {proj: [self.fp32_kernel(proj, experts.projection(proj, e)) for e in range(experts.num_experts)]
                       for proj in self.formats}
            kernel = PerExpertKernel(experts.num_experts, lambda proj, expert: kernels[proj][expert])
        else:
            return PerExpertKernel(experts.num_experts,
                                   lambda proj, expert: self.reference_kernel(proj, experts.projection(proj, expert)))
        experts.release()
        release_free_heap()  # the pages of the blocks' retiling temporaries, freed between the kept tensors
        return kernel

    def triton_kernel(self, experts: FusedExperts) -> ExpertKernel:
        """The Triton fused MoE on each projection's blocks: Q4_K's grids (``Int4Experts``), Q6_K's and Q8_0's
        retiled for their GEMMs (``Q6KExperts``, ``Q8Experts``); dense ones as they are."""
        from lmdeploy.pytorch.nn.quant.gguf_cuda import stacked_block_experts
        from lmdeploy.pytorch.nn.quant.w4a16_cuda import TritonInt4ExpertKernel, stacked_experts
        stacked = {}
        for proj, projection_format in self.formats.items():
            projections = [experts.projection(proj, e) for e in range(experts.num_experts)]
            if not isinstance(projection_format, GgufFormat):
                stacked[proj] = getattr(experts, proj)
            elif projection_format.ggml_type == 'Q4_K':
                stacked[proj] = stacked_experts(q4_k_grid(layer.qweight) for layer in projections)
            else:
                stacked[proj] = stacked_block_experts(projection_format.ggml_type, [p.qweight for p in projections])
        return TritonInt4ExpertKernel(stacked['gate_up'], stacked['down'])

    def reference_kernel(self, proj: str, layer: ExpertProjection) -> LinearKernel:
        """One expert's projection dequantized (or dense) on each call."""
        projection_format = self.formats[proj]
        return ReferenceKernel(projection_format, layer) if isinstance(projection_format, GgufFormat) else (
            DenseKernel(layer))

    def fp32_kernel(self, proj: str, layer: ExpertProjection) -> LinearKernel:
        """One expert's projection in fp32 on the CPU: its blocks dequantized once, a dense one as it is."""
        projection_format = self.formats[proj]
        return dequantized_kernel(projection_format.dequantize(layer)) if isinstance(projection_format, GgufFormat) \
            else DenseKernel(layer)

    def cpu_kernel(self, proj: str, layer: ExpertProjection) -> LinearKernel:
        """One expert's projection for bf16 activations on the CPU: its blocks on their type's GEMV where it is built,
        as a layer's (:func:`~lmdeploy.pytorch.nn.quant.q6k_cpu.decode_rows_on_gemv`: in an engine step its decode
        rows on the GEMV and its prefill rows dequantized, however many the expert gets), else a Q4_K grid on an int4
        kernel and the others dequantized on each call; a dense one on ``F.linear``."""
        projection_format = self.formats[proj]
        if not isinstance(projection_format, GgufFormat):
            return DenseKernel(layer)
        ggml_type = projection_format.ggml_type
        if ggml_type == 'Q4_K':
            native = Q4KGemv.of_blocks(layer.qweight, proj == 'gate_up')
            if native is not None:
                return native.layer_kernel()
            return Int4GroupFormat.cpu_kernel(q4_k_grid(layer.qweight), proj == 'gate_up', torch.bfloat16)
        if ggml_type == 'Q5_K':
            native = Q5KGemv.of(layer.qweight)
            return native.layer_kernel() if native is not None else ReferenceKernel(projection_format,
                                                                                      BlockRows(layer.qweight))
        native = Q6KGemv.of(layer.qweight) if ggml_type == 'Q6_K' else None
        if native is not None:
            return native.layer_kernel()
        codes, scales = int8_unpack(layer.qweight, ggml_type)
        native = Q8_0Gemv.of(codes, scales) if ggml_type == 'Q8_0' else None
        return native.layer_kernel() if native is not None else Q8Kernel(codes, scales)


@dataclass
class BlockRows:
    """One part's rows of a stacked layer's blocks, as :meth:`GgufFormat.make_kernel` reads a layer."""

    qweight: torch.Tensor | None
    gate_up_panels: bool = False


class GgufPartsFormat(WeightFormat):
    """A stacked layer whose parts differ in type (``parts[i]`` the format of part ``i``), each part kept as its
    blocks and run on its type's kernel (:class:`PartsKernel`). Its ``qweight uint8 [N, bytes]`` holds each row's
    blocks flat, a part's rows padded to the widest part's (:meth:`GgufFileFormat.convert_checkpoint` pads them)."""

    def __init__(self, parts: list[GgufFormat]):
        self.parts = parts

    def row_bytes(self, part: int, in_features: int) -> int:
        return in_features // self.parts[part].block_inputs * self.parts[part].block_bytes

    def width(self, in_features: int) -> int:
        """The bytes of a ``qweight`` row: the widest part's."""
        return max(self.row_bytes(i, in_features) for i in range(len(self.parts)))

    def padded(self, blocks: torch.Tensor, part: int) -> torch.Tensor:
        """Part ``part``'s ``[rows, K / B, bytes]`` blocks from the checkpoint as rows of ``qweight``."""
        in_features = blocks.shape[1] * self.parts[part].block_inputs
        rows = blocks.reshape(blocks.shape[0], -1)
        return F.pad(rows, (0, self.width(in_features) - rows.shape[1]))

    def create_weights(self, layer: Linear) -> None:
        for part in self.parts:
            if layer.in_features % part.block_inputs:
                raise ValueError(f'a {part.ggml_type} layer needs inputs in blocks of {part.block_inputs}, '
                                 f'not {layer.in_features}')
        layer.qweight = new_parameter((layer.out_features, self.width(layer.in_features)), Layout(0, None),
                                      torch.uint8)

    def blocks(self, layer: Linear, part: int) -> torch.Tensor:
        """Part ``part``'s rows of ``layer`` as ``[rows, K / B, bytes]`` blocks of its type."""
        start, stop = layer.offsets[part], layer.offsets[part + 1]
        rows = layer.qweight[start:stop, :self.row_bytes(part, layer.in_features)]
        return rows.reshape(stop - start, -1, self.parts[part].block_bytes).contiguous()

    def dequantize(self, layer: Linear) -> torch.Tensor:
        return torch.cat([dequantize_blocks(self.blocks(layer, i), part.ggml_type)
                          for i, part in enumerate(self.parts)])

    def make_kernel(self, layer: Linear, options: LinearOptions) -> LinearKernel:
        if options.dtype is None:
            return ReferenceKernel(self, layer)
        if fp32_on_cpu(options, layer.qweight.device.type):
            kernel = dequantized_kernel(self.dequantize(layer))
            layer.qweight = None
            return kernel
        parts = [part.make_kernel(BlockRows(self.blocks(layer, i)), options) for i, part in enumerate(self.parts)]
        sizes = [stop - start for start, stop in zip(layer.offsets, layer.offsets[1:])]
        layer.qweight = None
        return PartsKernel(parts, sizes)


@register_format('gguf')
class GgufFileFormat(DenseFormat):
    """A converted GGUF file's linear layers: those of ``ggml_types`` (``{name in the model: type}``) as their
    blocks, each in its type's :class:`GgufFormat`; the others dense (dequantized at conversion). Under tensor
    parallelism MLPs deal out their intermediate features in whole blocks (:attr:`split_granule`); a row-parallel
    layer whose share of the inputs still splits blocks is dense too: its blocks are dequantized as they load
    (:meth:`convert_checkpoint`). An output layer of type ``lm_head`` (Q6_K) comes
    as ``lm_head.qweight`` blocks: it loads dequantized, and its CPU LM head runs small steps on the blocks. A token
    embedding of type ``embed_tokens`` (Q4_K, Q6_K, Q8_0) stays as its blocks, a tied LM head reading them too
    (:class:`~lmdeploy.pytorch.nn.embedding.VocabParallelEmbedding`)."""

    def __init__(self, ggml_types: dict[str, str | list[str]], lm_head: str | None = None,
                 embed_tokens: str | None = None):
        formats: dict[str, GgufFormat] = {}

        def layer_format(types: str | list[str]) -> WeightFormat:
            parts = [formats.setdefault(ggml_type, GgufFormat(ggml_type)) for ggml_type in
                     ([types] if isinstance(types, str) else types)]
            return parts[0] if isinstance(types, str) else GgufPartsFormat(parts)

        self.layer_formats = {name: layer_format(types) for name, types in ggml_types.items()}
        # the widest block of the kept types: MLP shares of whole blocks keep their blocks on every rank
        self.split_granule = max((f.block_inputs for f in formats.values()), default=1)
        self.dequantized: dict[str, str] = {}  # layer -> type, of layers that hold their blocks dequantized
        self.lm_head_type = lm_head
        self.embedding_block_type = embed_tokens
        self.lm_head_blocks: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: dict) -> GgufFileFormat:
        if 'ggml_types' not in config:
            raise ValueError('this GGUF folder was converted by an older lmdeploy (one ggml_type for every layer); '
                             'convert the .gguf file again')
        return cls(config['ggml_types'], config.get('lm_head'), config.get('embed_tokens'))

    def lm_head_kernel(self, table: torch.Tensor) -> LinearKernel | None:
        """The output layer's blocks: on CUDA its type's Triton GEMM at every step; in bf16 on the CPU the Q6_K GEMV
        for small steps (fp32 logits), the table's GEMM above; else (and for a vocab-parallel share) None."""
        blocks, self.lm_head_blocks = self.lm_head_blocks, None
        if blocks is None or table.shape[0] != blocks.shape[0]:  # a vocab-parallel share
            return None
        if table.device.type == 'cuda':
            from lmdeploy.pytorch.nn.quant.gguf_cuda import TRITON_KERNELS
            return TRITON_KERNELS[self.lm_head_type](blocks.to(table.device))
        if table.dtype != torch.bfloat16 or table.device.type != 'cpu':
            return None
        return q6_k_lm_head_kernel(blocks, table)

    def layer_format(self, name: str, layer: Linear | FusedExperts) -> WeightFormat:
        projections = {'gate_up': f'{name}.gate_up_proj', 'down': f'{name}.down_proj'}
        if any(projection in self.layer_formats for projection in projections.values()):  # experts
            down = self.layer_formats.get(projections['down'])
            start, stop = layer.share(down.block_inputs if isinstance(down, GgufFormat) else 1)
            inputs = {'gate_up': layer.hidden_size, 'down': stop - start}
            formats = {proj: self.block_format(projection, inputs[proj]) for proj, projection in projections.items()}
            return GgufExpertsFormat({proj: DenseFormat() if fmt is self else fmt for proj, fmt in formats.items()})
        return self.block_format(name, layer.in_features)

    def block_format(self, name: str, in_features: int) -> WeightFormat:
        """The format of the layer (or experts' projection) ``name`` of ``in_features`` inputs: its blocks',
        or this (dense) one where the file's type is not kept or its share of the inputs splits blocks."""
        layer_format = self.layer_formats.get(name)
        if layer_format is None:
            return self
        if isinstance(layer_format, GgufFormat) and in_features % layer_format.block_inputs:
            self.dequantized[name] = layer_format.ggml_type
            return self
        return layer_format

    def convert_checkpoint(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        for name, tensor in weights:
            if name == 'lm_head.qweight':
                self.lm_head_blocks = read_shard(tensor, None)
                yield 'lm_head.weight', dequantize_blocks(self.lm_head_blocks, self.lm_head_type)
                continue
            base = name.removesuffix('.qweight')
            layer = engine_layer(base + '.weight') if base != name else None
            parts = self.layer_formats.get(layer)
            if layer in self.dequantized:
                yield base + '.weight', dequantize_blocks(read_shard(tensor, None), self.dequantized[layer])
            elif isinstance(parts, GgufPartsFormat):
                yield name, parts.padded(read_shard(tensor, None), part_index(base + '.weight'))
            else:
                yield name, tensor
