"""`figure`: a figure of assets/make_plots.py's FIGURES and its CSV; and, for --check, every figure's CSV against
what its committed runs give."""

from __future__ import annotations

import re

from make_plots import FIGURES, PLOTS_DIR, figure_rows, figure_runs
from plotting.data import csv_text

from ..engine import RegionError, first_difference, generator
from ..site import Context, Site


@generator("figure", ("name",))
def gen_figure(ctx: Context, args: dict) -> str:
    name = args["name"]
    if name not in FIGURES:
        raise RegionError(f"figure: unknown figure '{name}'; assets/make_plots.py has {', '.join(FIGURES)}")
    figure = FIGURES[name]
    ctx.figures.setdefault(name, ctx.line)
    runs, missing = figure_runs(figure, ctx.site.root)
    if missing:
        raise RegionError(f"figure {name}: no run folder matches {', '.join(missing)}")
    for run in runs:
        ctx.site.run(ctx.site.relative(run.folder))  # the committed check
    png, csv_path = f"{PLOTS_DIR.as_posix()}/{name}.png", f"{PLOTS_DIR.as_posix()}/{name}.csv"
    source = "" if runs else ": a prediction of common/memory, not a measurement"
    return f"![{figure.title}]({ctx.link(png)})\n\n[The figure's data ({name}.csv)]({ctx.link(csv_path)}){source}."


def check_figures(site: Site, linked: dict[str, str], print_fn) -> list[str]:
    """Every figure a page shows, or whose CSV is in assets/plots: its runs committed, its CSV what they give.
    `linked`: figure name -> "page:line" where a page shows it."""
    errors = []
    for name, figure in FIGURES.items():
        csv_path = site.root / PLOTS_DIR / f"{name}.csv"
        where = linked.get(name)
        if where is None and not csv_path.exists():
            continue  # shown nowhere and never drawn: nothing to keep in step
        rows, why = figure_rows(figure, site.root)
        if rows is None:
            if where:
                errors.append(f"{where}: figure {name} cannot be made: {why}")
            else:
                print_fn(f"note: figure {name} not checked: {why}")
            continue
        try:
            for run in figure_runs(figure, site.root)[0]:
                site.run(site.relative(run.folder))
        except RegionError as error:
            errors.append(f"{where or PLOTS_DIR / (name + '.csv')}: figure {name}: {error}")
        if not csv_path.exists():
            errors.append(f"{where}: figure {name}: {PLOTS_DIR}/{name}.csv is missing: run assets/make_posts.py")
            continue
        try:
            site.require_tracked(f"{PLOTS_DIR.as_posix()}/{name}.csv")
        except RegionError as error:
            errors.append(f"{PLOTS_DIR}/{name}.csv: {error}")
        if csv_path.read_text() != csv_text(rows):
            source = ", ".join(figure.runs) or "common/memory"
            hint = first_difference(csv_path.read_text(), csv_text(rows), "the CSV")
            errors.append(f"{PLOTS_DIR}/{name}.csv: differs from what its runs give ({source}): {hint}; "
                          f"run assets/make_posts.py")
    return errors


def referenced_figures(text: str) -> list[str]:
    """Figures a page shows, found without generating it (to draw them before the page's links are checked)."""
    names = re.findall(r"generated:figure\s+name=[\"']?([\w-]+)", text)
    names += re.findall(rf"{re.escape(PLOTS_DIR.as_posix())}/([\w-]+)\.(?:png|csv)", text)
    return [name for name in dict.fromkeys(names) if name in FIGURES]
