"""Batch-1 decode and prefill tokens/s of llama.cpp (llama-cpp-python) and this engine on the same GGUF file,
in one run.

Both sides get the same prompt (token ids from the file's tokenizer), decode greedily, and are timed over
the same number of generated tokens after the step that prefills and samples the first one; each side's
token count is checked. With ``--prefill-tokens N`` each round also times a prefill of an N-token prompt
(the prompt's tokens repeated) up to its first token (llama.cpp: ``eval`` of the prompt, its logits).
llama.cpp runs with ``--threads`` threads for decode and batch, this engine with ``num_threads`` the same. After a warm-up run of each, the rounds alternate which side goes
first, and each round prints both figures and their ratio; the end prints the medians. With ``--threads 1
--cpu-time`` the rates count the calling thread's CPU time, in which both sides then compute: on a machine that
other jobs load, what each side computes rather than what the scheduler gives it (cache sharing still counts).

Rows of this engine (dtype auto, bf16 on the CPU; prefix caching off; activations never quantized):

- ``lmdeploy``: its defaults (``decode_int4`` on for a Q4_1 file such as the default model: batch-1 steps
  on 4-bit copies of the decoder's projections; a file's Q4_K and Q6_K layers as their blocks, a stacked
  layer of both part by part, e.g. a Q4_K_M file from ``benchmark/make_q4km.py``);
- ``lmdeploy bf16`` (``--with-bf16``): ``decode_int4=False``.

llama-cpp-python is a benchmark-only dependency (not in requirements); build it from source for this CPU in
a venv of its own that still sees this environment's torch and lmdeploy::

    python -m venv --system-site-packages /tmp/llamacpp_venv
    CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp_venv/bin/pip install --no-binary llama-cpp-python llama-cpp-python
    PYTHONPATH=. /tmp/llamacpp_venv/bin/python benchmark/llamacpp_b1.py

On a Xeon with AMX, ``-DGGML_NATIVE=ON`` turns on ggml's AMX matmul, which crashed there: build with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"`` instead (ggml's ``GGML_AMX_TILE``/``INT8``/``BF16`` options
default to off when ``GGML_NATIVE`` is off; they are the only way AMX gets in).
"""
from __future__ import annotations

import argparse
import statistics
import time

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import default_model_path, resolve_model_path
from lmdeploy.pytorch.engine.engine import Engine

PROMPT = ('The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined '
          'movable metal type, oil-based ink and a wooden screw press into a system that could produce books '
          'faster and more cheaply than ever before. Explain how this changed the spread of knowledge in Europe.')
LABEL_WIDTH = 30
# what the rates are timed by: wall time, or with --cpu-time the calling thread's CPU time
CLOCK = [time.perf_counter]


