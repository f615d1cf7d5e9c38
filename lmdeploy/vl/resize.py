"""The pixels of transformers' torchvision image processors without torchvision.

torchvision resizes a uint8 image with PyTorch's CPU kernel for uint8 (``interpolate(..., antialias=True)``): PIL's
antialiased filters, weights normalized in float64 and rounded to int16 at the precision the axis's largest weight
allows, the width resampled first, each pass rounded and clamped to uint8. :func:`resize_uint8` computes that in
numpy (a torch op on the preprocessing thread would start an OpenMP team there, see ``image_inputs``).
:class:`TorchvisionResize` puts it under the resize of a transformers PIL-backend image processor.
"""
from __future__ import annotations

import math

import numpy as np
from transformers.image_processing_backends import PilBackend
from transformers.image_transforms import get_resize_output_image_size, get_size_with_aspect_ratio
from transformers.image_utils import ChannelDimension, PILImageResampling, SizeDict


def _triangle(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic with ``a = -0.5``, in PyTorch's order of operations (the last bit of a weight can matter)."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


# resample -> (the filter's radius at scale 1, the filter)
FILTERS = {PILImageResampling.BILINEAR: (1.0, _triangle), PILImageResampling.BICUBIC: (2.0, _keys_cubic)}


def _axis_weights(in_size: int, out_size: int, resample: PILImageResampling) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output index the input indices it reads ``[out, taps]`` and their int16 weights, and their precision."""
    radius, kernel = FILTERS[resample]
    scale = in_size / out_size
    support = radius * scale if scale >= 1.0 else radius
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    taps = np.arange(math.ceil(support) * 2 + 1)
    center = scale * (np.arange(out_size) + 0.5)
    first = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)
    count = np.clip(np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first, 0, len(taps))
    x = ((first[:, None] + taps).astype(np.float64) - center[:, None] + 0.5) * invscale
    weights = np.where(taps < count[:, None], kernel(x), 0.0)
    total = np.zeros(out_size)
    for column in weights.T:  # in order, as the kernel sums them
        total += column
    normalized = total != 0.0
    weights[normalized] /= total[normalized, None]
    largest = weights[normalized].max(initial=0.0)
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < 1 << 15:
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    return np.minimum(first[:, None] + taps, in_size - 1), fixed, precision


def _resample_axis(pixels: np.ndarray, size: int, axis: int, resample: PILImageResampling) -> np.ndarray:
    indices, weights, precision = _axis_weights(pixels.shape[axis], size, resample)
    used = weights.any(axis=0)  # the last taps are zero for every output where the support rounds down
    indices, weights = indices[:, used], weights[:, used]
    source = np.ascontiguousarray(np.moveaxis(pixels, axis, 0))  # gathering whole rows of the other axes
    rest = (1, ) * (source.ndim - 1)
    total = np.full((size, ) + source.shape[1:], 1 << (precision - 1), np.int32)
    product = np.empty_like(total)
    for tap in range(indices.shape[1]):
        total += np.multiply(source[indices[:, tap]], weights[:, tap].reshape(-1, *rest), out=product)
    return np.moveaxis(np.clip(total >> precision, 0, 255).astype(np.uint8), 0, axis)


def resize_uint8(pixels: np.ndarray, height: int, width: int, resample: PILImageResampling,
                 channel_axis: int = -1) -> np.ndarray:
    """``pixels`` (uint8, channels at ``channel_axis``: -1 or 0) resized to ``height x width`` as torchvision's
    ``resize`` with ``antialias=True`` resizes a uint8 tensor on an AVX2 / AVX-512 or ARM CPU (bilinear or
    bicubic)."""
    rows, cols = (0, 1) if channel_axis == -1 else (1, 2)
    if pixels.shape[cols] != width:
        pixels = _resample_axis(pixels, width, cols, resample)
    if pixels.shape[rows] != height:
        pixels = _resample_axis(pixels, height, rows, resample)
    return pixels


def round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 ``values`` rounded to the nearest bfloat16 (ties to even), kept as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


class TorchvisionResize(PilBackend):
    """Mixed in under a PIL-backend image processor (``type(name, (ProcessorPil, TorchvisionResize), {})``: the
    processor's own ``resize`` calls this one through ``super()``), it resizes uint8 images with bilinear or
    bicubic filters as the processor's torchvision backend does; other images and filters go to PIL."""

    def resize(self, image: np.ndarray, size: SizeDict, resample: PILImageResampling | None = None,
               **kwargs) -> np.ndarray:
        resample = PILImageResampling.BILINEAR if resample is None else PILImageResampling(resample)
        if image.dtype != np.uint8 or resample not in FILTERS:
            return super().resize(image, size, resample=resample, **kwargs)
        height, width = image.shape[-2:]
        if size.shortest_edge and size.longest_edge:
            new_size = get_size_with_aspect_ratio((height, width), size.shortest_edge, size.longest_edge)
        elif size.shortest_edge:
            new_size = get_resize_output_image_size(image, size=size.shortest_edge, default_to_square=False,
                                                    input_data_format=ChannelDimension.FIRST)
        elif size.height and size.width:
            new_size = (size.height, size.width)
        else:
            return super().resize(image, size, resample=resample, **kwargs)
        return resize_uint8(image, *new_size, resample, channel_axis=0)


def with_torchvision_resize(processor: PilBackend) -> PilBackend:
    """``processor`` (a PIL-backend image processor) resizing as its torchvision backend does."""
    processor.__class__ = type(type(processor).__name__, (type(processor), TorchvisionResize), {})
    return processor
