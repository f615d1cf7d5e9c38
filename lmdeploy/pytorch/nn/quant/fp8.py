"""FP8 checkpoints with block scales (``quant_method: fp8``, DeepSeek-V3): a quantized weight is
``float8_e4m3fn [N, K]`` with ``weight_scale_inv fp32 [ceil(N / bn), ceil(K / bk)]``, one scale per block
of ``weight_block_size [bn, bk]``, the weight being each code times its block's scale. The weights are
dequantized to the model's dtype as they are read, so layers (and experts) hold dense weights."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from lmdeploy.pytorch.nn.quant.base import register_format
from lmdeploy.pytorch.nn.quant.dense import DenseFormat
from lmdeploy.pytorch.weights.safetensors_loader import FileTensor, WeightSource, read_shard

SCALE_SUFFIX = '_scale_inv'
FP8_DTYPES = {'F8_E4M3': torch.float8_e4m3fn}


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight [N, K]`` (fp8 codes) times the scale of its ``block`` in ``scale_inv``, in fp32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def _is_fp8(source: WeightSource) -> bool:
    if isinstance(source, FileTensor):
        return source.handle.get_slice(source.name).get_dtype() in FP8_DTYPES
    return isinstance(source, torch.Tensor) and source.dtype == torch.float8_e4m3fn


@register_format('fp8')
class Fp8BlockFormat(DenseFormat):
    """Block-scaled FP8 weights, dequantized at load (:meth:`convert_checkpoint`)."""

    def __init__(self, block: tuple[int, int]):
        self.block = block

    @classmethod
    def from_config(cls, config: dict) -> Fp8BlockFormat:
        block = config.get('weight_block_size')
        if not block or len(block) != 2 or config.get('fmt', 'e4m3') != 'e4m3':
            raise ValueError('FP8 checkpoints of e4m3 weights with block scales (weight_block_size [bn, bk]) are '
                             f'supported, not {config}')
        return cls((int(block[0]), int(block[1])))

    def convert_checkpoint(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Each fp8 weight dequantized once its scale was read too (in either order); other tensors as
        they come. Raises naming an fp8 weight without a scale, or a scale without its weight."""
        codes: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for name, source in weights:
            if name.endswith(SCALE_SUFFIX):
                name = name.removesuffix(SCALE_SUFFIX)
                scales[name] = read_shard(source, None)
            elif _is_fp8(source):
                codes[name] = read_shard(source, None)
            else:
                yield name, source
                continue
            if name in codes and name in scales:
                yield name, dequantize_fp8(codes.pop(name), scales.pop(name), self.block)
        if codes or scales:
            raise ValueError(f'fp8 weights without scales or scales without weights: {sorted({*codes, *scales})[:5]}')
