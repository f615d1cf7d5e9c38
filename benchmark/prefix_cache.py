"""Time to first token of a second chat turn, with prefix caching on and off, in one run.

The first turn carries a long system prompt; the second turn resends the whole history, so with
prefix caching its prompt is mostly found in the cache.

    python benchmark/prefix_cache.py [--model PATH] [--system-tokens 1500]
"""
from __future__ import annotations

import argparse
import time

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


def second_turn_ttft(engine: Engine, first: list[int], second: list[int]) -> tuple[float, int]:
    """Runs the first turn to the end, then returns the second turn's TTFT and cached tokens."""
    gen = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    engine.add_request(first, gen)
    while engine.has_unfinished():
        engine.step()
    engine.add_request(second, gen)
    start = time.perf_counter()
    while True:
        outputs = engine.step()
        if outputs:
            ttft = time.perf_counter() - start
            break
    while engine.has_unfinished():
        engine.step()
    return ttft, outputs[0].num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None)
    parser.add_argument('--system-tokens', type=int, default=1500)
    args = parser.parse_args()
    results = {}
    for caching in (False, True):
        engine = Engine(args.model, PytorchEngineConfig(enable_prefix_caching=caching), show_progress=False)
        tok = engine.tokenizer
        system = ' '.join(['The quick brown fox jumps over the lazy dog.'] * (args.system_tokens // 10))
        turn1 = [{'role': 'system', 'content': system}, {'role': 'user', 'content': 'Summarize that.'}]
        first = tok.encode(tok.apply_chat_template(turn1), add_special_tokens=False)
        turn2 = turn1 + [{'role': 'assistant', 'content': 'A fox jumps over a dog.'},
                         {'role': 'user', 'content': 'And then?'}]
        second = tok.encode(tok.apply_chat_template(turn2), add_special_tokens=False)
        results[caching] = second_turn_ttft(engine, first, second)
        print(f'prefix caching {"on " if caching else "off"}: second-turn prompt {len(second)} tokens, '
              f'TTFT {results[caching][0] * 1e3:7.1f} ms, cached tokens {results[caching][1]}')
    print(f'TTFT ratio off/on: {results[False][0] / results[True][0]:.1f}x')


if __name__ == '__main__':
    main()
