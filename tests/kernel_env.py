"""Shared setup of the Triton kernel tests: the interpreter on CPU, the device and dtypes to test.

Import it before anything that imports triton; a missing triton skips the importing test module.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')
pytest.importorskip('triton')

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
# The interpreter computes bf16 wrongly, so bf16 is tested on CUDA only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == 'cuda' else [])
