"""The region engine: generated regions in markdown pages, and the generators that fill them.

A region is `<!-- generated:KIND key=value ... -->`, its content, then `<!-- /generated -->`, on lines of its own (a
block) or inside one line of prose (inline). The engine finds the regions of a page, checks each one's arguments
against what its generator declared (`@generator`), calls the generator and puts its text back in the page. It knows
nothing of runs, posts or this repository: the generators do (posts/generators/). The manual: posts/README.md.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Callable

from .markup import FENCE, fence_toggle, masked_code_spans


class RegionError(Exception):
    """Why a region cannot be generated; the caller adds the file, line and region."""


# ---------------------------------------------------------------------------------------------------------------
# Finding regions

OPEN = re.compile(r"<!--\s*generated:([A-Za-z][\w-]*)(.*?)-->", re.S)
CLOSE = re.compile(r"<!--\s*/generated\s*-->")
UNFINISHED_OPEN = re.compile(r"<!--\s*generated:(?:(?!-->).)*$", re.S)  # an opening comment whose --> is further on


@dataclass
class Region:
    kind: str
    args: dict[str, str]
    opener: str  # the opening comment's text, for messages
    line: int  # 1-based line of the opening comment
    start: int  # offset of the content's first character
    end: int  # offset just past the content
    inline: bool
    indent: str = ""  # a block region inside a list item indents its content like its opener
    outer_start: int = 0  # offset of the opening comment (inline regions: masked with their content)
    outer_end: int = 0  # offset just past the closing comment

    def describe(self) -> str:
        text = " ".join(self.opener.split())
        return f"region '{text if len(text) <= 110 else text[:107] + '...'}'"


def parse_args_text(text: str) -> dict[str, str]:
    try:
        tokens = shlex.split(text)
    except ValueError as error:
        raise RegionError(f"cannot read the arguments ({error}): quote values like a shell") from None
    args: dict[str, str] = {}
    for token in tokens:
        key, equals, value = token.partition("=")
        if not equals or not key:
            raise RegionError(f"argument '{token}' is not key=value")
        if key in args:
            raise RegionError(f"argument '{key}' given twice")
        args[key] = value
    return args


def find_regions(text: str) -> tuple[list[Region], list[tuple[int, str]]]:
    """The regions of a page, and (line, message) for every malformed one (unclosed, nested, stray closer)."""
    regions, errors = [], []
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    fence: str | None = None
    open_block: Region | None = None
    index = 0
    while index < len(lines):
        line, number = lines[index], index + 1
        if open_block is not None:
            # Inside a block region: only a closer on its own line, outside any fence of the content, ends it.
            if fence is None and CLOSE.fullmatch(line.strip()):
                open_block.end = offsets[index]
                regions.append(open_block)
                open_block = None
            elif fence is None and OPEN.search(masked_code_spans(line)):
                errors.append((number, f"{open_block.describe()} (line {open_block.line}) is not closed before "
                                       f"another region opens here: regions do not nest"))
                open_block = None
            else:
                fence = fence_toggle(line, fence)
            index += 1
            continue
        if fence is not None or FENCE.match(line):
            fence = fence_toggle(line, fence)
            index += 1
            continue
        # An opening comment may go on over several lines (a long list of arguments): read up to its "-->".
        last, visible = index, masked_code_spans(line)
        while UNFINISHED_OPEN.search(visible) and last + 1 < len(lines):
            last += 1
            visible += masked_code_spans(lines[last])
        if UNFINISHED_OPEN.search(visible):
            errors.append((number, "an opening <!-- generated:... comment without its closing -->"))
            break
        base, position = offsets[index], 0
        while True:
            opener = OPEN.search(visible, position)
            closer = CLOSE.search(visible, position)
            if closer and (not opener or closer.start() < opener.start()):
                errors.append((number, "a closing <!-- /generated --> without an opening region"))
                position = closer.end()
                continue
            if not opener:
                break
            region = Region(opener.group(1), {}, opener.group(0), number, 0, 0, inline=False,
                            indent=line[:len(line) - len(line.lstrip())])
            try:
                region.args = parse_args_text(opener.group(2))
            except RegionError as error:
                errors.append((number, f"{region.describe()}: {error}"))
            closer = CLOSE.search(visible, opener.end())
            if closer:
                if OPEN.search(visible, opener.end(), closer.start()):
                    errors.append((number, f"{region.describe()}: another region opens inside it: regions do not nest"))
                region.inline = True
                region.start, region.end = base + opener.end(), base + closer.start()
                region.outer_start, region.outer_end = base + opener.start(), base + closer.end()
                regions.append(region)
                position = closer.end()
                continue
            if visible.strip() != opener.group(0).strip():
                errors.append((number, f"{region.describe()} is not closed: an inline region closes on the line its "
                                       f"opening comment ends on, a block region's opening comment stands alone"))
                break
            region.start = offsets[last + 1]
            open_block = region
            break
        index = last + 1
    if open_block is not None:
        errors.append((open_block.line, f"{open_block.describe()} is not closed: no <!-- /generated --> line after it"))
    return regions, errors


# ---------------------------------------------------------------------------------------------------------------
# Generators: `@generator(KIND, ...)` registers a function (context, arguments) -> markdown


@dataclass(frozen=True)
class Generator:
    function: Callable[..., str]  # (context, arguments) -> the region's markdown; raises RegionError
    required: tuple[str, ...]
    optional: tuple[str, ...]  # ("*",): any argument, which the generator checks itself
    inline: bool  # may stand inline in a line of prose


GENERATORS: dict[str, Generator] = {}


def generator(kind: str, required: tuple[str, ...] = (), optional: tuple[str, ...] = (), inline: bool = False):
    """Register the decorated function as the generator of `<!-- generated:KIND ... -->` regions."""
    def register(function: Callable[..., str]) -> Callable[..., str]:
        if kind in GENERATORS:
            raise ValueError(f"two generators of regions '{kind}'")
        GENERATORS[kind] = Generator(function, required, optional, inline)
        return function
    return register


def generate(ctx, region: Region) -> str:
    """The content of a region (without the markers); `ctx` is handed to its generator as it is."""
    if region.kind not in GENERATORS:
        raise RegionError(f"unknown generator '{region.kind}'; there are: {', '.join(GENERATORS)}")
    found = GENERATORS[region.kind]
    required, optional = found.required, found.optional
    missing = [key for key in required if key not in region.args]
    unknown = [key for key in region.args if key not in required + optional] if "*" not in optional else []
    if missing or unknown:
        raise RegionError(f"{region.kind} needs {', '.join(required) or 'no arguments'}"
                          + (f" and takes {', '.join(optional)}" if optional else "")
                          + (f"; missing: {', '.join(missing)}" if missing else "")
                          + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    if region.inline and not found.inline:
        raise RegionError(f"{region.kind} writes a block: put its opening and closing comments on their own lines")
    content = found.function(ctx, dict(region.args))
    if region.inline:
        if "\n" in content:
            raise RegionError(f"{region.kind} gave more than one line: make it a block region")
        return content
    body = "\n".join(region.indent + line if line else "" for line in content.split("\n"))
    return f"\n{body}\n\n"


def fill(text: str, regions: list[Region], contents: list[str]) -> str:
    """The page with each region's content replaced by the matching text of `contents`."""
    pieces, cursor = [], 0
    for region, content in zip(regions, contents):
        pieces += [text[cursor:region.start], content]
        cursor = region.end
    pieces.append(text[cursor:])
    return "".join(pieces)


