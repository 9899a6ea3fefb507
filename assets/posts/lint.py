"""What --check holds a page to outside its regions: links and images that point to a file or a heading that exists
(and is committed), and no measured-looking number typed by hand into a table."""

from __future__ import annotations

import os
import re
from pathlib import Path

from make_plots import FIGURES, PLOTS_DIR

from .engine import Region, location
from .markup import FENCE, HTML_SOURCE, LINK, REFERENCE_LINK, fence_toggle, heading_anchors, masked_code_spans
from .site import Site

NOT_MEASURED = "<!-- not-measured -->"
CITED = "<!-- cited -->"  # a row quoting someone else's published measurement, labelled as such in its table
MEASURED_WITH_UNIT = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s?(?:ms|s|tok/s|tokens/s|GiB|MiB|GB|MB|%)(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?[x×](?!\w)")
MEASURED_HEADER = re.compile(r"(\bms\b|_ms\b|tok/s|tokens/s|tokens_per_s|throughput|loss|\bGiB\b|\bMiB\b|\bmem"
                             r"|memory|\bRSS\b|bubble|\bmfu\b|\bcomm|speed|\btime\b|peak)", re.I)
PLAIN_NUMBER = re.compile(r"^[+-]?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?$", re.I)
HAND_TYPED_FIX = (f"generate the table, or end the row with {NOT_MEASURED} if it is not a measurement, or with "
                  f"{CITED} if it quotes a published measurement of someone else's, labelled as such")
SEPARATOR_ROW = re.compile(r"^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?$")


def table_cells(row: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", row.strip())
    return [cell.strip() for cell in cells[1:-1 if row.strip().endswith("|") else None]]


def lint(site: Site, path: str, text: str, regions: list[Region], figures: dict[str, int]) -> list[str]:
    """Links to missing files, and measured-looking numbers typed into tables outside regions."""
    errors = []
    region_lines = set()
    masked = list(text)
    for region in regions:
        if region.inline:
            masked[region.outer_start:region.outer_end] = " " * (region.outer_end - region.outer_start)
        else:
            region_lines.update(range(region.line, location(text, region.end) + 1))
    masked_text = "".join(masked)
    page_folder = (site.root / path).parent
    fence: str | None = None
    header: list[str] | None = None
    for number, (line, visible) in enumerate(zip(text.splitlines(), masked_text.splitlines()), start=1):
        if fence is not None or FENCE.match(line):
            fence = fence_toggle(line, fence)
            header = None
            continue
        # Links, inside regions too: a generated link must point somewhere as well.
        without_code = masked_code_spans(line)
        targets = LINK.findall(without_code) + REFERENCE_LINK.findall(without_code) + HTML_SOURCE.findall(without_code)
        for target in targets:
            error = check_link(site, page_folder, text, target, figures, number)
            if error:
                errors.append(f"{path}:{number}: {error}")
        # Tables outside regions.
        stripped = visible.strip()
        if number in region_lines or not stripped.startswith("|"):
            header = None
            continue
        if header is None:
            header = table_cells(stripped)
            cells = header
        elif SEPARATOR_ROW.match(stripped):
            continue
        else:
            cells = table_cells(stripped)
        if stripped.endswith((NOT_MEASURED, CITED)):
            continue
        found = MEASURED_WITH_UNIT.search(stripped)
        if found:
            errors.append(f"{path}:{number}: measured-looking '{found.group(0)}' in a table row outside any region "
                          f"({HAND_TYPED_FIX})")
            continue
        if cells is not header:
            for title, cell in zip(header, cells):
                if MEASURED_HEADER.search(title) and PLAIN_NUMBER.match(cell.strip("*_ ")):
                    errors.append(f"{path}:{number}: hand-typed '{cell}' under '{title}' in a table outside any "
                                  f"region ({HAND_TYPED_FIX})")
                    break
    return errors


def check_link(site: Site, page_folder: Path, page_text: str, target: str, figures: dict[str, int],
               line: int) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
        return None  # a URL (https:, mailto:)
    from urllib.parse import unquote

    clean = unquote(target.split("#")[0].split("?")[0])
    anchor = unquote(target.split("#", 1)[1]) if "#" in target else ""
    if not clean:
        if anchor and anchor not in heading_anchors(page_text):
            return f"the link '{target}' names no heading of this page"
        return None
    resolved = (site.root / clean.lstrip("/")) if clean.startswith("/") else (page_folder / clean)
    resolved = Path(os.path.normpath(resolved))
    if not resolved.exists():
        return f"the link '{target}' points to a file that does not exist"
    if not resolved.is_relative_to(site.root):
        return f"the link '{target}' leaves the repository"
    relative = resolved.relative_to(site.root).as_posix()
    if site.tracked is not None and relative not in site.tracked and relative != ".":
        return f"the link '{target}' points to {relative}, which git does not track: commit it"
    if anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
        return f"the link '{target}' names no heading of {relative}"
    plots = PLOTS_DIR.as_posix() + "/"
    if relative.startswith(plots) and Path(relative).stem in FIGURES:
        figures.setdefault(Path(relative).stem, line)
    return None
