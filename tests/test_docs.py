"""The docs say what the code does: every CLI flag is documented with its default, every config field with its
default, and no documented flag, field, link, path, module or environment variable is stale or missing.

Fast and model-free: the parsers are built as ``lmdeploy`` builds them, nothing runs. Each test collects every
miss before it fails, so one run lists all there is to fix.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
from markdown_docs import (DOCS, HEADING, ROOT, anchors, code, default_in_row, prose, read, section, shows, slug,
                           table_rows)

from lmdeploy import prepare
from lmdeploy.cli.main import build_parser
from lmdeploy.messages import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, Response

# Where each command documents its flags, as (doc, heading anchor): the first of its sections that names a flag
# must give that flag's default (in the table row's second column, or as ``--flag VALUE``).
FLAG_HOMES = {
    'lmdeploy': [('README.md', 'command-line')],
    'lmdeploy chat': [('docs/api_server.md', 'lmdeploy-chat'), ('docs/api_server.md', 'starting-the-server')],
    'lmdeploy serve api_server': [('docs/api_server.md', 'starting-the-server')],
    'lmdeploy serve proxy': [('docs/scale_out.md', 'lmdeploy-serve-proxy')],
    'lmdeploy lite smooth_quant': [('docs/quantization.md', 'w8a8-lmdeploy-lite-smooth_quant')],
    'lmdeploy lite auto_awq': [('docs/quantization.md', 'awq-4-bit-lmdeploy-lite-auto_awq')],
}
# Where each public dataclass documents its fields (a table row per field gives the default).
FIELD_HOMES = {
    PytorchEngineConfig: ('docs/engine.md', 'configuration-pytorchengineconfig'),
    GenerationConfig: ('docs/serving.md', 'the-pipeline'),
    ChatTemplateConfig: ('docs/serving.md', 'the-pipeline'),
    Response: ('docs/serving.md', 'the-pipeline'),
}
# Flags of other tools that the docs give (pip's, hf's, `ray start`'s); every other flag is lmdeploy's or a
# benchmark's.
EXTERNAL_FLAGS = {'--help', '--extra-index-url', '--no-deps', '--target', '--local-dir', '--head', '--address',
                  '--port', '--node-ip-address', '--node-manager-port', '--object-manager-port', '--min-worker-port',
                  '--max-worker-port'}
# Environment variables read by the code (not by its tests) that a user may set, besides the LMDEPLOY_* ones.
THIRD_PARTY_ENV = ['TORCH_EXTENSIONS_DIR', 'CXX', 'RAY_ADDRESS']
@pytest.mark.parametrize('title, anchor', [
    ('## `lmdeploy chat`', 'lmdeploy-chat'), ('### gpt-oss (harmony)', 'gpt-oss-harmony'),
    ('## W8A8 (`lmdeploy lite smooth_quant`)', 'w8a8-lmdeploy-lite-smooth_quant'),
    ('## Structured output, tool calls and reasoning', 'structured-output-tool-calls-and-reasoning')])
def test_slug_follows_github(title, anchor):
    assert slug(HEADING.match(title).group(2)) == anchor


# ---- the command line ----

def commands(parser: argparse.ArgumentParser = None, name: str = 'lmdeploy'):
    """(command name, its parser) for ``lmdeploy`` and every subcommand."""
    parser = parser or build_parser()
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from commands(subparser, f'{name} {sub}')


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def flag_names(action: argparse.Action) -> list[str]:
    return [s for s in action.option_strings if s.startswith('--')]


def has_default(action: argparse.Action) -> bool:
    """Whether the flag takes a value and has a default to show (as ``lmdeploy --help`` decides)."""
    return action.nargs != 0 and action.default not in (None, (), [], argparse.SUPPRESS)


def mentions(text: str, flag: str) -> bool:
    return re.search(re.escape(flag) + r'(?![\w-])', text) is not None


def default_documented(text: str, action: argparse.Action) -> bool:
    for flag in flag_names(action):
        if any(default_in_row(row, flag, action.default) for row in table_rows(text)):
            return True
        for m in re.finditer(re.escape(flag) + r'[ =]([^\s\]`|,;)]+)', text):
            if shows(m.group(1), action.default):
                return True
    return False


def test_every_flag_is_documented_with_its_default():
    misses = []
    for name, parser in commands():
        homes = FLAG_HOMES.get(name)
        if homes is None:
            misses += [f'{name}: no doc section for its flags (add it to FLAG_HOMES)'] if options(parser) else []
            continue
        for action in options(parser):
            where = next((f'{doc}#{anchor}' for doc, anchor in homes
                          if any(mentions(section(doc, anchor), f) for f in flag_names(action))), None)
            if where is None:
                misses.append(f'{name} {"/".join(action.option_strings)} is in none of {homes}')
            elif has_default(action) and not default_documented(section(*where.split('#')), action):
                misses.append(f'{name} {action.option_strings[0]}: {where} does not give its default '
                              f'{action.default!r} (table row or `--flag VALUE`)')
    assert not misses, 'undocumented flags:\n' + '\n'.join(misses)


def command_lines(text: str):
    """The ``lmdeploy ...`` and ``python benchmark/X.py ...`` commands in the text's code, comments dropped."""
    joined = [line for block in re.split(r'\\\n', '\n'.join(code(text))) for line in block.splitlines()]
    for line in joined:
        for part in re.split(r'\s*(?:;|&&|\|\|?)\s*', line.split(' #')[0]):
            words = part.split()
            while words and re.match(r'^\w+=', words[0]):  # VAR=value before the command
                words = words[1:]
            if words:
                yield words