def location(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def first_difference(have: str, want: str, what: str = "the region") -> str:
    """A one-line hint: the first line that differs, both versions cut around the first character that differs."""
    have_lines, want_lines = have.strip("\n").splitlines(), want.strip("\n").splitlines()
    for index in range(max(len(have_lines), len(want_lines))):
        mine = have_lines[index] if index < len(have_lines) else ""
        theirs = want_lines[index] if index < len(want_lines) else ""
        if mine != theirs:
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            start = max(0, at - 30)
            mine, theirs = (("..." if start else "") + line[start:start + 80] + ("..." if line[start + 80:] else "")
                            for line in (mine, theirs))
            return f"line {index + 1} of {what} reads {mine!r} where the files give {theirs!r}"
    return "only blank lines differ"


# ---------------------------------------------------------------------------------------------------------------
# Inline values inside their sentence. A line that starts with "<!--" opens an HTML block in CommonMark, which ends
# the paragraph: a value written at the start of a line would be rendered outside its sentence.


def keep_values_in_their_paragraphs(text: str) -> str:
    """Join every line that starts with an inline region to the line before it, when that line is prose (not blank,
    not a fence, heading, table row, quote, list marker alone or HTML): the value then never starts a line."""
    lines = text.split("\n")
    for _ in range(len(lines)):
        starts = {region.line - 1 for region in find_regions("\n".join(lines))[0] if region.inline
                  and lines[region.line - 1].lstrip().startswith("<!--")}
        index = next((i for i in sorted(starts) if i > 0 and is_prose(lines[i - 1])), None)
        if index is None:
            return "\n".join(lines)
        lines[index - 1:index + 1] = [lines[index - 1].rstrip() + " " + lines[index].lstrip()]
    return "\n".join(lines)


def is_prose(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not FENCE.match(line) and not re.match(r"(#|\||>|<|[-*+]$|\d+[.)]$)", stripped)


def values_outside_paragraphs(text: str, regions: list[Region], required: bool = True) -> list[tuple[int, str]]:
    """(line, message) for every inline region that a CommonMark parser (markdown-it-py) puts in an HTML block or
    a code block instead of the paragraph, heading or table cell around it. Without markdown-it-py: an error if
    `required` (the check), else nothing (writing a page on a machine without it)."""
    inline = [region for region in regions if region.inline]
    if not inline:
        return []
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        return [(1, "checking that generated values render inside their paragraphs needs markdown-it-py (the dev "
                    "dependency group: uv sync)")] if required else []
    outside: dict[int, str] = {}
    for token in MarkdownIt("commonmark").enable("table").parse(text):
        if token.type in ("html_block", "code_block") and token.map:
            outside.update(dict.fromkeys(range(*token.map), token.type.replace("_", " ")))
    return [(region.line, f"{region.describe()}: CommonMark renders this value as an {outside[region.line - 1]}, "
                          f"outside its sentence, because its line starts with '<!--' (which ends a paragraph): put "
                          f"a word before it on that line (writing the page joins such a line to the one before)")
            for region in inline if region.line - 1 in outside]
