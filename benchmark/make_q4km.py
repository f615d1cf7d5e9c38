"""Write a random-weight Llama as the Q4_K_M GGUF file users download, made the way they get it.

A Llama-architecture model of TinyLlama-1.1B's widths (hidden 2048, intermediate 5632, 32 heads, 4 KV
heads; ``--layers`` of them, 8 by default) with SmolLM2's tokenizer (vocab 49152, from the default
model) gets random weights from transformers, is saved in bf16, converted to F16 by llama.cpp's own
``convert_hf_to_gguf.py`` (in the llama-cpp-python sdist's ``vendor/llama.cpp``) and quantized to Q4_K_M
by ``llama_cpp.llama_model_quantize``: Q4_K with Q6_K for the output and for the ``attn_v`` and
``ffn_down`` of some layers. Run it with the llama-cpp-python venv of ``benchmark/llamacpp_b1.py``::

    PYTHONPATH=. /tmp/llamacpp_venv/bin/python benchmark/make_q4km.py \\
        --llamacpp-src /tmp/llamacpp_src/llama_cpp_python-0.3.36 --out /tmp/q4km/llama-q4km.gguf
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lmdeploy.model_source import default_model_path, resolve_model_path


def save_random_llama(folder: Path, layers: int, seed: int) -> None:
    """A random Llama with TinyLlama's widths and SmolLM2's tokenizer, saved in bf16."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(default_model_path()))
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=len(tokenizer),
                         max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype='bfloat16')
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--llamacpp-src', required=True, help='the unpacked llama-cpp-python sdist')
    parser.add_argument('--out', required=True, help='the Q4_K_M .gguf to write')
    parser.add_argument('--layers', type=int, default=8)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    import llama_cpp

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    convert = Path(args.llamacpp_src) / 'vendor' / 'llama.cpp' / 'convert_hf_to_gguf.py'
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        folder = Path(tmp) / 'hf'
        save_random_llama(folder, args.layers, args.seed)
        f16 = Path(tmp) / 'model-f16.gguf'
        subprocess.run([sys.executable, str(convert), str(folder), '--outtype', 'f16', '--outfile', str(f16)],
                       check=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), params) != 0:
            raise RuntimeError('llama_model_quantize failed')
    print(f'wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)')


if __name__ == '__main__':
    main()