def script_has_flag(script: Path, flag: str) -> bool:
    """Whether a benchmark script, or a sibling module it imports, declares ``flag`` (``--no-x`` as ``--x``)."""
    text = script.read_text()
    for module in re.findall(r'^(?:from|import) (\w+)', text, re.M):
        if (script.parent / f'{module}.py').exists():
            text += (script.parent / f'{module}.py').read_text()
    return f"'{flag}'" in text or (flag.startswith('--no-') and f"'--{flag[5:]}'" in text)


def test_no_stale_flags():
    """Flags in documented commands (``lmdeploy ...``, ``python benchmark/X.py ...``) belong to that command, any
    other flag in the docs' code to some command or benchmark, and those in a command's flag table to it."""
    parsers = dict(commands())
    misses = []
    for doc in DOCS:
        for words in command_lines(read(doc)):
            flags = re.findall(r'(?<![\w-])(--[a-zA-Z][\w-]*)', ' '.join(words))
            if words[0] == 'lmdeploy':
                name = 'lmdeploy'
                for word in words[1:]:
                    if f'{name} {word}' not in parsers:
                        break
                    name = f'{name} {word}'
                known = {s for a in options(parsers[name]) for s in a.option_strings} | {'--help'}
                misses += [f'{doc}: `{" ".join(words)}`: {name} has no {f}' for f in flags if f not in known]
                rest = words[len(name.split()):]  # a lone word after it may be prose: `lmdeploy quantized` row
                if len(rest) > 1 and not rest[0].startswith('-') and any(
                        isinstance(a, argparse._SubParsersAction) for a in parsers[name]._actions):
                    misses.append(f'{doc}: `{" ".join(words)}`: {name} has no command {rest[0]}')
            elif words[:3] == ['python', '-m', 'lmdeploy.prepare']:
                known = {s for a in options(prepare.build_parser()) for s in a.option_strings} | {'--help'}
                misses += [f'{doc}: `{" ".join(words)}`: lmdeploy.prepare has no {f}' for f in flags if f not in known]
            elif len(words) > 1 and words[0].startswith('python') and (ROOT / words[1]).is_file():
                misses += [f'{doc}: `{" ".join(words)}`: {words[1]} has no {f}' for f in flags
                           if words[1].startswith('benchmark/') and not script_has_flag(ROOT / words[1], f)]
    every_parser = [parser for _, parser in commands()] + [prepare.build_parser()]
    known = {s for parser in every_parser for a in options(parser) for s in a.option_strings} | EXTERNAL_FLAGS | {
        f for script in (ROOT / 'benchmark').glob('*.py') for f in re.findall(r"'(--[\w-]+)'", script.read_text())}
    for doc in DOCS:
        misses += [f'{doc}: `{line}`: no command or benchmark has {f}' for line in code(read(doc))
                   for f in re.findall(r'(?<![\w-])(--[a-zA-Z][\w-]*)', line)
                   if f not in known and not (f.startswith('--no-') and f'--{f[5:]}' in known)]
    for name, homes in FLAG_HOMES.items():
        doc, anchor = homes[0]
        known = {s for a in options(parsers[name]) for s in a.option_strings}
        for row in table_rows(section(doc, anchor)):
            misses += [f'{doc}#{anchor}: {name} has no {f}' for f in re.findall(r'(--[\w-]+)', row[0])
                       if f not in known]
    assert not misses, 'stale flags:\n' + '\n'.join(misses)


