"""Where the numbers come from: `provenance` (the page's collapsed block of every run it quotes), `commands`
(the runs' exact commands) and `hardware` (one line: device, world sizes, software, commit)."""

from __future__ import annotations

from run_files import Run

from ..engine import RegionError, generator
from ..markup import fence
from ..site import Context
from .runs import device_text, distinct, software_text, world_sizes_text


def commands_block(runs: list[Run]) -> str:
    return fence("\n".join(run.summary.get("command") or f"# {run.name}: no command recorded" for run in runs),
                 "bash")


def commit_text(run: Run) -> str | None:
    """The commit a run recorded; a dirty one with the hash of its diff (`commit_diff`), or says the run predates it."""
    commit = run.summary.get("commit")
    if not commit or not commit.endswith("-dirty"):
        return commit
    diff = run.summary.get("commit_diff")
    return f"{commit} (diff {diff})" if diff else f"{commit} (diff not recorded)"


def commits_text(runs: list[Run]) -> str:
    return f"commit {', '.join(distinct(commit_text(run) for run in runs)) or 'not recorded'}"


DIRTY_NOTE = ("A commit marked `-dirty` ran with uncommitted changes. Runs record a hash of them (summary.json's "
              "`commit_diff`: `git diff HEAD` and the untracked files' names), which tells two such trees apart but "
              "cannot rebuild one; runs from before it say \"diff not recorded\". assets/run_series.py runs a series "
              "from a clean checkout only, so that the commit alone reproduces it.")


def series_caption(runs: list[Run]) -> str:
    """Where one series' runs were measured: device, world sizes, software, commit, memory measure, warm-up."""
    measures = distinct(run.summary.get("memory_measure") for run in runs)
    warmups = distinct(run.summary.get("warmup_steps_excluded") for run in runs)
    details = [device_text(runs), world_sizes_text(runs), software_text(runs), commits_text(runs)]
    if measures:
        details.append(f"memory: {'; '.join(measures)}")
    if warmups:
        profiled = any(run.summary.get("profiled_steps") for run in runs)
        details.append(f"averages leave out the first {' or '.join(map(str, warmups))} steps"
                       + (" and the steps run under the profiler (comm ms comes from those)" if profiled else ""))
    return "; ".join(part for part in details if part)


def provenance(ctx: Context, runs: list[Run]) -> str:
    """One collapsed block: every run a page quotes, by series (linked), where each series was measured, and every
    run's exact command."""
    by_series: dict[str, list[Run]] = {}
    for run in sorted(runs, key=lambda run: run.folder):
        by_series.setdefault(ctx.site.relative(run.folder.parent) + "/", []).append(run)
    items, commands = [], []
    for series, members in by_series.items():
        items.append(f"- [`{series}`]({ctx.link(series)}): {', '.join(run.name for run in members)}. "
                     f"{series_caption(members)}.")
        commands += [f"# {series}"] + [run.summary.get("command") or f"# {run.name}: no command recorded"
                                       for run in members]
    count = f"{len(runs)} run{'s' if len(runs) != 1 else ''}"
    dirty = any((run.summary.get("commit") or "").endswith("-dirty") for run in runs)
    return (f"<details><summary>Where the numbers on this page come from: {count}, their devices, software and "
            f"exact commands</summary>\n\n" + "\n".join(items) + "\n\n" + (DIRTY_NOTE + "\n\n" if dirty else "")
            + fence("\n".join(commands), "bash") + "\n\n</details>")


@generator("provenance")
def gen_provenance(ctx: Context, args: dict) -> str:
    if not ctx.page_runs:
        raise RegionError("the page quotes no run: remove the region")
    return provenance(ctx, ctx.page_runs)


@generator("commands", ("runs",))
def gen_commands(ctx: Context, args: dict) -> str:
    return commands_block(ctx.site.runs(args["runs"]))


@generator("hardware", ("runs",), inline=True)
def gen_hardware(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    return f"{device_text(runs)}; {world_sizes_text(runs)}; {software_text(runs)}; {commits_text(runs)}"
