"""Accuracy of the quantized paths on the default model: perplexity on the held-out end of the shipped
public-domain text (``lmdeploy/lite/opticks.txt``, which calibration never reads) and greedy agreement
with the bf16 engine over 32 tokens, for bf16, KV int8, KV int4, W8A8, W8A8 + KV int8, and 4-bit weights
by AWQ and by plain round to nearest (RTN; the same layout and group size, no scale or clipping search).

    python benchmark/quant_accuracy.py          # makes the W8A8, AWQ and RTN copies with lmdeploy lite first
    python benchmark/quant_accuracy.py --w8a8 /path/to/w8a8_model --awq /path/to/awq --rtn /path/to/rtn

Perplexity: ``exp`` of the mean negative log-likelihood (``Pipeline.get_ppl``) over windows of
``--window`` tokens from the text's last ``--eval-tokens`` tokens. Agreement: 8 prompts of 64 tokens
from the same slice, greedy, 32 new tokens each; "prefix" is the share of tokens generated before a
prompt's first difference from bf16, "same" the share of positions that hold the same token. Every engine
runs in bf16 with ``decode_int4=False``, so the 4-bit small-step path does not blur the comparison. KV
cache quantization needs ``PytorchEngineConfig.quant_policy``; without it those rows are skipped, with a
note.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tempfile

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.lite import calibration_text
from lmdeploy.model_source import resolve_model_path

PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 64, 32
AWQ_GROUP_SIZE = 64  # the default model's 576 inputs do not split into AWQ's usual groups of 128


def evaluate(model: str, config: PytorchEngineConfig, windows: list[list[int]],
             prompts: list[str]) -> tuple[float, list[list[int]]]:
    """Perplexity over ``windows`` and the greedy tokens of ``prompts``."""
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, top_k=1, ignore_eos=True)
    with pipeline(model, backend_config=config) as pipe:
        nll = pipe.get_ppl(windows)
        tokens = [r.token_ids for r in pipe(prompts, gen_config=gen, do_preprocess=False)]
    return math.exp(sum(nll) / len(nll)), tokens


def agreement(expected: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(tokens before each prompt's first difference, positions with the same token), as shares."""
    total = sum(len(e) for e in expected)
    prefix = sum(next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), len(e)) for e, g in zip(expected, got))
    same = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g))
    return prefix / total, same / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='default: the bundled default model')
    parser.add_argument('--w8a8', default=None, help='its W8A8 copy (default: made now with lmdeploy lite)')
    parser.add_argument('--awq', default=None, help='its AWQ copy (default: made now with lmdeploy lite auto_awq)')
    parser.add_argument('--rtn', default=None,
                        help='its 4-bit round-to-nearest copy (auto_awq --no-search-scale --no-apply-clip)')
    parser.add_argument('--eval-tokens', type=int, default=2048)
    parser.add_argument('--window', type=int, default=1024)
    args = parser.parse_args()
    source = resolve_model_path(args.model)
    w8a8 = args.w8a8
    if w8a8 is None:
        from lmdeploy.lite.smooth_quant import smooth_quant
        w8a8 = os.path.join(tempfile.mkdtemp(prefix='w8a8_'), 'model')
        smooth_quant(source, w8a8)
    four_bit = {}
    for name, search in (('awq', True), ('rtn', False)):
        four_bit[name] = getattr(args, name) or os.path.join(tempfile.mkdtemp(prefix=f'{name}_'), 'model')
        if getattr(args, name) is None:
            from lmdeploy.lite.auto_awq import auto_awq
            auto_awq(source, four_bit[name], w_group_size=AWQ_GROUP_SIZE, search_scale=search, apply_clip=search)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(source)(calibration_text())['input_ids'][-args.eval_tokens:]
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - args.window + 1, args.window)]
    step = len(ids) // PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompts = [tokenizer.decode(ids[i * step:i * step + PROMPT_TOKENS]) for i in range(PROMPTS)]

    base = PytorchEngineConfig(dtype='bfloat16', decode_int4=False, session_len=args.window + 64,
                               cache_max_entry_count=0.2)
    has_kv_quant = any(field.name == 'quant_policy' for field in dataclasses.fields(PytorchEngineConfig))
    rows = [('bf16', source, {}), ('KV int8', source, {'quant_policy': 8}), ('KV int4', source, {'quant_policy': 4}),
            ('W8A8', w8a8, {}), ('W8A8 + KV int8', w8a8, {'quant_policy': 8})]
    rows += [('AWQ 4-bit', four_bit['awq'], {}), ('RTN 4-bit', four_bit['rtn'], {})]
    print(f'perplexity over {len(windows)} windows of {args.window} tokens; greedy agreement with bf16 over '
          f'{PROMPTS} prompts x {NEW_TOKENS} tokens')
    print(f'{"":16} {"ppl":>8} {"vs bf16":>8} {"prefix":>7} {"same":>7}')
    reference = None
    for name, model, extra in rows:
        if extra and not has_kv_quant:
            print(f'{name:16} skipped: PytorchEngineConfig has no quant_policy (KV cache quantization) yet')
            continue
        ppl, tokens = evaluate(model, dataclasses.replace(base, **extra), windows, prompts)
        if reference is None:
            reference = ppl, tokens
        prefix, same = agreement(reference[1], tokens)
        print(f'{name:16} {ppl:8.3f} {100 * (ppl / reference[0] - 1):+7.2f}% {prefix:7.1%} {same:7.1%}', flush=True)


if __name__ == '__main__':
    main()