# ---- config fields ----

def test_every_config_field_is_documented_with_its_default():
    misses = []
    for cls, (doc, anchor) in FIELD_HOMES.items():
        text = section(doc, anchor)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            rows = [row for row in table_rows(text) if f'`{f.name}`' in row[0]]
            if rows:
                if default not in (None, False) and not any(default_in_row(r, f.name, default) for r in rows):
                    misses.append(f'{cls.__name__}.{f.name}: its row in {doc}#{anchor} does not show {default!r}')
            elif f'`{f.name}`' not in text and f'{f.name}=' not in text:
                misses.append(f'{cls.__name__}.{f.name} is not named in {doc}#{anchor}')
    assert not misses, 'undocumented fields:\n' + '\n'.join(misses)


def test_no_stale_fields():
    """``Class(name=...)`` and ``Class.name`` in the docs' code name real fields (or methods)."""
    classes = {cls.__name__: cls for cls in FIELD_HOMES}
    misses = []
    for doc in DOCS:
        text = '\n'.join(code(read(doc)))
        for cls_name, cls in classes.items():
            names = {f.name for f in dataclasses.fields(cls)} | set(dir(cls))
            for call in re.finditer(re.escape(cls_name) + r'\(', text):
                depth, i = 1, call.end()
                while depth and i < len(text):
                    depth += {'(': 1, ')': -1}.get(text[i], 0)
                    i += 1
                args = re.sub(r'\([^()]*\)|\{[^{}]*\}|\[[^\[\]]*\]', '', text[call.end():i])
                misses += [f'{doc}: {cls_name}({k}=...)' for k in re.findall(r'(\w+)\s*=(?!=)', args)
                           if k not in names]
            misses += [f'{doc}: {cls_name}.{k}' for k in re.findall(re.escape(cls_name) + r'\.(\w+)', text)
                       if k not in names]
    assert not misses, 'stale fields:\n' + '\n'.join(sorted(set(misses)))


# ---- links, paths, modules, environment variables ----

LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')
ROOTED_PATH = re.compile(r'(?<![\w/.~-])((?:benchmark|tests|lmdeploy|docs|\.ci)/[\w./*-]*[\w*/])')
SOURCE_PATH = re.compile(r'(?<![\w/.~-])((?:\w+/)+[\w-]+\.(?:py|cpp|h|js|css|html))\b')
MODULE = re.compile(r'(?<![\w./-])(lmdeploy(?:\.\w+)+)')
FILE_SUFFIXES = {'lock', 'txt', 'json', 'gguf', 'log'}


def defines(source: Path, name: str) -> bool:
    return re.search(rf'\b{re.escape(name)}\b', source.read_text()) is not None


def test_links_resolve():
    """Relative links in README.md and docs/*.md point at files that exist and at headings they have."""
    misses = []
    for doc in DOCS:
        text = re.sub(r'`[^`\n]+`', '', prose(read(doc)))
        for target in LINK.findall(text):
            if re.match(r'^[a-z]+:', target):
                continue
            path, _, anchor = target.partition('#')
            resolved = (ROOT / doc).parent / path if path else ROOT / doc
            rel = resolved.resolve().relative_to(ROOT) if resolved.resolve().is_relative_to(ROOT) else resolved
            if not resolved.exists():
                misses.append(f'{doc}: ({target}): no file {rel}')
            elif anchor and anchor not in anchors(str(rel)):
                misses.append(f'{doc}: ({target}): {rel} has no heading with anchor #{anchor}')
    assert not misses, 'broken links:\n' + '\n'.join(misses)


