"""Shared setup of the Triton kernel tests: the device and dtypes to test (conftest.py turns on the
interpreter on CPU); a missing triton skips the importing test module."""
import pytest
import torch

pytest.importorskip('triton')

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
# The interpreter computes bf16 wrongly, so bf16 is tested on CUDA only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == 'cuda' else [])
