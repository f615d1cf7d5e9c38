"""Weight formats of linear layers: what a checkpoint stores for a layer (:class:`WeightFormat`,
chosen once from its ``quantization_config``) and the kernel that multiplies by it once loaded
(:class:`LinearKernel`, chosen once by :meth:`WeightFormat.make_kernel`). A new format is a new
module here that registers itself with :func:`register_format`."""
from lmdeploy.pytorch.nn.quant.base import (ExpertKernel, Layout, LinearKernel, LinearOptions, WeightFormat,
                                            cast_model, current_weight_format, defer_weights, layout_of,
                                            new_parameter, register_format, use_weight_format, weight_format_for,
                                            weights_device)
from lmdeploy.pytorch.nn.quant import awq, fp8, gguf, gptq, mxfp4, w8a8  # noqa: F401  (register their formats)

__all__ = ['ExpertKernel', 'Layout', 'LinearKernel', 'LinearOptions', 'W8A8Format', 'WeightFormat', 'cast_model',
           'current_weight_format', 'defer_weights', 'layout_of', 'new_parameter', 'register_format',
           'use_weight_format', 'weight_format_for', 'weights_device']