# git-ignored folders that a script makes (``.ci/run``'s ``.ci/torchvision``): absent from a fresh clone
IGNORED_FOLDERS = {line.strip('/') for line in (ROOT / '.gitignore').read_text().split() if line.endswith('/')}


def rooted_path_exists(path: str) -> bool:
    """``benchmark/x.py``, ``tests/test_kernels_*.py``, ``lmdeploy/serve/``, or ``tests/helpers.make_engine``."""
    if '*' in path:
        return any(ROOT.glob(path))
    if (ROOT / path).exists() or path in IGNORED_FOLDERS:
        return True
    folder, _, name = path.rpartition('/')
    parts = name.split('.')
    return any((ROOT / folder / f'{".".join(parts[:i])}.py').exists()
               and defines(ROOT / folder / f'{".".join(parts[:i])}.py', parts[i]) for i in range(1, len(parts)))


def module_exists(dotted: str) -> bool:
    """``lmdeploy.a.b`` is a module or package, or ``lmdeploy.a.name`` a name its module defines."""
    parts = dotted.split('.')
    if parts[-1] in FILE_SUFFIXES:
        return True
    for i in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:i])
        source = path.with_suffix('.py') if path.with_suffix('.py').exists() else path / '__init__.py'
        if source.exists():
            return i == len(parts) or defines(source, parts[i])
    return False


def test_named_paths_and_modules_exist():
    """Every repository path (``benchmark/x.py``, ``tests/test_x.py``, ``lmdeploy/...``, ``nn/linear.py`` under
    lmdeploy/) and every ``lmdeploy.x.y`` module or name that the docs give exists."""
    package_dirs = {p.name for p in (ROOT / 'lmdeploy').rglob('*') if p.is_dir() and p.name != '__pycache__'}
    package_files = [str(p.relative_to(ROOT)) for p in (ROOT / 'lmdeploy').rglob('*') if p.is_file()]
    misses = []
    for doc in DOCS:
        text = read(doc)
        misses += [f'{doc}: {p}' for p in sorted(set(ROOTED_PATH.findall(text))) if not rooted_path_exists(p)]
        for path in sorted(set(SOURCE_PATH.findall(text))):
            first = path.split('/')[0]
            if first in package_dirs and first not in {'lmdeploy', 'tests', 'benchmark', 'docs'} and not any(
                    f.endswith('/' + path) for f in package_files):
                misses.append(f'{doc}: {path} (no such file under lmdeploy/)')
        misses += [f'{doc}: {m}' for m in sorted(set(MODULE.findall(text))) if not module_exists(m)]
    assert not misses, 'paths or modules named in the docs that do not exist:\n' + '\n'.join(misses)


def env_vars(files) -> set[str]:
    return {v for f in files for v in re.findall(r'\b(LMDEPLOY_[A-Z0-9_]+)\b', f.read_text())}


def test_environment_variables_are_documented():
    """Every LMDEPLOY_* variable that lmdeploy/ reads, and the other tools' ones it honours, is named in the docs;
    every LMDEPLOY_* variable the docs name is read somewhere (lmdeploy/, tests/ or benchmark/)."""
    docs = '\n'.join(read(doc) for doc in DOCS)
    misses = [f'{v} is read by lmdeploy/ but named in no doc'
              for v in sorted(env_vars((ROOT / 'lmdeploy').rglob('*.py')) | set(THIRD_PARTY_ENV))
              if not re.search(rf'\b{v}\b', docs)]
    in_code = env_vars([*(ROOT / 'lmdeploy').rglob('*.py'), *(ROOT / 'tests').glob('*.py'),
                        *(ROOT / 'benchmark').glob('*.py'), *(ROOT / 'benchmark').glob('*.sh')])
    misses += [f'the docs name {v}, which nothing reads'
               for v in sorted(set(re.findall(r'\bLMDEPLOY_[A-Z0-9_]+', docs))) if v not in in_code]
    assert not misses, 'environment variables:\n' + '\n'.join(misses)


# ---- the server's surface ----

