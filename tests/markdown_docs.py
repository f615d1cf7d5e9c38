"""Reading the project's Markdown docs as GitHub renders them, for the tests that hold the docs to the code:
sections by heading anchor, fenced and inline code, table rows and the defaults they show."""
from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ['README.md', *sorted(str(p.relative_to(ROOT)) for p in (ROOT / 'docs').glob('*.md'))]
FENCE = re.compile(r'^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$', re.S | re.M)
HEADING = re.compile(r'^(#{1,6})\s+(.*?)\s*#*\s*$', re.M)



@functools.cache
def read(doc: str) -> str:
    return (ROOT / doc).read_text(encoding='utf-8')


def prose(text: str) -> str:
    """The text with its fenced code blocks blanked (offsets kept)."""
    return FENCE.sub(lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text)


def slug(title: str) -> str:
    """GitHub's anchor of a heading: the rendered text, lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', title).replace('`', '').replace('*', '').lower()
    return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


@functools.cache
def anchors(doc: str) -> dict[str, tuple[int, int]]:
    """Each heading's anchor (GitHub numbers repeats: x, x-1, x-2) -> (its level, its offset in the text)."""
    found: dict[str, tuple[int, int]] = {}
    for m in HEADING.finditer(prose(read(doc))):
        base = slug(m.group(2))
        name, n = base, 0
        while name in found:
            n += 1
            name = f'{base}-{n}'
        found[name] = (len(m.group(1)), m.start())
    return found


def section(doc: str, anchor: str) -> str:
    """A heading's section: up to the next heading of the same or a higher level."""
    level, start = anchors(doc)[anchor]
    text = read(doc)
    end = next((m.start() for m in HEADING.finditer(prose(text), start + 1) if len(m.group(1)) <= level), len(text))
    return text[start:end]


def code(text: str) -> list[str]:
    """The lines of fenced and indented code blocks and the inline code spans of the text."""
    blocks = [line for m in FENCE.finditer(text) for line in m.group(0).splitlines()[1:-1]]
    indented = re.findall(r'(?<=\n\n)((?: {4}.*\n?)+)', prose(text))
    return blocks + [line[4:] for block in indented for line in block.splitlines()] + re.findall(
        r'`([^`\n]+)`', prose(text))


def table_rows(text: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip().strip('|').split('|')]
            for line in prose(text).splitlines() if line.lstrip().startswith('|')]
    return [row for row in rows if not all(re.fullmatch(r':?-*:?', c) for c in row)]


def shows(cell: str, value) -> bool:
    """Whether a table cell (or the text after a flag) shows ``value``."""
    tokens = {t.strip(".'\"") for t in re.findall(r"[\w.:'\"-]+", cell)}
    shown = {str(value)}
    if isinstance(value, float) and value.is_integer():
        shown.add(str(int(value)))
    if isinstance(value, int) and not isinstance(value, bool):
        shown.add(f'{value:,}')
    return bool(shown & tokens)


def default_in_row(row: list[str], name: str, value) -> bool:
    """The row names ``name`` in its first column and shows ``value`` in its second (the matching one of a list of
    names and values)."""
    names = [n.split()[0].split('=')[0] for n in re.findall(r'`([^`]+)`', row[0])]
    if len(row) < 2 or name not in names:
        return False
    values = re.split(r',\s+(?![^()]*\))', row[1])
    return shows(values[names.index(name)] if len(values) == len(names) else row[1], value)
