"""Pages: regenerate every region of blogs/ and devlog/, then lint them; with --check, every difference from what
the committed files give is a problem. The page's provenance region is generated last, from the runs its other
regions read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from make_plots import draw_series
from plotting.draw import pyplot

from . import generators  # noqa: F401  (registers every generator)
from .engine import RegionError, fill, find_regions, first_difference, generate, keep_values_in_their_paragraphs, \
    values_outside_paragraphs
from .generators.figure import check_figures, referenced_figures
from .lint import lint
from .site import Context, Site

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE_GLOBS = ("blogs/*.md", "devlog/*.md")  # devlog/data/*/sweep.md are a tool's output, not pages


@dataclass
class Page:
    path: str  # relative to the repository root
    text: str  # as it is on disk
    regenerated: str  # with every region that could be generated rewritten
    errors: list[str]
    figures: dict[str, int]  # figures the page shows (by a region or a link) -> the line


def render(site: Site, path: str, text: str, check: bool) -> Page:
    """Regenerate a page's regions; with `check`, every region that differs from its regeneration is an error.
    The provenance region comes last: it lists every run the page's other regions read."""
    regions, malformed = find_regions(text)
    errors = [f"{path}:{line}: {message}" for line, message in malformed]
    ctx = Context(site, path)
    contents: dict[int, str] = {}
    provenances = [index for index, region in enumerate(regions) if region.kind == "provenance"]
    site.recording = []
    failed = False  # a region of the page failed: its error says why; the provenance is left as it is
    try:
        for index in [i for i in range(len(regions)) if i not in provenances] + provenances:
            if index in provenances and site.recording is not None:
                ctx.page_runs, site.recording = list(site.recording), None
            region = regions[index]
            have = text[region.start:region.end]
            if index in provenances and failed:
                contents[index] = have
                continue
            ctx.line = region.line
            recorded = len(site.recording) if site.recording is not None else 0
            try:
                content = generate(ctx, region)
            except RegionError as error:
                errors.append(f"{path}:{region.line}: {region.describe()}: {error}")
                content = have  # left as it is; the error says why
                failed = True
                if site.recording is not None:
                    del site.recording[recorded:]  # a region that failed quotes nothing
            else:
                if check and content != have:
                    errors.append(f"{path}:{region.line}: {region.describe()} differs from what the committed files "
                                  f"give: {first_difference(have, content)}; run assets/make_posts.py --only {path}")
            contents[index] = content
        quoted = site.recording if site.recording is not None else ctx.page_runs
    finally:
        site.recording = None
    if len(provenances) > 1:
        errors.append(f"{path}:{regions[provenances[1]].line}: a second provenance region: a page has one, listing "
                      f"every run it quotes")
    if quoted and not provenances:
        errors.append(f"{path}:1: the page quotes {len(quoted)} run(s) and has no provenance region: add one "
                      f"(<!-- generated:provenance --> and <!-- /generated --> on their own lines), a collapsed block "
                      f"listing every run with its device, software and command")
    regenerated = fill(text, regions, [contents[index] for index in range(len(regions))])
    if not check:
        regenerated = keep_values_in_their_paragraphs(regenerated)
    figures = dict(ctx.figures)
    # Checking, the page as it is (what readers see); writing, the page as it is about to be.
    shown = text if check else regenerated
    shown_regions = find_regions(shown)[0]
    errors += lint(site, path, shown, shown_regions, figures)
    errors += [f"{path}:{line}: {message}" for line, message in values_outside_paragraphs(shown, shown_regions, check)]
    return Page(path, text, regenerated, errors, figures)


def pages(root: Path) -> list[str]:
    return [path.relative_to(root).as_posix() for pattern in PAGE_GLOBS for path in sorted(root.glob(pattern))]


def build(root: Path = REPO_ROOT, *, check: bool = False, only: str | None = None, figures: bool = True,
          print_fn=print) -> int:
    """Regenerate every page's regions and redraw the figures (`figures`), or with `check` compare the pages and
    the figures' CSVs with what the repository gives. Returns the number of problems."""
    root = root.resolve()
    site = Site(root, check_commits=check)
    names = pages(root)
    if only is not None:
        only_path = Path(only).resolve() if Path(only).is_absolute() else (Path.cwd() / only).resolve()
        if not only_path.exists() and (root / only).exists():
            only_path = (root / only).resolve()
        relative = only_path.relative_to(root).as_posix() if only_path.is_relative_to(root) else only
        if relative not in names:
            print_fn(f"--only {only}: not a page ({' or '.join(PAGE_GLOBS)} under {root})")
            return 1
        names = [relative]
    if figures and not check:
        wanted = None if only is None else referenced_figures((root / names[0]).read_text())
        try:
            pyplot()
        except ImportError:
            print_fn("drawing the figures needs matplotlib: uv run --group plots python assets/make_posts.py "
                     "(or --no-figures for the regions only)")
            return 1
        draw_series(root, wanted, print_fn=lambda line: print_fn(f"figure {line}"))
    errors: list[str] = []
    linked: dict[str, str] = {}
    regions = 0
    for name in names:
        text = (root / name).read_text()
        page = render(site, name, text, check)
        regions += len(find_regions(text)[0])
        errors += page.errors
        linked.update({figure: f"{name}:{line}" for figure, line in page.figures.items()})
        if not check and page.regenerated != text:
            (root / name).write_text(page.regenerated)
            print_fn(f"wrote {name}")
    if check:
        errors += check_figures(site, linked, print_fn)
    for error in errors:
        print_fn(error)
    verdict = f"{len(errors)} problem(s)" if errors else "all match the committed files"
    print_fn(f"make_posts{' --check' if check else ''}: {len(names)} page(s), {regions} region(s): {verdict}")
    return len(errors)