ROUTE_HOMES = {'lmdeploy/serve/openai/api_server.py': ('docs/api_server.md', 'endpoints'),
               'lmdeploy/serve/proxy/app.py': ('docs/scale_out.md', 'lmdeploy-serve-proxy')}


def test_endpoints_metrics_and_parsers_are_documented():
    """Every route of the server and of the proxy is in its endpoint table, with its method; every metric, every
    tool or reasoning parser name and every request field is named in the docs; every metric the docs name
    exists."""
    from lmdeploy.serve.openai import protocol
    from lmdeploy.serve.openai.reasoning_parsers import REASONING_PARSERS
    from lmdeploy.serve.openai.tool_parsers import TOOL_PARSERS
    misses = []
    for source, (doc, anchor) in ROUTE_HOMES.items():
        endpoints = ' '.join(row[0] for row in table_rows(section(doc, anchor)))
        misses += [f'{source}: {method.upper()} {path} is not in {doc}#{anchor}'
                   for method, path in re.findall(r"@app\.(get|post)\('([^']+)'", (ROOT / source).read_text())
                   if not re.search(rf'{method.upper()} {re.escape(path)}(?![\w/])', endpoints)]
    metric = r'lmdeploy(?:_proxy)?:\w+'
    in_code = {m for f in (ROOT / 'lmdeploy').rglob('*.py') for m in re.findall(rf"'({metric})'", f.read_text())}
    in_docs = {m for doc in DOCS for m in re.findall(metric, read(doc))}
    misses += [f'metric {m} is named in no doc' for m in sorted(in_code - in_docs)]
    misses += [f'the docs name metric {m}, which nothing exports' for m in sorted(in_docs - in_code)]
    api_doc = read('docs/api_server.md')
    misses += [f'parser {name!r} is not named in docs/api_server.md'
               for name in sorted({*TOOL_PARSERS, *REASONING_PARSERS}) if f'`{name}`' not in api_doc]
    for model in (protocol.ChatCompletionRequest, protocol.CompletionRequest, protocol.GenerateRequest,
                  protocol.EncodeRequest, protocol.AbortRequest):
        misses += [f'request field {model.__name__}.{name} is not named in docs/api_server.md'
                   for name in model.model_fields if f'`{name}' not in api_doc and f'"{name}"' not in api_doc]
    assert not misses, 'server surface:\n' + '\n'.join(misses)


def test_every_architecture_is_in_the_models_table():
    from lmdeploy.archs import SUPPORTED_ARCHS
    listed = {name for row in table_rows(section('docs/engine.md', 'models-and-weights'))
              for name in re.findall(r'`(\w+For(?:CausalLM|ConditionalGeneration))`', row[0])}
    supported = set(SUPPORTED_ARCHS)
    assert listed == supported, (f'docs/engine.md#models-and-weights lacks {sorted(supported - listed)} '
                                 f'and lists unsupported {sorted(listed - supported)}')


def test_pipeline_api_is_documented():
    """Every argument of ``pipeline()`` and ``Pipeline`` is named (``name=``) where the pipeline is documented, and
    every public method as ``pipe.name`` in docs/serving.md; every ``pipe.name`` in the docs exists."""
    import inspect

    from lmdeploy import pipeline
    from lmdeploy.pipeline import Pipeline
    text = section('docs/serving.md', 'the-pipeline')
    names = {*inspect.signature(pipeline).parameters, *inspect.signature(Pipeline).parameters} - {'kwargs'}
    misses = [f'argument {n}=' for n in sorted(names) if f'{n}=' not in text]
    misses += [f'method pipe.{m}' for m in dir(Pipeline) if not m.startswith('_')
               and f'pipe.{m}' not in read('docs/serving.md')]
    attributes = set(dir(Pipeline)) | set(re.findall(r'self\.(\w+) *[:=]', (ROOT / 'lmdeploy/pipeline.py').read_text()))
    misses += [f'{doc} names pipe.{m}, which does not exist' for doc in DOCS
               for m in sorted(set(re.findall(r'\bpipe\.(\w+)', read(doc)))) if m not in attributes]
    assert not misses, 'docs/serving.md#the-pipeline and Pipeline disagree:\n' + '\n'.join(misses)
