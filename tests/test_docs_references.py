"""The names that README.md and docs/*.md cite exist: tests (files, functions, ``file::function``), benchmark
scripts and the flags they are cited with, classes' members (``Scheduler._room_to_catch_up``), class names,
private names, functions cited as called, ``file.py``'s names, file names and the config tables' fields.

tests/test_docs.py holds the rest to the code (lmdeploy's CLI flags against its built parser, config fields in
code, module paths, links, ``LMDEPLOY_*`` variables). The sources are read as text, no model is loaded: each kind is
a function of a doc's text, run on every doc and on made-up references that it must catch.
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from markdown_docs import DOCS, HEADING, ROOT, code, prose, read, section, table_rows
from test_docs import FIELD_HOMES, command_lines, script_has_flag

from lmdeploy.messages import PytorchEngineConfig

# Names of other projects that the docs cite: llama.cpp's, xgrammar's, triton's and torch's files and names,
# the compilers' intrinsics, classes of PIL, transformers, InternVL, AutoGPTQ, xgrammar, triton and
# multiprocessing, a user's class in an example, pydantic's members and libc's functions.
EXTERNAL_FILES = {'convert_hf_to_gguf.py', 'convert_image_encoder_to_gguf.py', 'matcher.py', 'testing.py',
                  'tokenizer_info.py', 'llama.cpp'}
EXTERNAL_PRIVATE = re.compile(r'_mm512_\w+|_patch_lang')
EXTERNAL_CLASSES = {'PIL', 'Image', 'Process', 'JITFunction', 'CLIPVisionModel', 'CompiledGrammar', 'QuantLinear',
                    'TokenizersBackend', 'InternVLChatModel', 'OutOfResources', 'MyToolParser'}
EXTERNAL_MEMBERS = {'model_json_schema'}
EXTERNAL_FUNCTIONS = {'madvise'}
# Names the docs record as removed, cited by the dated sections from before (docs/batch_invariance.md: "The four
# `...Kernel` classes are gone").
GONE = {'Q4KKernel', 'Q5KKernel', 'Q6KKernel', 'NativeQ8Kernel'}
FILE_SUFFIXES = {'py', 'cpp', 'h', 'sh', 'js', 'css', 'html', 'md', 'txt', 'json', 'gguf', 'safetensors'}


@functools.cache
def sources() -> dict[str, str]:
    """The project's code by path: the package's Python, C++ and page sources, the benchmarks and the tests."""
    patterns = ['lmdeploy/**/*.py', 'lmdeploy/**/*.cpp', 'lmdeploy/**/*.h', 'lmdeploy/**/*.js', 'benchmark/*.py',
                'benchmark/*.sh', 'tests/*.py', '.ci/*']
    return {str(p.relative_to(ROOT)): p.read_text() for pattern in patterns for p in ROOT.glob(pattern) if p.is_file()}


@functools.cache
def words() -> frozenset[str]:
    """The sources' words, but this file's, whose made-up names would count."""
    return frozenset(w for path, text in sources().items() if ROOT / path != Path(__file__)
                     for w in re.findall(r'\w+', text))


def mentions(text: str, name: str) -> bool:
    return re.search(rf'(?<![\w-]){re.escape(name)}(?![\w-])', text) is not None


# ---- tests ----

TEST_REF = re.compile(r'(?<![\w.{},*/-])((?:tests/)?test_(?:[\w*]|\{[\w,]+\})*(?:\.py)?)'
                      r'(?:::(\w+))?(?:\[([^\]\s`]+)\])?')  # test_x.py::test_y[parameters]
SELECTION = re.compile(r'(test_\w+)\.py[^`\n]*?\s-k\s+("[^"]+"|\S+)')  # tests/test_x.py -k "a or b"


def expand_braces(name: str) -> list[str]:
    """``test_gguf_{q4km,mixed}.py`` -> ``test_gguf_q4km.py``, ``test_gguf_mixed.py``."""
    m = re.search(r'\{([^{}]*)\}', name)
    if not m:
        return [name]
    return [x for part in m.group(1).split(',') for x in expand_braces(name[:m.start()] + part + name[m.end():])]


@functools.cache
def defined_tests() -> dict[str, set[str]]:
    """Each test file's stem -> the test functions and classes it defines."""
    return {Path(path).stem: set(re.findall(r'^\s*(?:async\s+)?(?:def|class) (\w+)', text, re.M))
            for path, text in sources().items() if re.fullmatch(r'tests/test_\w+\.py', path)}


def any_matches(pattern: str, names: Iterable[str]) -> bool:
    return any(re.fullmatch(re.escape(pattern).replace(r'\*', r'\w*'), n) for n in names)


