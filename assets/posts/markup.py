"""Markdown as the posts are written in it (CommonMark and tables): fences, code spans, links and heading anchors
to read, tables and fenced blocks to write. Nothing here knows of this repository."""

from __future__ import annotations

import re

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")


def masked_code_spans(line: str) -> str:
    """The line with every `code span` blanked, so markers and links quoted as code are not taken for real ones."""
    return CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def fence_toggle(line: str, fence: str | None) -> str | None:
    """The fence still open after `line`: a ``` or ~~~ run opens one, the same character at least as long closes it."""
    match = FENCE.match(line)
    if not match:
        return fence
    run = match.group(1)
    if fence is None:
        return run
    if run[0] == fence[0] and len(run) >= len(fence) and not line.strip()[len(run):].strip():
        return None
    return fence


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_SOURCE = re.compile(r"<(?:img|a|source)\b[^>]*?\s(?:src|href)=[\"']([^\"']+)[\"']", re.I)


def heading_anchors(text: str) -> set[str]:
    """The anchors a git host (and the site's table of contents) gives a page's headings: lower case, punctuation
    dropped, spaces to hyphens, a repeated one suffixed -1, -2, ..."""
    anchors: set[str] = set()
    fence: str | None = None
    for line in text.splitlines():
        if fence is not None or FENCE.match(line):
            fence = fence_toggle(line, fence)
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link's text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        candidate, number = slug, 0
        while candidate in anchors:
            number += 1
            candidate = f"{slug}-{number}"
        anchors.add(candidate)
    return anchors


def cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: list[str], rows: list[list[str]], numeric: list[bool]) -> str:
    lines = ["| " + " | ".join(cell_text(h) for h in headers) + " |",
             "|" + "|".join("---:" if is_number else "---" for is_number in numeric) + "|"]
    lines += ["| " + " | ".join(cell_text(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fence(text: str, lang: str = "") -> str:
    """A fenced block longer than any backtick run inside it, so quoted markdown cannot close it early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    marks = "`" * max(3, longest + 1)
    return f"{marks}{lang}\n{text}\n{marks}"