def llamacpp_decode_rate(llm, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Greedy decode tokens/s of llama.cpp: ``n`` tokens timed after the first (EOS does not stop it)."""
    tokens = []
    start = 0.0
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(token)
        if len(tokens) == 1:
            start = CLOCK[0]()
        if len(tokens) == n + 1:
            break
    elapsed = CLOCK[0]() - start
    assert len(tokens) == n + 1, f'llama.cpp produced {len(tokens)} tokens, asked {n + 1}'
    return n / elapsed, tokens


def engine_decode_rate(engine: Engine, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Greedy decode tokens/s of this engine: ``n`` tokens timed after the step that prefills and samples
    the first (``ignore_eos``)."""
    engine.add_request(prompt, GenerationConfig(max_new_tokens=n + 1, ignore_eos=True, do_sample=False))
    tokens: list[int] = []
    while not tokens:
        for out in engine.step():
            tokens += out.token_ids
    start = CLOCK[0]()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    elapsed = max(CLOCK[0]() - start, 1e-9)
    assert len(tokens) == n + 1, f'the engine produced {len(tokens)} tokens, asked {n + 1}'
    return n / elapsed, tokens


def llamacpp_prefill_rate(llm, prompt: list[int]) -> float:
    """Prefill tokens/s of llama.cpp: ``eval`` of the whole prompt from an empty context."""
    llm.reset()
    start = CLOCK[0]()
    llm.eval(prompt)
    elapsed = CLOCK[0]() - start
    assert llm.n_tokens == len(prompt), f'llama.cpp evaluated {llm.n_tokens} tokens, given {len(prompt)}'
    return len(prompt) / elapsed


def engine_prefill_rate(engine: Engine, prompt: list[int]) -> float:
    """Prefill tokens/s of this engine: the steps from the request to its first token."""
    start = CLOCK[0]()
    _, tokens = engine_decode_rate(engine, prompt, 0)
    elapsed = CLOCK[0]() - start
    assert len(tokens) == 1
    return len(prompt) / elapsed


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(title: str, rates: dict[str, float]) -> None:
    """One line of tokens/s per side and each engine's ratio to llama.cpp."""
    line = '   '.join(f'{label} {rate:6.1f}' for label, rate in rates.items())
    ratios = '   '.join(f'{label} / llama.cpp {rate / rates["llama.cpp"]:.2f}x'
                       for label, rate in rates.items() if label != 'llama.cpp')
    print(f'{title} (tok/s): {line}   {ratios}', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='a .gguf file (default: the bundled default model)')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--decode-tokens', type=int, default=128)
    parser.add_argument('--prefill-tokens', type=int, default=0, help='also time a prefill of this many tokens')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--with-bf16', action='store_true', help='add the engine with decode_int4=False')
    parser.add_argument('--cpu-time', action='store_true',
                        help='with --threads 1, time the calling thread\'s CPU time (each side computes in it) '
                        'instead of wall time: on a loaded machine, what each side computes, not what the '
                        'scheduler gives it')
    args = parser.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            parser.error('--cpu-time needs --threads 1: other threads\' work would not be counted')
        CLOCK[0] = time.thread_time
    from llama_cpp import Llama

    path = args.model or default_model_path()
    context = max(1024, args.prefill_tokens + 64)
    llm = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=context,
                n_batch=max(512, args.prefill_tokens), verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    long_prompt = (prompt * (args.prefill_tokens // len(prompt) + 1))[:args.prefill_tokens]
    sides = {'llama.cpp': lambda: llamacpp_decode_rate(llm, prompt, args.decode_tokens)}
    prefills = {'llama.cpp': lambda: llamacpp_prefill_rate(llm, long_prompt)}
    base = dict(enable_prefix_caching=False, num_threads=args.threads, num_gpu_blocks=context // 64 + 4)
    configs = {'lmdeploy': PytorchEngineConfig(**base)}
    if args.with_bf16:
        configs['lmdeploy bf16'] = PytorchEngineConfig(**base, decode_int4=False)
    model_dir = resolve_model_path(path)
    engines = {label: Engine(model_dir, config, show_progress=False) for label, config in configs.items()}
    for label, engine in engines.items():
        sides[label] = lambda engine=engine: engine_decode_rate(engine, prompt, args.decode_tokens)
        prefills[label] = lambda engine=engine: engine_prefill_rate(engine, long_prompt)
    try:
        outputs = {label: run()[1] for label, run in sides.items()}  # warm-up
        print(f'{len(prompt)} prompt tokens, {args.decode_tokens} timed decode tokens, {args.threads} threads')
        for label, tokens in list(outputs.items())[1:]:
            print(f'{label:<{LABEL_WIDTH}}: greedy output shares its first '
                  f'{agreement(tokens, outputs["llama.cpp"])} tokens with llama.cpp\'s')
        if args.prefill_tokens:
            for run in prefills.values():  # warm-up
                run()
        rates: dict[str, list[float]] = {label: [] for label in sides}
        prefill_rates: dict[str, list[float]] = {label: [] for label in sides}
        for index in range(args.rounds):
            order = list(sides) if index % 2 == 0 else list(reversed(sides))
            for label in order:
                rates[label].append(sides[label]()[0])
                if args.prefill_tokens:
                    prefill_rates[label].append(prefills[label]())
            report(f'round {index + 1} decode', {label: values[-1] for label, values in rates.items()})
            if args.prefill_tokens:
                report(f'round {index + 1} prefill {args.prefill_tokens}',
                       {label: values[-1] for label, values in prefill_rates.items()})
        for name, table in (('decode', rates), (f'prefill {args.prefill_tokens}', prefill_rates)):
            if any(table.values()):
                report(f'median {name}', {label: statistics.median(values) for label, values in table.items()})
    finally:
        for engine in engines.values():
            engine.close()


if __name__ == '__main__':
    main()
