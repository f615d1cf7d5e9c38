"""Grammar compile time and peak memory against the bounds a request sets: string ``maxLength`` / ``minLength``,
array ``maxItems`` / ``minItems``, counted repetitions in a schema's ``pattern`` and in a regex format.

Each case compiles with the engine's handling (``compile_format``: what a request gets) and with
xgrammar's own (``compile_json_schema`` / ``compile_regex`` on the untouched format), in a child process
that compiles each case's bounds in increasing order; a compile over ``--timeout`` seconds is killed, the
larger bounds of its case are not tried, and a new child goes on with the next case. Memory is the child's resident set growth during the compile,
sampled every 10 ms. xgrammar's cache is off, so every compile is a real one.

Further cases grow what the server's ``--max-grammar-size``, ``--max-grammar-repetition``, ``--max-grammar-optionals``
and its JSON nesting limit bound (enum values, properties, alternatives, nesting, character classes, optional
items); the table gives each format's measures next to its compile time.

    python benchmark/grammar_compile.py [--model PATH] [--timeout 20] [--cases enum,depth-array] [--modes engine]
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import time

WIDE = '[^\\x00-\\x1f"\\\\\\ud800-\\udfff]'  # any character a JSON string holds unescaped


def string_schema(key: str, bound: int) -> dict:
    return {'type': 'object', 'required': ['s'], 'properties': {'s': {'type': 'string', key: bound}}}


def array_schema(key: str, bound: int) -> dict:
    return {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 9}, key: bound}


def pattern_schema(char: str, bound: int) -> dict:
    return {'type': 'object', 'required': ['s'], 'properties': {'s': {'type': 'string',
                                                                      'pattern': f'^{char}{{0,{bound}}}$'}}}


def nested(kind: str, depth: int) -> dict:
    schema = {'type': 'string'}
    for _ in range(depth):
        schema = {'array': {'type': 'array', 'items': schema}, 'anyOf': {'anyOf': [schema, {'type': 'integer'}]},
                  'object': {'type': 'object', 'properties': {'a': schema, 'b': {'type': 'integer'}}}}[kind]
    return schema


def ebnf_rules(n: int) -> str:
    rules = [f'r{i} ::= "a{i}" | [0-9]+' for i in range(n)]
    return '\n'.join(['root ::= ' + ' '.join(f'r{i}' for i in range(n)), *rules])


BOUNDS = '10,100,1000,3000,10000,100000'
CASES = {  # name: (what the table calls it, N -> (format kind, schema, regex or grammar), its bounds if not BOUNDS)
    'maxLength': ('string maxLength N', lambda n: ('json_schema', string_schema('maxLength', n))),
    'minLength': ('string minLength N', lambda n: ('json_schema', string_schema('minLength', n))),
    'maxItems': ('array maxItems N', lambda n: ('json_schema', array_schema('maxItems', n))),
    'minItems': ('array minItems N', lambda n: ('json_schema', array_schema('minItems', n))),
    'pattern': ('pattern `^[a-z]{0,N}$`', lambda n: ('json_schema', pattern_schema('[a-z]', n))),
    'pattern-json': ('pattern `^[^\\x00-\\x1f"\\\\\\ud800-\\udfff]{0,N}$`',
                     lambda n: ('json_schema', pattern_schema(WIDE, n))),
    'regex': ('regex `[a-z]{0,N}`', lambda n: ('regex', f'[a-z]{{0,{n}}}')),
    'regex-nested': ('regex `(ab{0,10}){0,N}`', lambda n: ('regex', f'(ab{{0,10}}){{0,{n}}}')),
    # what the size, depth and regex limits of the server bound (see docs/api_server.md)
    'enum': ('enum of N values `valueI`', lambda n: ('json_schema', {'enum': [f'value{i}' for i in range(n)]}),
             '1000,10000,20000,40000'),
    'enum-long': ('enum of 100 values of N characters',
                  lambda n: ('json_schema', {'enum': [f'{i}' + 'x' * n for i in range(100)]}), '100,1000,2500,5000'),
    'choice': ('choice of N strings', lambda n: ('choice', [f'value{i}' for i in range(n)]), '1000,10000,20000'),
    'properties': ('N optional string properties', lambda n: ('json_schema', {'type': 'object', 'properties': {
        f'p{i}': {'type': 'string'} for i in range(n)}}), '100,1000,3000,6000'),
    'anyOf': ('anyOf of N objects', lambda n: ('json_schema', {'anyOf': [
        {'type': 'object', 'properties': {f'k{i}': {'type': 'integer'}}, 'required': [f'k{i}']} for i in range(n)]}),
        '100,1000,3000'),
    'regex-alt': ('regex of N words `wordI|...`', lambda n: ('regex', '|'.join(f'word{i}' for i in range(n))),
                  '1000,10000,20000,30000'),
    'grammar-rules': ('grammar of N rules `rI ::= "aI" | [0-9]+`', lambda n: ('grammar', ebnf_rules(n)),
                      '100,1000,3000,6000'),
    'depth-array': ('arrays nested N deep', lambda n: ('json_schema', nested('array', n)), '32,64,100,200,400'),
    'depth-anyOf': ('anyOf nested N deep', lambda n: ('json_schema', nested('anyOf', n)), '16,32,50,100,200'),
    'depth-object': ('objects nested N deep', lambda n: ('json_schema', nested('object', n)), '32,50,100,200,400'),
    'pattern-classes': ('pattern `[a-z]` N times', lambda n: ('json_schema', {'type': 'string',
                                                                                'pattern': '^' + '[a-z]' * n + '$'}),
                        '100,300,1000,3000'),
    'regex-classes': ('regex `[a-z]` N times', lambda n: ('regex', '[a-z]' * n), '100,1000,3000,10000'),
    'format-email': ('N properties of format email', lambda n: ('json_schema', {'type': 'object', 'properties': {
        f'p{i}': {'type': 'string', 'format': 'email'} for i in range(n)}}), '1,10,50,100'),
    'regex-optional': ('regex `.?` N times', lambda n: ('regex', '.?' * n), '8,16,24,32,40'),
    'pattern-optional': ('pattern `[a-z]?` N times', lambda n: ('json_schema', {'type': 'string',
                                                                                  'pattern': '^' + '[a-z]?' * n + '$'}),
                         '8,16,24,32'),
    'grammar-optional': ('grammar `[a-z]?` N times', lambda n: ('grammar', 'root ::= ' + '[a-z]? ' * n),
                         '8,16,24,32,40'),
}
MODES = ('engine', 'xgrammar')


def as_format(kind: str, value) -> dict:
    if kind == 'json_schema':
        return {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': value}}
    return {'type': kind, kind: value}


def child(model: str | None, mode: str, todo: list[tuple[str, int]]) -> None:
    """Compiles each (case, bound) of ``todo``, printing ``start`` before and the seconds after each compile."""
    import xgrammar as xgr

    from lmdeploy.model_source import resolve_model_path
    from lmdeploy.pytorch.engine.guided import compile_format
    from lmdeploy.tokenizer import Tokenizer
    tokenizer = Tokenizer(resolve_model_path(model))
    vocab = len(tokenizer.hf)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab,
                                              stop_token_ids=sorted(tokenizer.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiler.compile_regex('a')  # first-use work out of the first measurement
    print('vocab', vocab, flush=True)
    for case, bound in todo:
        fmt = as_format(*CASES[case][1](bound))
        print('start', flush=True)
        start = time.perf_counter()
        if mode == 'engine':
            compile_format(compiler, fmt)
        elif fmt['type'] == 'json_schema':
            compiler.compile_json_schema(json.dumps(fmt['json_schema']['schema']), any_whitespace=True,
                                         max_whitespace_cnt=16)
        elif fmt['type'] == 'regex':
            compiler.compile_regex(fmt['regex'])
        else:
            compile_format(compiler, fmt)
        print('done', time.perf_counter() - start, flush=True)


def rss_mib(pid: int) -> float:
    with open(f'/proc/{pid}/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2 ** 20


def measure(args: argparse.Namespace, mode: str, todo: list[tuple[str, int]]) -> tuple[int, dict]:
    """{(case, bound): (seconds, or None when killed; peak MiB growth)} in ``mode``. A child compiles them in
    order; one killed at the timeout skips the larger bounds of its case, and a new child goes on."""
    results, vocab = {}, 0
    while todo:
        cmd = [sys.executable, __file__, '--child', mode, '--todo', json.dumps(todo)]
        proc = subprocess.Popen(cmd + (['--model', args.model] if args.model else []), stdout=subprocess.PIPE)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        lines, buffer = [], b''
        base = peak = deadline = None
        while todo:
            if not lines and sel.select(0.01):
                data = os.read(proc.stdout.fileno(), 4096)
                if not data:
                    raise RuntimeError(f'the {mode} child died at {todo[0]}')
                *complete, buffer = (buffer + data).split(b'\n')
                lines += [line.decode().split() for line in complete]
            if lines:
                word, *rest = lines.pop(0)
                if word == 'vocab':
                    vocab = int(rest[0])
                elif word == 'start':
                    base = peak = rss_mib(proc.pid)
                    deadline = time.monotonic() + args.timeout
                elif word == 'done':
                    results[todo.pop(0)] = (float(rest[0]), max(peak, rss_mib(proc.pid)) - base)
                    deadline = None
            if deadline is not None:
                peak = max(peak, rss_mib(proc.pid))
                if time.monotonic() > deadline:
                    killed = todo.pop(0)
                    results[killed] = (None, peak - base)
                    todo = [t for t in todo if t[0] != killed[0]]
                    break
        proc.kill()
        proc.wait()
    return vocab, results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='its tokenizer is compiled for (default: the default model)')
    parser.add_argument('--timeout', type=float, default=20.0, help='seconds one compile may take before it is killed')
    parser.add_argument('--bounds', default=None,
                        help=f'comma-separated N of every case (default: its own, or {BOUNDS})')
    parser.add_argument('--modes', default=','.join(MODES), help='engine (what a request gets), xgrammar (its own '
                        'handling of schemas and regexes) or both')
    parser.add_argument('--cases', default=','.join(CASES), help=f'comma-separated, of {", ".join(CASES)}')
    parser.add_argument('--child', default=None, help=argparse.SUPPRESS)
    parser.add_argument('--todo', default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model, args.child, [tuple(t) for t in json.loads(args.todo)])
        return
    from lmdeploy.pytorch.engine.grammar_cost import format_cost, format_size, json_depth
    todo = [(case, int(bound)) for case in args.cases.split(',')
            for bound in (args.bounds or (CASES[case][2:] or [BOUNDS])[0]).split(',')]
    modes = args.modes.split(',')
    measured = {mode: measure(args, mode, list(todo)) for mode in modes}
    print(f'vocabulary: {measured[modes[0]][0]} tokens; seconds and peak MiB (resident set growth) of one compile; '
          'bytes, depth, repetition and optional items: what the server bounds')
    print('| case | bytes | depth | repetition | optionals | ' + ' | '.join(f'{m} s | {m} MiB' for m in modes) + ' |')
    print('| --- | ' + '---: | ' * (4 + 2 * len(modes)) + '')
    for case, bound in todo:
        fmt = as_format(*CASES[case][1](bound))
        cost = format_cost(fmt)
        depth = json_depth(fmt['json_schema']['schema']) if fmt['type'] == 'json_schema' else 0
        cells = [str(format_size(fmt)), str(depth), str(cost.repetition), str(cost.optionals)]
        for mode in modes:
            seconds, mib = measured[mode][1].get((case, bound), (False, 0.0))
            cells += (['not run', ''] if seconds is False else
                      [f'> {args.timeout:g} (killed)' if seconds is None else f'{seconds:.3f}', f'{mib:.0f}'])
        print('| ' + ' | '.join([CASES[case][0].replace('N', str(bound)), *cells]) + ' |')


if __name__ == '__main__':
    main()