def text_of_tests_file(stem: str) -> str:
    return sources().get(f'tests/{stem}.py', '')


def stale_tests(text: str) -> tuple[int, list[str]]:
    """``test_x.py`` is a test file, ``test_x`` a test file or a test function in one, ``test_x.py::test_y`` a
    test function of that file (globs and braces as a shell reads them); a parameter id's words (``[mixtral]``) are
    in the test's file or conftest.py, a ``-k`` selection's in the file."""
    files = defined_tests()
    functions = set().union(*files.values())
    checked, misses = 0, []
    for m in TEST_REF.finditer(text):
        for name in expand_braces(m.group(1).removeprefix('tests/')):
            checked += 1
            stem = name.removesuffix('.py')
            if not any_matches(stem, files) and (name.endswith('.py') or not any_matches(stem, functions)):
                misses.append(f'{m.group(0)}: no test file or test function {name}')
            elif m.group(2) and m.group(2) not in files.get(stem, ()):
                misses.append(f'{m.group(0)}: tests/{stem}.py has no {m.group(2)}')
            elif m.group(3):
                test = m.group(2) or stem
                where = '\n'.join([text_of_tests_file('conftest'),
                                    *(text_of_tests_file(f) for f, names in files.items() if test in names)])
                misses += [f'{m.group(0)}: no parameter {word} in its file or conftest.py'
                           for word in re.findall(r'[A-Za-z_]\w*', m.group(3)) if not mentions(where, word)]
    for m in SELECTION.finditer(text):
        checked += 1
        source = text_of_tests_file(m.group(1)).lower()
        misses += [f'{m.group(0)}: no {word} in tests/{m.group(1)}.py' for word in re.findall(r'\w+', m.group(2))
                   if word not in ('and', 'or', 'not') and word.lower() not in source]
    return checked, misses


# ---- benchmark scripts and their flags ----

def stale_benchmark_flags(text: str) -> tuple[int, list[str]]:
    """In the docs' commands, a benchmark script (``benchmark/x.py`` or ``x.py``) exists and has the flags that
    follow it."""
    checked, misses = 0, []
    for words_ in command_lines(text):
        for i, word in enumerate(words_):
            script = word if word.startswith('benchmark/') else f'benchmark/{word}'
            if not re.fullmatch(r'[\w/]+\.(?:py|sh)', word) or (script != word and not (ROOT / script).is_file()):
                continue  # not a benchmark script's name
            checked += 1
            if not (ROOT / script).is_file():
                misses.append(f'`{" ".join(words_)}`: no {script}')
                continue
            for flag in re.findall(r'(?<![\w-])(--[a-zA-Z][\w-]*)', ' '.join(words_[i + 1:])):
                checked += 1
                if not script_has_flag(ROOT / script, flag):
                    misses.append(f'`{" ".join(words_)}`: {script} has no {flag}')
    return checked, misses


# ---- classes' members, private names, names of a file, file names ----

@functools.cache
def class_bodies() -> dict[str, list[tuple[str, list[str]]]]:
    """Each class or C++ struct name -> (its body's text, its bases) for every definition of it."""
    bodies: dict[str, list[tuple[str, list[str]]]] = {}
    for path, text in sources().items():
        if path.endswith('.py'):
            for m in re.finditer(r'^([ \t]*)class (\w+)(?:\(([^)]*)\))?:', text, re.M):
                body = re.match(rf'.*\n(?:(?:{m.group(1)}[ \t]+.*|[ \t]*)\n)*', text[m.start():]).group(0)
                bases = re.findall(r'(\w+)(?:\[[^\]]*\])?\s*(?:,|$)', m.group(3) or '')
                bodies.setdefault(m.group(2), []).append((body, bases))
        elif path.endswith(('.cpp', '.h')):
            for m in re.finditer(r'\b(?:struct|class) (\w+)\s*(?::[^{;]*)?\{', text):
                bodies.setdefault(m.group(1), []).append((text, []))
    return bodies


def has_member(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    return cls not in seen and any(mentions(body, member) or any(has_member(b, member, seen | {cls}) for b in bases)
                                   for body, bases in class_bodies().get(cls, []))


def stale_members(text: str) -> tuple[int, list[str]]:
    """``Class.member`` (or ``Class``'s ``member``): a class (or C++ struct) of the project's that has the member,
    its own or a base's."""
    dotted = r'(?<![\w./-])([A-Z]\w*[a-z]\w*)\.(\w+)(?=\(|\[|$)'  # the span ends with the member (or its call)
    cited = [pair for span in code(text) for pair in re.findall(dotted, span)]
    cited += re.findall(r"`([A-Z]\w*[a-z]\w*)`'s\s+`(\w+)`", prose(text))
    checked, misses = 0, []
    for cls, member in cited:
        if cls in EXTERNAL_CLASSES or member in EXTERNAL_MEMBERS | FILE_SUFFIXES:
            continue
        checked += 1
        if cls not in class_bodies():
            misses.append(f'{cls}.{member}: no class {cls} (or add it to EXTERNAL_CLASSES)')
        elif not has_member(cls, member):
            misses.append(f'{cls}.{member}: {cls} has no {member}')
    return checked, misses


def stale_private_names(text: str) -> tuple[int, list[str]]:
    """``_name`` (not a glob's ``*_name``) is a name in the project's code."""
    names = [n for span in code(text) for n in re.findall(r'(?<![\w.*])(_[a-z]\w*)', span)
             if not EXTERNAL_PRIVATE.fullmatch(n)]
    return len(names), [f'{n}: in no source' for n in names if n not in words()]


def stale_class_names(text: str) -> tuple[int, list[str]]:
    """A CamelCase name (``Q4KGemv``, ``NativeBlocks``) is a name in the project's code."""
    camel_case = r'(?<![\w.$/-])([A-Z][a-z0-9]+[A-Z][A-Za-z0-9]*)\b'
    names = [n for span in code(text) for n in re.findall(camel_case, span) if n not in EXTERNAL_CLASSES | GONE]
    return len(names), [f'{n}: in no source' for n in names if n not in words()]


def stale_function_calls(text: str) -> tuple[int, list[str]]:
    """A function cited as called (``layer_kernel()``, ``gemv_max_rows('q4k')``) is a name in the project's code."""
    names = [n for span in code(text) for n in re.findall(r'(?<![\w.$/*-])([a-z_]\w*)\(', span)
             if not hasattr(builtins, n) and n not in EXTERNAL_FUNCTIONS | GONE]
    return len(names), [f'{n}(): in no source' for n in names if n not in words()]


SOURCE_FILE = r'[\w/.-]+\.(?:py|cpp|h|sh)'
NAME_OF_FILE = [re.compile(rf"`(?P<file>{SOURCE_FILE})`'s\s+`(?P<name>-{{0,2}}\w+)"),  # `file.py`'s `name`
                re.compile(rf"`(?P<name>-{{0,2}}\w+)(?:\(\))?`\s+(?:in|of|from)\s+`(?P<file>{SOURCE_FILE})`"),
                re.compile(rf'`(?P<file>{SOURCE_FILE}): (?P<name>\w+)')]  # `file.py: name`


def files_named(path: str) -> list[str]:
    """The sources whose path is ``path`` or ends with it (``nn/linear.py``)."""
    return [p for p in sources() if p == path or p.endswith('/' + path)]


def names_cited_with_their_file(text: str) -> list[tuple[str, str, str]]:
    """(the citation, the file, the name) for ``file.py``'s ``name``, ``name`` in ``file.py``, ``file.py: name``
    and a test or benchmark module's ``helpers.make_engine``."""
    cited = [(m.group(0), m['file'], m['name']) for pattern in NAME_OF_FILE for m in pattern.finditer(prose(text))]
    modules = {Path(p).stem: p for p in sources() if re.fullmatch(r'(tests|benchmark)/\w+\.py', p)}
    return cited + [(f'{module}.{name}', modules[module], name) for span in code(text)
                    for module, name in re.findall(r'(?<![\w./-])(\w+)\.([a-z_]\w*)', span)
                    if module in modules and name not in FILE_SUFFIXES]


def stale_names_of_files(text: str) -> tuple[int, list[str]]:
    """A name cited as a file's is in that file."""
    cited = names_cited_with_their_file(text)
    misses = []
    for citation, path, name in cited:
        found = files_named(path)
        if not found:
            misses.append(f'{citation}: no file {path}')
        elif not any(mentions(sources()[p], name) for p in found):
            misses.append(f'{citation}: {name} is not in {", ".join(found)}')
    return len(cited), misses


@functools.cache
def repository_file_names() -> frozenset[str]:
    return frozenset(p.name for p in ROOT.rglob('*') if '.git' not in p.parts)


def stale_file_names(text: str) -> tuple[int, list[str]]:
    """A bare file name (``triton_aot.py``, ``kquant_gemv.h``) is a file of the repository's."""
    names = [n for span in code(text) for n in re.findall(r'(?<![\w/.-])([\w-]+\.(?:py|cpp|h|sh|js|css|html))\b',
                                                           span) if n not in EXTERNAL_FILES]
    return len(names), [f'{n}: no such file' for n in names if n not in repository_file_names()]


# ---- sections cited by title ----

@functools.cache
def titles() -> frozenset[str]:
    """The docs' headings and the bold or italic leads and first words of their paragraphs, markup dropped."""
    found = set()
    for doc in DOCS:
        text = prose(read(doc))
        found |= {m.group(2) for m in HEADING.finditer(text)}
        found |= set(re.findall(r'(?:^|\n)[ \t]*(?:- )?\*{1,2}([^*\n]+)\*', text))
        found |= set(re.findall(r'\n\n([A-Z][^\n]*)', text))
    return frozenset(re.sub(r'[`*]', '', t).strip() for t in found)


def stale_section_titles(text: str) -> tuple[int, list[str]]:
    """A section cited by its title (see "Native CPU kernels", "Cost" below) begins with it."""
    quoted = r'"[A-Z][^"]{2,150}?"'
    cited = [' '.join(q.strip('"').split()).rstrip('.,') for m in re.finditer(
        rf'\bsee ((?:{quoted}(?:,? and |, | or )?)+)|({quoted}) (?:below|above)', prose(text))
        for q in re.findall(quoted, m.group(0))]
    return len(cited), [f'"{q}": no heading or paragraph begins so' for q in cited
                        if not any(t.startswith(q) for t in titles())]


# ---- the config tables ----

def stale_config_rows(table: str, classes: list[type]) -> tuple[int, list[str]]:
    """Each name in the first column of a config table is a field of one of the classes it documents."""
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    names = [name for row in table_rows(table) for name in re.findall(r'`(\w+)', row[0])]
    return len(names), [f'`{n}` is no field of {", ".join(c.__name__ for c in classes)}' for n in names
                        if n not in known]


KINDS: dict[str, Callable[[str], tuple[int, list[str]]]] = {
    'tests': stale_tests, 'benchmark flags': stale_benchmark_flags, 'class members': stale_members,
    'private names': stale_private_names, 'class names': stale_class_names, 'functions called': stale_function_calls,
    'names of a file': stale_names_of_files, 'file names': stale_file_names, 'section titles': stale_section_titles}


@pytest.mark.parametrize('kind', KINDS)
def test_docs_cite_names_that_exist(kind):
    misses = [f'{doc}: {miss}' for doc in DOCS for miss in KINDS[kind](read(doc))[1]]
    assert not misses, f'stale {kind}:\n' + '\n'.join(misses)


def test_config_tables_name_fields_that_exist():
    homes = {home: [cls for cls, h in FIELD_HOMES.items() if h == home] for home in FIELD_HOMES.values()}
    misses = [f'{doc}#{anchor}: {miss}' for (doc, anchor), classes in homes.items()
              for miss in stale_config_rows(section(doc, anchor), classes)[1]]
    assert not misses, 'stale config table rows:\n' + '\n'.join(misses)


MADE_UP = {
    'tests': ['`tests/test_no_such_file.py`', '`test_no_such_function`', '`test_gguf_{q4km,no_such}.py`',
              '`test_cli.py::test_no_such_function`', '`test_greedy_matches_transformers[no_such_model]`',
              '`tests/test_kernels_mla.py -k "Triton or no_such_test"`'],
    'benchmark flags': ['`python benchmark/startup.py --no-such-flag`', '`benchmark/no_such_script.py`',
                        '`triton_aot.py --no-such-flag`'],
    'class members': ['`Scheduler._no_such_member`', '`NoSuchClass.member`', '`StepTensors.no_such_field`',
                      "`Scheduler`'s `no_such_member`"],
    'private names': ['`_no_such_private_name`'],
    'class names': ['`NoSuchClassName`'],
    'functions called': ['`no_such_function(x)`'],
    'names of a file': ["`weights/gguf.py`'s `_no_such_name`", '`no_such_name` in `nn/linear.py`',
                        '`nn/rotary.py: no_such_name`', "`no_such_dir/x.py`'s `name`",
                        '`helpers.no_such_helper`'],
    'file names': ['`no_such_file.py`'],
    'section titles': ['(see "No such\nsection")', '"Cost of nothing" below'],
}


@pytest.mark.parametrize('kind, made_up', [(k, text) for k, texts in MADE_UP.items() for text in texts])
def test_a_made_up_reference_is_caught(kind, made_up):
    checked, misses = KINDS[kind](f'A sentence that cites {made_up}.\n')
    assert checked and misses, f'{kind}: {made_up} was not caught'


def test_a_made_up_config_row_is_caught():
    table = '| field | default |\n| --- | --- |\n| `dtype` | auto |\n| `no_such_field` | 1 |\n'
    checked, misses = stale_config_rows(table, [PytorchEngineConfig])
    assert (checked, misses) == (2, ['`no_such_field` is no field of PytorchEngineConfig'])
