"""Generated regions of the posts (blogs/) and the devlog (devlog/): every measured number, table of runs, command,
code excerpt and figure link in them is written by this script from committed files, never typed by hand.

    uv run --group plots python assets/make_posts.py            # rewrite every region, redraw every figure (PNG + CSV)
    uv run python assets/make_posts.py --check                  # CI: fail where a page disagrees with the repository
    uv run python assets/make_posts.py --only blogs/03-fsdp.md  # one page's regions (and the figures it shows)
    uv run python assets/make_posts.py --no-figures             # regions only, without matplotlib

Regions
-------
A region is an HTML comment that names a generator (KIND) and its arguments, then the generated content, then a
closing comment. On its own lines (a block):

    <!-- generated:table runs=devlog/data/2026-11-23-workload/* cols=run,ranks,step_ms,tok_s,peak_mem -->
    ...written by make_posts.py...
    <!-- /generated -->

or inside one line of prose (inline): `FSDP moves <!-- generated:value run=devlog/data/2026-11-23-workload/fsdp-ft
field=collective_bytes_per_step.gloo:all_gather.bytes fmt=",.0f" -->1,234<!-- /generated --> bytes per step.`
(a dotted path splits at dots only, so keys with a colon such as `gloo:all_gather` are one segment).

An inline value never starts a line: a line that starts with "<!--" opens an HTML block in CommonMark, which ends
the paragraph, so the value would render outside its sentence. Writing a page joins such a line to the one before;
`--check` fails on every inline value that markdown-it-py (a CommonMark parser) places outside a paragraph, heading,
list item or table cell.

A page that quotes runs holds one `provenance` region (usually at its end): a collapsed block listing every run its
other regions read, by series, with the device, world sizes, software versions, commit, memory measure and warm-up
of each series and every run's exact command. Tables and figures carry no caption of their own.

- Write the opening comment with an empty content, run the script, commit what it wrote. Never edit inside a
  region: the next run rewrites it, and `--check` fails on any difference.
- Arguments are key=value, quoted like a shell (`label="a value with spaces"`). An unknown argument is an error.
  A long opening comment may go on over several lines; an inline region closes on the line where it ends.
- Paths are relative to the repository root. `runs=` is a comma-separated list of run folders or globs under
  devlog/data (`runs=devlog/data/2026-11-23-workload/*`, `runs=devlog/data/2026-11-23-pp/pp-ft-*-m4`); a run folder
  is one holding summary.json. A glob that matches no run, or a named run without summary.json, is an error.
- The content is a function of the arguments and the committed files only (never of time, machine or
  environment), so `--check` on any machine regenerates the same text.
- Regions do not nest. A marker inside a fenced code block or a `code span` is text, not a region.
- Every run a page quotes is listed in its provenance region; a page that quotes runs without one, or with two, fails.
- Outside regions, a table row must hold no measured-looking number: digits followed by ms, s, tok/s, tokens/s,
  GiB, MiB, GB, MB or %, a ratio such as 1.36x, or a plain number under a column whose header names a measurement
  (ms, tok/s, loss, memory, GiB, bubble, MFU, comm, time, ...). A row that is not a measurement (a table of formulas,
  of settings) ends with the marker `<!-- not-measured -->`; a row quoting someone else's published measurement
  (labelled as such in the table) ends with `<!-- cited -->`. Neither is ever a number of ours.

`--check` (CI) exits non-zero, naming file, line and region, when a region differs from what the committed runs
give (with a one-line hint of the first difference), when a region names a run or file that git does not track,
when a link or image in blogs/ or devlog/ points to a missing file or to a heading a page does not have, when a
table row outside any region holds a measured-looking number, when a region is unclosed or nested, when an inline
value renders outside its sentence, when a page's provenance is missing, and when a figure's CSV in assets/plots
differs from what its runs give (a figure linked from a page must be computable from committed runs).

Generators
----------
table runs=RUNS [cols=C1,C2,...] [sort=[-]COL] [label=FORMAT] [ref=RUN]
    One row per run, columns from COLUMNS (below). `sort=-tok_s` sorts descending. `label` formats the first
    column from the run's fields: `label="{experiment} m={config.grad_accum}"` (`{path:fmt}` takes a format).
    Beside the named columns: `field:PATH[:FMT]` (any summary.json field, e.g. `field:config.bucket_cap_mb:g`) and,
    with `ref=`, `rel:COL` (the column divided by the reference run's, shown as 0.73x).
        <!-- generated:table runs=devlog/data/2026-11-23-workload/* cols=run,ranks,tok_s,rel:tok_s,peak_mem
             ref=devlog/data/2026-11-23-workload/single-ft sort=-tok_s -->
    Columns: run (the row label), experiment, strategy (what sets the run apart: ZeRO stage, schedule, split,
    bucket size, checkpointing, LoRA...), model, params, trainable, seq, micro, ga, ckpt, dtype, lora, ranks, steps,
    t_eff, step_ms, step_ms_median, step_ms_max (the median and slowest measured step), comm_ms, comm_share (comm_ms
    over the profiled steps' time), tok_s, tok_s_median (tokens/s of the median step), tok_s_device, peak_mem (its
    header names the measure: peak RSS on CPU), peak_mem_ranks, predicted_now (common.memory's peak for the run's
    settings as the code prices it now), predicted_peak (the one the run recorded), mfu, final_loss, eval_loss,
    packing, collectives (calls per step, compact), coll_mib (MiB handed to collectives per step, rank 0),
    wire_mib (what rank 0 sends, ring algorithms), state_mib, weights_mib, grads_mib, optimizer_mib, master_mib
    (model-state MiB per rank), predicted_state_mib, state_ratio (measured / predicted), activation_mib, schedule,
    m, bubble, bubble_ranks, bubble_textbook, bubble_formula, timed_steps, mfu_median (MFU of the median step).
    Per-rank values read "rank 0 / rank 1". A mean over a few steps moves with one slow step: where a conclusion
    rests on a speed, show the median beside it.
    MFU, here and in `value`: a GPU run recorded before its steps carried their FLOPs is recounted from its rebuilt
    rows when loaded (`recounted`); a table with an MFU column says so under it.
value run=RUN field=PATH [fmt=SPEC]                          (inline or block)
value expr=EXPRESSION NAME=RUN ... [fmt=SPEC]
    One number. PATH is a dotted path into summary.json: dict keys and list indices (`state_bytes_per_rank.0.weights`,
    `bubble_fraction_per_rank.-1`); `steps` is metrics.jsonl (`steps.0.loss`, `steps.-1.loss`), `timed` the steps
    the summary's averages count (warm-up and profiled steps left out), `name` the folder name, `prediction` the
    peak GiB common.memory predicts for the run's settings now (predicted_now). In `expr`, each
    NAME=RUN argument binds a run: numbers, + - * /, parentheses, min, max, abs, sum, mean, median, len and paths on
    the named runs, nothing else; `*` or a slice `a:b` in a path gives a list (`mean(a.steps.-10:.loss)`: the mean
    loss of the last 10 steps; `median(a.timed.*.tokens_per_s)`: tokens/s of the median timed step). fmt is a Python
    format spec (",.0f", ".2f", ".1%"); write units outside the region.
        DDP runs at <!-- generated:value expr="b.tokens_per_s / a.tokens_per_s" fmt=".2f"
        a=devlog/data/2026-11-23-workload/single-ft b=devlog/data/2026-11-23-workload/ddp-ft -->1.03<!-- /generated -->x
        the speed of single-ft.
parity runs=RUNS ref=RUN
    Per run: the steps compared, the largest relative per-step loss difference from the reference over all steps
    and over the first 5, the eval loss's relative difference, and whether each is within the tests' 1e-5. Runs
    that do not do the reference's steps (model, tokens per step, data, seed, dtype, lr, ...) are an error.
collectives runs=RUNS
    Per run (and rank, for pp-ft) and backend collective: calls and MiB per optimizer step, measured and from
    common/comm.py's formula (`collective_bytes_formula`), the wire MiB per rank (ring algorithms), and a match mark.
state runs=RUNS
    Per run and rank: model-state MiB by kind (weights, grads, optimizer, master) and in total, measured from the
    rank's tensors / predicted by common.memory, and their ratio.
bubble runs=RUNS
    Per pipeline run: schedule, p (ranks), v (stages per rank), m (micro-batches), the measured bubble (mean and per
    rank), the textbook value and its formula.
sweep run-dir=FOLDER
    A common.sweep grid's table (its sweep.csv, formatted as common/sweep.py formats it); its runs join the provenance.
memory-cli args="ARGS"
    A fenced block with `$ uv run python -m common.memory ARGS` and what it prints: a prediction, regenerated from
    the code so it never drifts.
        <!-- generated:memory-cli args="--model qwen3-4b --gpus 2 --gpu-mem-gb 24" -->
memory-table cases="ARGS; ARGS; ..." [strategies=S1,S2,...]
    One table for several settings of common.memory (each case: flags of `python -m common.memory`, answered as the
    command line answers them, common.memory.ask): GiB per GPU of every strategy (or those named) at its largest
    micro-batch that fits, marked where over the usable memory, and the first rung recommend() picks.
answer-table cases="ARGS; ARGS; ..." reference=RUN [measured=RUNS]
    The decision guide's answer: per case (flags of `python -m common.memory`, with --gpu NAME), the experiment and
    flags of the command it prints, its predicted GiB per GPU, and tokens/s: the median step of one of the `measured`
    runs that ran that command on that kind of GPU, else the reference run's median step scaled by the card's peak
    FLOP/s (common/metrics.py) and the model's FLOPs per token, times the GPUs (a prediction, marked so).
code file=FILE symbol=NAME | code file=FILE start="TEXT" end="TEXT" [lang=LANG]
    A fenced block of the file's current source: a top-level function, class or assignment (`symbol=apply_fsdp`,
    `symbol=Config`, a method as `symbol=BusyTimer.wrap`), or the lines from the only line containing `start` to the
    first line after it containing `end`.
diff a=FILE b=FILE [match="TEXT"] [context=3]
    A ```diff block of the unified diff's hunks that contain `match` (all hunks without it).
        <!-- generated:diff a=experiments/single-ft/train.py b=experiments/ddp-ft/train.py match="no_sync" -->
diffstat base=FILE files=GLOB
    A table of lines added and removed per file against the base.
        <!-- generated:diffstat base=experiments/single-ft/train.py files=experiments/*/train.py -->
commands runs=RUNS           a bash block of the runs' exact commands (summary.json's `command`)
hardware runs=RUNS           one line: device, world size, software versions, commit (inline or block)
cpu-box runs=RUNS [rss-run=RUN]
    One paragraph: "what these numbers can and cannot tell" for the runs' device kind: on CPU what carries over to
    GPUs and what does not (each point only when it applies to these runs), quoting the peak RSS of the smallest run
    given (or of rss-run), linked to post 2's explanation of each point; on a GPU what the numbers show.
gpu-slot runs=RUNS [cols=...] [sort=...] [label=...] [ref=...]
    `table` over the runs measured on a GPU (device_kind cuda or rocm); while there are none, a standard sentence
    saying so and naming the command that measures them. Only here may globs match nothing.
nav                          previous / index / next links of a post, in the order blogs/README.md lists them
figure name=NAME             the image and its CSV for a figure of assets/make_plots.py's FIGURES
provenance                   the page's collapsed block of every run its other regions quote (see above)
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import difflib
import glob
import io
import os
import re
import shlex
import statistics
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parent.parent
# The repository's own modules (common, make_plots) also when the script is run from outside the environment.
for _path in (str(REPO_ROOT), str(REPO_ROOT / "assets")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import make_plots  # noqa: E402  (after the path set-up above)
from make_plots import FIGURES, MIB, PLOTS_DIR, STATE_KINDS, STEP_SETTINGS, Run, load_run, run_folders  # noqa: E402

RUNS_DIR = "devlog/data/"  # every run a page quotes is committed under it
PAGE_GLOBS = ("blogs/*.md", "devlog/*.md")  # devlog/data/*/sweep.md are a tool's output, not pages
PARITY_TOLERANCE = 1e-5  # the tests' bound on fp32 per-step losses against single-ft (relative)
PARITY_TOLERANCE_TEXT = "1e-5"
PARITY_FIRST_STEPS = 5
NOT_MEASURED = "<!-- not-measured -->"
CITED = "<!-- cited -->"  # a row quoting someone else's published measurement, labelled as such in its table
GPU_KINDS = ("cuda", "rocm")


class RegionError(Exception):
    """Why a region cannot be generated; the caller adds the file, line and region."""


# ---------------------------------------------------------------------------------------------------------------
# Finding regions

OPEN = re.compile(r"<!--\s*generated:([A-Za-z][\w-]*)(.*?)-->", re.S)
CLOSE = re.compile(r"<!--\s*/generated\s*-->")
UNFINISHED_OPEN = re.compile(r"<!--\s*generated:(?:(?!-->).)*$", re.S)  # an opening comment whose --> is further on
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)")


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
# The repository as the generators see it


def tracked_files(root: Path) -> set[str] | None:
    """Paths git tracks (and their folders), or None when root is not the top of a git checkout."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        if Path(top).resolve() != root.resolve():
            return None
        listing = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {path for path in listing.split("\0") if path}
    folders = {str(parent) for path in files for parent in Path(path).parents if str(parent) != "."}
    return files | folders


def recounted(run: Run, name: str, root: Path) -> Run:
    """A GPU run recorded before its steps carried their FLOPs holds an MFU of the old count (6 FLOPs per weight under
    LoRA too, attention over whole rows): the MFU shown is recounted from the documents of each step
    (common.metrics.recount_flops), the recorded one kept as `mfu_recorded`, and tables with an MFU column say so."""
    if run.summary.get("mfu") is None or "flops_per_token" in run.summary:
        return run
    from common.metrics import recount_flops  # imports torch and transformers: only for such runs

    try:
        recount = recount_flops(run.summary, run.steps, root)
    except ValueError as error:
        raise RegionError(f"run {name}: its MFU cannot be recounted: {error}") from None
    if recount:
        run.summary.update(recount["summary"])
        for record, fields in zip(run.steps, recount["steps"]):
            record.update(fields)
    return run


class Site:
    """The repository root, which files git tracks (checked only in --check mode), and the runs read so far."""

    def __init__(self, root: Path, check_commits: bool):
        self.root = root.resolve()
        self.tracked = tracked_files(self.root) if check_commits else None
        self.loaded: dict[str, Run] = {}
        self.recording: list[Run] | None = None  # while a page renders: every run its regions read (provenance)
        self.current_text: str | None = None  # the page being linted, for its own anchors

    def relative(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()

    def file(self, name: str) -> Path:
        """A file named by a region: it must exist inside the repository (and be tracked, when checking)."""
        path = (self.root / name).resolve()
        if not path.is_relative_to(self.root):
            raise RegionError(f"{name} is outside the repository")
        if not path.is_file():
            raise RegionError(f"no file {name}")
        self.require_tracked(self.relative(path))
        return path

    def require_tracked(self, name: str) -> None:
        if self.tracked is not None and name not in self.tracked:
            raise RegionError(f"{name} is not committed (git does not track it): `git add` it, or CI fails")

    def run(self, name: str) -> Run:
        name = name.strip().rstrip("/")
        if not name.startswith(RUNS_DIR):
            raise RegionError(f"run '{name}' is not under {RUNS_DIR} (the runs pages quote are committed there)")
        if name not in self.loaded:
            folder = (self.root / name).resolve()
            if not folder.is_relative_to(self.root) or not (folder / "summary.json").is_file():
                raise RegionError(f"run {name} has no summary.json")
            self.require_tracked(f"{name}/summary.json")
            if (folder / "metrics.jsonl").exists():
                self.require_tracked(f"{name}/metrics.jsonl")
            self.loaded[name] = recounted(load_run(folder), name, self.root)
        if self.recording is not None and self.loaded[name] not in self.recording:
            self.recording.append(self.loaded[name])
        return self.loaded[name]

    def runs(self, spec: str, allow_missing: bool = False) -> list[Run]:
        """`runs=`: comma-separated run folders or globs, in the order given (a glob's matches sorted)."""
        result: list[Run] = []
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            if not item.startswith(RUNS_DIR):
                raise RegionError(f"runs: '{item}' is not under {RUNS_DIR} (the runs pages quote are committed there)")
            if glob.has_magic(item):
                names = [self.relative(folder) for folder in run_folders(self.root, item)]
                if not names and not allow_missing:
                    raise RegionError(f"runs: '{item}' matches no run folder (a folder holding summary.json)")
            else:
                names = [item.rstrip("/")]
                if allow_missing and not (self.root / item / "summary.json").is_file():
                    names = []
            for name in names:
                run = self.run(name)
                if run not in result:
                    result.append(run)
        if not result and not allow_missing:
            raise RegionError("runs: no run given")
        return result


@dataclass
class Context:
    """What a generator may read: the repository and the page it writes into."""
    site: Site
    page: str  # the page's path relative to the repository root
    line: int = 0  # the line of the region being generated
    figures: dict[str, int] = field(default_factory=dict)  # figure name -> line of a region that shows it
    page_runs: list[Run] = field(default_factory=list)  # every run the page's other regions read (provenance)

    def link(self, target: str) -> str:
        """A relative link from the page to a path given relative to the repository root."""
        page_folder = (self.site.root / self.page).parent
        link = os.path.relpath(self.site.root / target, page_folder).replace(os.sep, "/")
        return link + ("/" if target.endswith("/") else "")


# ---------------------------------------------------------------------------------------------------------------
# Fields, formats and the expression evaluator


def run_fields(run: Run, prediction: bool = False) -> dict:
    """What a path in a region can read: summary.json's fields, `steps` (metrics.jsonl), `timed` (the steps the
    summary's averages count: after the timing warm-up, profiled steps left out), `name` (the folder) and, asked
    for, `prediction` (current_prediction: common.memory's peak for the run's settings, as the code prices it now)."""
    fields = {**run.summary, "steps": run.steps, "timed": timed_steps(run), "name": run.name}
    return {**fields, "prediction": current_prediction(run)} if prediction else fields


def current_prediction(run: Run) -> float | None:
    """common.memory's peak GiB for the settings the run had (common.memory.predict_run), priced by the code as it is
    now; summary.json's predicted_peak_mem_gib is what the code predicted when the run started. None for a run that
    is not one of this repository's experiments."""
    from common import memory  # imports torch and transformers: only when a page quotes a prediction

    try:
        return memory.predict_run(run.summary).total_gib
    except ValueError:
        return None


def lookup(value, path: str, prefix: str = ""):
    """Follow a dotted path: dict keys, list indices (negative too); `*` or a slice `a:b` maps over a list.
    `prefix` starts the path in messages (the run's name in an expression)."""
    segments = path.split(".") if path else []
    for index, segment in enumerate(segments):
        where = f"field '{prefix}{'.'.join(segments[:index + 1])}'"
        if segment == "*" or (":" in segment and isinstance(value, list)):
            if not isinstance(value, list):
                raise RegionError(f"{where}: '{segment}' needs a list, found {type(value).__name__}")
            try:
                part = value if segment == "*" else value[slice(*(int(x) if x else None for x in segment.split(":")))]
            except ValueError:
                raise RegionError(f"{where}: '{segment}' is not a slice") from None
            rest = ".".join(segments[index + 1:])
            return [lookup(item, rest, f"{prefix}{'.'.join(segments[:index + 1])}.") for item in part]
        if isinstance(value, dict):
            if segment not in value:
                keys = ", ".join(sorted(map(str, value))[:12]) + (", ..." if len(value) > 12 else "")
                raise RegionError(f"{where}: no field '{segment}' (there are: {keys})")
            value = value[segment]
        elif isinstance(value, list):
            try:
                value = value[int(segment)]
            except ValueError:
                raise RegionError(f"{where}: '{segment}' indexes a list, give a number") from None
            except IndexError:
                raise RegionError(f"{where}: index {segment} is past the list's {len(value)} items") from None
        else:
            raise RegionError(f"{where}: '{segment}' indexes a {type(value).__name__} ({value!r})")
    return value


def show(value, spec: str = "", suffix: str = "") -> str:
    """A value as table or prose text: None as '-', lists (one value per rank) as 'a / b'."""
    if value is None or value == "" or isinstance(value, Missing):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return " / ".join(show(item, spec, suffix) for item in value)
    if isinstance(value, (int, float)):
        if spec:
            try:
                return format(value, spec) + suffix
            except ValueError:
                raise RegionError(f"format '{spec}' does not apply to {value!r}") from None
        return (f"{value:,}" if isinstance(value, int) else f"{value:.4g}") + suffix
    if isinstance(value, dict):
        raise RegionError(f"{value!r} is a group of fields: name one of them")
    return str(value)


PATH_IN_EXPRESSION = re.compile(r"(?<![\w.])([A-Za-z_]\w*)((?:\.(?:[A-Za-z_][\w:]*|-?\d+(?::-?\d*)?|:-?\d*|\*))+)")
FUNCTIONS: dict[str, Callable] = {"min": min, "max": max, "abs": abs, "sum": sum, "len": len,
                                  "mean": lambda values: sum(values) / len(values), "median": statistics.median}
BINARY = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.Div: lambda a, b: a / b}


def evaluate(expression: str, runs: dict[str, Run]) -> float:
    """A small arithmetic expression over run fields (see the module docstring), evaluated without eval()."""
    values: dict[str, object] = {}

    def substitute(match: re.Match) -> str:
        name, path = match.group(1), match.group(2)[1:]
        if name not in runs:
            raise RegionError(f"expr: '{name}' is not a run: give {name}=<run folder>")
        placeholder = f"_field{len(values)}"
        fields = run_fields(runs[name], prediction=path.split(".")[0] == "prediction")
        values[placeholder] = lookup(fields, path, f"{name}.")
        return placeholder

    prepared = PATH_IN_EXPRESSION.sub(substitute, expression)
    try:
        tree = ast.parse(prepared, mode="eval")
    except SyntaxError:
        raise RegionError(f"expr '{expression}' is not an expression") from None

    def number(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RegionError(f"expr '{expression}': {value!r} is not a number (a list needs sum/mean/min/max)")
        return value

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name) and node.id in values:
            if values[node.id] is None:
                raise RegionError(f"expr '{expression}': a field it reads is null")
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = number(walk(node.left)), number(walk(node.right))
            if isinstance(node.op, ast.Div) and right == 0:
                raise RegionError(f"expr '{expression}': division by zero")
            return BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            operand = number(walk(node.operand))
            return -operand if isinstance(node.op, ast.USub) else operand
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
                and not node.keywords and node.args):
            arguments = [walk(arg) for arg in node.args]
            if len(arguments) == 1 and isinstance(arguments[0], list):
                arguments = arguments[0]
            if node.func.id == "len":
                return len(arguments)  # of any list: len(a.steps) is the number of steps
            if not arguments:
                raise RegionError(f"expr '{expression}': {node.func.id}() of an empty list")
            arguments = [number(a) for a in arguments]
            if node.func.id == "abs":
                if len(arguments) != 1:
                    raise RegionError(f"expr '{expression}': abs takes one number")
                return abs(arguments[0])
            return FUNCTIONS[node.func.id](arguments)
        raise RegionError(f"expr '{expression}': only numbers, + - * /, parentheses, "
                          f"{', '.join(FUNCTIONS)} and run fields are allowed")

    return walk(tree.body)


# ---------------------------------------------------------------------------------------------------------------
# Table columns: name -> header, value, format


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[Run], object]  # a number, a text, or a list with one value per rank
    fmt: str = ""  # format spec; columns with one are numbers, right-aligned
    suffix: str = ""


def summary_field(key: str) -> Callable[[Run], object]:
    return lambda run: run.summary.get(key)


def config_field(key: str) -> Callable[[Run], object]:
    return lambda run: run.config.get(key)


def strategy_detail(run: Run) -> str:
    """What sets the run apart within its experiment: the strategy's own flags, and the memory and LoRA settings."""
    config, pipeline = run.config, run.summary.get("pipeline", {})
    parts = []
    if config.get("zero_stage") is not None:
        parts.append(f"ZeRO-{config['zero_stage']}")
    schedule = config.get("schedule") or pipeline.get("schedule")
    if schedule:
        parts.append(schedule)
    if (config.get("stages_per_rank") or 1) > 1:
        parts.append(f"v={config['stages_per_rank']}")
    if config.get("split"):
        parts.append(f"split {config['split']}")
    if config.get("bucket_cap_mb") is not None:
        parts.append(f"bucket {config['bucket_cap_mb']:g} MiB")
    flags = (("reshard_after_forward", False, "no reshard after forward"),
             ("reshard_after_backward", False, "no reshard after backward"), ("cpu_offload", True, "CPU offload"),
             ("reduce_every_micro_batch", True, "reduce every micro-batch"),
             ("sync_qk_norm_grads", False, "no q/k-norm gradient sync"), ("loss_parallel", False, "no loss parallel"),
             ("activation_checkpointing", True, "activation checkpointing"), ("compile", True, "compile"),
             ("packing", False, "no packing"))
    parts += [text for key, value, text in flags if config.get(key) is value]
    if config.get("loss_chunk_tokens"):
        parts.append(f"loss chunks of {config['loss_chunk_tokens']}")
    if config.get("lora_rank"):
        parts.append(f"LoRA r{config['lora_rank']}")
    return ", ".join(parts) or "-"


def comm_share(run: Run) -> float | None:
    """comm_ms over the time of the steps it was measured on (the profiled ones, which the profiler slows)."""
    comm, step = run.summary.get("comm_ms"), run.summary.get("profiled_step_ms") or run.summary.get("step_ms")
    return comm / step if comm is not None and step else None


def ring_wire_bytes(kind: str, buffer_bytes: float, world_size: int) -> float:
    """Bytes one rank sends for a collective handed `buffer_bytes`, with ring algorithms (used when common.comm
    does not provide wire_bytes): all-reduce 2 (W-1)/W of the buffer; all-gather (W-1) x the local shard;
    reduce-scatter (W-1)/W of the full input; broadcast, send, receive the buffer."""
    w = world_size
    factors = {"all_reduce": 2 * (w - 1) / w, "all_gather": w - 1, "reduce_scatter": (w - 1) / w,
               "broadcast": 1, "send": 1, "recv": 1}
    if kind not in factors:
        raise ValueError(f"unknown collective {kind!r}")
    return factors[kind] * buffer_bytes


def wire_bytes(kind: str, buffer_bytes: float, world_size: int) -> float:
    """common.comm's wire_bytes where it exists (one definition for the tests and the posts), else the ring factors."""
    try:
        from common.comm import wire_bytes as from_common
    except ImportError:
        return ring_wire_bytes(kind, buffer_bytes, world_size)
    return from_common(kind, buffer_bytes, world_size)


def world_size(run: Run) -> int:
    return run.summary.get("hardware", {}).get("world_size") or 1


def rank0_collectives(run: Run) -> dict:
    return run.summary.get("collective_bytes_per_step") or {}


def collectives_text(run: Run) -> str:
    measured = rank0_collectives(run)
    if measured:
        counts = {make_plots.collective_kind(key): entry["calls"] for key, entry in measured.items()}
    else:  # older runs: the ops the code issued (`c10d::allreduce_`), counted without their bytes
        counts = {op.split("::")[-1].rstrip("_"): calls
                  for op, calls in (run.summary.get("collectives_per_step") or {}).items()}
    if not counts:
        return "none" if world_size(run) == 1 else "-"
    return ", ".join(f"{kind} {calls:g}" for kind, calls in sorted(counts.items()))


def collective_mib(run: Run) -> float | None:
    measured = rank0_collectives(run)
    return sum(entry["bytes"] for entry in measured.values()) / MIB if measured else None


def wire_mib(run: Run) -> float | None:
    measured = rank0_collectives(run)
    if not measured:
        return None
    try:
        return sum(wire_bytes(make_plots.collective_kind(key), entry["bytes"], world_size(run))
                   for key, entry in measured.items()) / MIB
    except ValueError:
        return None


def state_total(kinds: dict | int | float | None) -> float | None:
    if kinds is None:
        return None
    if isinstance(kinds, (int, float)):
        return kinds
    return sum(kinds.get(kind) or 0 for kind in STATE_KINDS)


def measured_state(run: Run, kind: str | None) -> list | None:
    """MiB per rank of one kind of model state (None: the total)."""
    per_rank = run.summary.get("state_bytes_per_rank")
    if not per_rank:
        return None
    return [(state_total(rank) if kind is None else rank.get(kind, 0)) / MIB for rank in per_rank]


def predicted_state_mib(run: Run) -> list | None:
    ranks = len(run.summary.get("state_bytes_per_rank") or []) or world_size(run)
    predicted = [state_total(make_plots.predicted_state(run.summary, rank)) for rank in range(ranks)]
    return None if all(p is None for p in predicted) else [None if p is None else p / MIB for p in predicted]


def state_ratio(run: Run) -> list | None:
    measured, predicted = measured_state(run, None), predicted_state_mib(run)
    if not measured or not predicted:
        return None
    return [m / p if p else None for m, p in zip(measured, predicted)]


def peak_mem_header(runs: list[Run]) -> str:
    measures = {run.summary.get("memory_measure") or "" for run in runs}
    if all("RSS" in measure for measure in measures):
        return "peak RSS GiB"
    if all("reserved" in measure for measure in measures):
        return "peak reserved GiB"
    return "peak mem GiB"


def timed_steps(run: Run) -> list[dict]:
    """The metrics.jsonl records the summary's averages count: after --timing-warmup-steps, without the steps run
    under the profiler (common/metrics.py leaves both out)."""
    warmup = run.summary.get("warmup_steps_excluded", run.config.get("timing_warmup_steps", 0))
    profiled = set(run.summary.get("profiled_steps") or [])
    return [step for step in run.steps if step.get("step", 0) > warmup and step.get("step") not in profiled]


def measured_steps(run: Run, field: str) -> list[float]:
    """One metrics.jsonl field over the steps the averages count (timed_steps)."""
    return [step[field] for step in timed_steps(run) if step.get(field) is not None]


def median_of(field: str):
    return lambda run: statistics.median(values) if (values := measured_steps(run, field)) else None


COLUMNS: dict[str, Column] = {
    "run": Column("run", lambda run: run.name),  # the row label (label= formats it)
    "experiment": Column("experiment", summary_field("experiment")),
    "strategy": Column("strategy", strategy_detail),
    "model": Column("model", lambda run: run.summary.get("model", {}).get("name")),
    "params": Column("parameters", lambda run: run.summary.get("model", {}).get("parameters"), ","),
    "trainable": Column("trainable", lambda run: run.summary.get("model", {}).get("trainable_parameters"), ","),
    "seq": Column("seq", config_field("seq_len"), "d"),
    "micro": Column("micro", config_field("micro_batch_size"), "d"),
    "ga": Column("GA", config_field("grad_accum"), "d"),
    "ckpt": Column("ckpt", config_field("activation_checkpointing")),
    "dtype": Column("dtype", config_field("dtype")),
    "lora": Column("LoRA rank", config_field("lora_rank"), "d"),
    "ranks": Column("ranks", world_size, "d"),
    "steps": Column("steps", config_field("steps"), "d"),
    "t_eff": Column("tokens/step", summary_field("t_eff"), ","),
    "step_ms": Column("step ms", summary_field("step_ms"), ",.0f"),
    "comm_ms": Column("comm ms", summary_field("comm_ms"), ",.0f"),
    "comm_share": Column("comm share", comm_share, ".0%"),
    "tok_s": Column("tok/s", summary_field("tokens_per_s"), ",.0f"),
    # The averages above are total tokens over total time: one slow step weighs in full. The median step shows it.
    "step_ms_median": Column("median step ms", median_of("step_ms"), ",.0f"),
    "step_ms_max": Column("slowest step ms", lambda run: max(measured_steps(run, "step_ms"), default=None), ",.0f"),
    "tok_s_median": Column("tok/s, median step", median_of("tokens_per_s"), ",.0f"),
    "mfu_median": Column("MFU, median step", median_of("mfu"), ".1%"),
    "tok_s_device": Column("tok/s per device", summary_field("tokens_per_s_per_device"), ",.0f"),
    "peak_mem": Column("peak GiB", summary_field("peak_mem_gib"), ".2f"),  # header names the measure
    "peak_mem_ranks": Column("peak GiB per rank", summary_field("peak_mem_gib_per_rank"), ".2f"),
    "predicted_peak": Column("predicted peak GiB (at the run)", summary_field("predicted_peak_mem_gib"), ".2f"),
    "predicted_now": Column("predicted peak GiB", current_prediction, ".2f"),  # by common.memory as it is now
    "mfu": Column("MFU", summary_field("mfu"), ".1%"),
    "final_loss": Column("final loss", summary_field("final_loss"), ".4f"),
    "eval_loss": Column("eval loss", summary_field("eval_loss"), ".4f"),
    "packing": Column("packing efficiency", summary_field("packing_efficiency"), ".1%"),
    "collectives": Column("collectives per step", collectives_text),
    "coll_mib": Column("collective MiB/step", collective_mib, ",.2f"),
    "wire_mib": Column("wire MiB/step per rank", wire_mib, ",.2f"),
    "state_mib": Column("state MiB per rank", lambda run: measured_state(run, None), ",.1f"),
    **{f"{kind}_mib": Column(f"{kind} MiB per rank", lambda run, kind=kind: measured_state(run, kind), ",.1f")
       for kind in STATE_KINDS},
    "predicted_state_mib": Column("predicted state MiB per rank", predicted_state_mib, ",.1f"),
    "state_ratio": Column("state measured / predicted", state_ratio, ".3f"),
    "activation_mib": Column("activation MiB", summary_field("activation_mib"), ",.1f"),
    "schedule": Column("schedule", lambda run: make_plots.pipeline_shape(run.summary)[0]),
    "m": Column("m", lambda run: make_plots.pipeline_shape(run.summary)[3], "d"),
    "bubble": Column("bubble", summary_field("bubble_fraction"), ".3f"),
    "bubble_ranks": Column("bubble per rank", summary_field("bubble_fraction_per_rank"), ".2f"),
    "bubble_textbook": Column("textbook bubble", summary_field("bubble_fraction_textbook"), ".3f"),
    "bubble_formula": Column("formula", summary_field("bubble_formula")),
    "timed_steps": Column("timed steps", summary_field("timed_steps"), "d"),
}
DEFAULT_COLUMNS = "run,experiment,ranks,micro,ga,step_ms,comm_ms,tok_s,peak_mem,final_loss,eval_loss"


def column(spec: str, runs: list[Run], ref: Run | None) -> Column:
    """A named column, `field:PATH[:FMT]`, or `rel:NAME` (the column divided by the reference run's)."""
    if spec.startswith("field:"):
        path, _, fmt = spec[len("field:"):].partition(":")
        if not path:
            raise RegionError("cols: 'field:' needs a path, e.g. field:config.bucket_cap_mb")
        name = next((s for s in reversed(path.split(".")) if not s.lstrip("-").isdigit()), path)

        def value(run: Run):
            try:
                return lookup(run_fields(run), path)
            except RegionError as error:  # '-' in this row; an error only if no run has the field (a typo)
                return Missing(f"{run.name}: {error}")
        return Column(name, value, fmt)
    if spec.startswith("rel:"):
        base = column(spec[len("rel:"):], runs, ref)
        if ref is None:
            raise RegionError(f"cols: '{spec}' needs ref=<run>")
        reference = base.value(ref)
        if not isinstance(reference, (int, float)) or not reference:
            raise RegionError(f"cols: '{spec}': the reference run's value is {reference!r}, not a number to divide by")

        def ratio(run: Run):
            value = base.value(run)
            return value / reference if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        return Column(f"{base.header} vs {ref.name}", ratio, ".2f", "x")
    if spec not in COLUMNS:
        raise RegionError(f"cols: unknown column '{spec}'; choose from {', '.join(COLUMNS)}, field:PATH or rel:NAME")
    if spec == "peak_mem":
        return Column(peak_mem_header(runs), COLUMNS[spec].value, COLUMNS[spec].fmt)
    return COLUMNS[spec]


@dataclass(frozen=True)
class Missing:
    """A `field:` column's value in a run that lacks the field."""
    why: str


LABEL_FIELD = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def run_label(run: Run, label: str | None) -> str:
    if not label:
        return run.name
    return LABEL_FIELD.sub(lambda m: show(lookup(run_fields(run), m.group(1).strip()), m.group(2) or ""), label)


def sorted_runs(runs: list[Run], spec: str, ref: Run | None) -> list[Run]:
    """`sort=COL` or `sort=-COL` (descending): a column's value (rank 0's for per-rank columns) or a field path;
    runs without a value go last either way."""
    name = spec.lstrip("-")
    get = column(name, runs, ref).value if name in COLUMNS or ":" in name else (
        lambda run: lookup(run_fields(run), name))

    def value(run: Run):
        found = get(run)
        found = found[0] if isinstance(found, list) and found else found
        return None if isinstance(found, Missing) else found

    present = [run for run in runs if value(run) is not None]
    try:
        ordered = sorted(present, key=value, reverse=spec.startswith("-"))
    except TypeError:
        raise RegionError(f"sort={spec}: the values are not comparable (numbers and texts mixed)") from None
    return ordered + [run for run in runs if value(run) is None]


def cell_text(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: list[str], rows: list[list[str]], numeric: list[bool]) -> str:
    lines = ["| " + " | ".join(cell_text(h) for h in headers) + " |",
             "|" + "|".join("---:" if is_number else "---" for is_number in numeric) + "|"]
    lines += ["| " + " | ".join(cell_text(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Where the numbers come from: one collapsed block per page


def distinct(values) -> list:
    return list(dict.fromkeys(value for value in values if value not in (None, "")))


def device_text(runs: list[Run]) -> str:
    texts = []
    for run in runs:
        hardware = run.summary.get("hardware", {})
        if hardware.get("device_kind") == "cpu":
            texts.append(f"CPU only: {hardware.get('cpu')}, {hardware.get('cpu_cores')} cores")
        else:
            runtime = f"HIP {hardware['hip']}" if hardware.get("hip") else f"CUDA {hardware.get('cuda')}"
            texts.append(f"{hardware.get('device_count')} x {hardware.get('device_name')} ({runtime})")
    backends = distinct(key.split(":")[0] for run in runs for key in rank0_collectives(run) if ":" in key)
    return "; ".join(distinct(texts)) + (f", collectives over {' and '.join(backends)}" if backends else "")


def software_text(runs: list[Run]) -> str:
    parts = []
    for name in ("torch", "transformers", "peft", "deepspeed"):
        versions = distinct(run.summary.get("hardware", {}).get(name) if name == "torch" else
                            run.summary.get("hardware", {}).get("packages", {}).get(name) for run in runs)
        if versions:
            parts.append(f"{name} {' / '.join(versions)}")
    pythons = distinct(run.summary.get("hardware", {}).get("python") for run in runs)
    if pythons:
        parts.append(f"Python {' / '.join(pythons)}")
    return ", ".join(parts)


def world_sizes_text(runs: list[Run]) -> str:
    sizes = sorted({world_size(run) for run in runs})
    return "world size " + (" and ".join(map(str, sizes)) if len(sizes) <= 2 else ", ".join(map(str, sizes)))


def commands_block(runs: list[Run]) -> str:
    return fence("\n".join(run.summary.get("command") or f"# {run.name}: no command recorded" for run in runs),
                 "bash")


def series_caption(runs: list[Run]) -> str:
    """Where one series' runs were measured: device, world sizes, software, commit, memory measure, warm-up."""
    commits = distinct(run.summary.get("commit") for run in runs) or ["not recorded"]
    measures = distinct(run.summary.get("memory_measure") for run in runs)
    warmups = distinct(run.summary.get("warmup_steps_excluded") for run in runs)
    details = [device_text(runs), world_sizes_text(runs), software_text(runs), f"commit {', '.join(commits)}"]
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
    return (f"<details><summary>Where the numbers on this page come from: {count}, their devices, software and "
            f"exact commands</summary>\n\n" + "\n".join(items) + "\n\n" + fence("\n".join(commands), "bash")
            + "\n\n</details>")


def fence(text: str, lang: str = "") -> str:
    """A fenced block longer than any backtick run inside it, so quoted markdown cannot close it early."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    marks = "`" * max(3, longest + 1)
    return f"{marks}{lang}\n{text}\n{marks}"


# ---------------------------------------------------------------------------------------------------------------
# The generators: (context, arguments) -> markdown


def gen_table(ctx: Context, args: dict, runs: list[Run] | None = None) -> str:
    runs = ctx.site.runs(args["runs"]) if runs is None else runs
    ref = ctx.site.run(args["ref"]) if "ref" in args else None
    specs = [spec.strip() for spec in args.get("cols", DEFAULT_COLUMNS).split(",") if spec.strip()]
    columns = [column(spec, runs, ref) for spec in specs]
    if "sort" in args:
        runs = sorted_runs(runs, args["sort"], ref)
    values = [[run_label(run, args.get("label")) if spec == "run" else col.value(run)
               for spec, col in zip(specs, columns)] for run in runs]
    for index, spec in enumerate(specs):
        if values and all(isinstance(row[index], Missing) for row in values):
            raise RegionError(f"cols: {spec}: {values[0][index].why}")
    rows = [[show(value, col.fmt, col.suffix) for value, col in zip(row, columns)] for row in values]
    table = markdown_table([c.header for c in columns], rows, [bool(c.fmt) for c in columns])
    note = mfu_recount_note(runs) if any(spec.split(":")[-1] == "mfu" for spec in specs) else ""
    return table + ("\n\n" + note if note else "")


def mfu_recount_note(runs: list[Run]) -> str:
    """What a table's MFU column is for runs whose summary.json predates the per-step FLOPs (see `recounted`)."""
    how = {run.name: run.summary.get("mfu_recount") for run in runs if run.summary.get("mfu_recount")}
    again = [name for name, text in how.items() if text.startswith("recounted")]
    left = [f"{name} ({text[len('not recounted: '):]})" for name, text in how.items() if name not in again]
    parts = []
    if again:
        which = "MFU" if len(again) == len(runs) else f"MFU of {', '.join(again)}"
        parts.append(f"{which} recounted from the documents of each step, rebuilt from the run's config and data "
                     f"(common.metrics.recount_flops: attention per document, 4 FLOPs per frozen weight under LoRA); "
                     f"summary.json keeps the figure of the count the run was recorded with")
    if left:
        parts.append(f"no MFU for {', '.join(left)}")
    return ("; ".join(parts) + ".") if parts else ""


def gen_value(ctx: Context, args: dict) -> str:
    fmt = args.pop("fmt", "")
    if "expr" in args:
        expression = args.pop("expr")
        bad = [name for name in args if not name.isidentifier() or name in FUNCTIONS]
        if bad:
            raise RegionError(f"expr: {', '.join(bad)} cannot name a run (use a plain name such as a=, fsdp=)")
        value = evaluate(expression, {name: ctx.site.run(path) for name, path in args.items()})
    else:
        missing = [key for key in ("run", "field") if key not in args]
        extra = [key for key in args if key not in ("run", "field")]
        if missing or extra:
            raise RegionError("value takes run= and field= (or expr= and one NAME=<run> per run it reads)"
                              + (f"; unknown: {', '.join(extra)}" if extra else ""))
        value = lookup(run_fields(ctx.site.run(args["run"])), args["field"])
    if isinstance(value, (list, dict)):
        raise RegionError(f"the value is a {type(value).__name__}: index it, or reduce it with sum/mean/min/max")
    return show(value, fmt)


def relative_difference(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return abs(value - reference) / abs(reference) if reference else abs(value - reference)


def small(value: float | None) -> str:
    if value is None:
        return "-"
    return "0" if value == 0 else f"{value:.1e}"


def loss_differences(run: Run, ref: Run) -> list[float]:
    """Relative difference of the run's loss from the reference's at every step both logged, in step order."""
    reference = {record["step"]: record["loss"] for record in ref.steps}
    return [relative_difference(record["loss"], reference[record["step"]]) for record in run.steps
            if record["step"] in reference]


def gen_parity(ctx: Context, args: dict) -> str:
    runs, ref = ctx.site.runs(args["runs"]), ctx.site.run(args["ref"])
    names = ("model", "t_eff", *STEP_SETTINGS)
    rows = []
    for run in runs:
        if run is ref:
            continue
        if run.step_key() != ref.step_key():
            differ = [f"{name} {mine!r} vs {theirs!r}" for name, mine, theirs in
                      zip(names, run.step_key(), ref.step_key()) if mine != theirs]
            raise RegionError(f"parity: {run.name} does not do the steps of {ref.name} ({'; '.join(differ)})")
        differences = loss_differences(run, ref)
        if not differences:
            raise RegionError(f"parity: {run.name} and {ref.name} have no step in common (metrics.jsonl)")
        everywhere, first = max(differences), max(differences[:PARITY_FIRST_STEPS])
        within = f"{show(everywhere <= PARITY_TOLERANCE)} / {show(first <= PARITY_TOLERANCE)}"
        rows.append([run.name, str(len(differences)), small(everywhere), small(first),
                     small(relative_difference(run.summary.get("eval_loss"), ref.summary.get("eval_loss"))), within])
    headers = ["run", "steps compared", "max rel. loss difference, all steps",
               f"same, first {PARITY_FIRST_STEPS} steps", "eval loss rel. difference",
               f"within {PARITY_TOLERANCE_TEXT} (all / first {PARITY_FIRST_STEPS})"]
    table = markdown_table(headers, rows, [False, True, True, True, True, False])
    return f"{table}\n\nRelative difference: |loss - {ref.name}'s| / {ref.name}'s, per step."


def close_enough(measured: float, formula: float) -> bool:
    return abs(measured - formula) <= 1e-6 * max(abs(measured), abs(formula), 1.0)


def gen_collectives(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    per_rank = any(run.summary.get("collective_bytes_per_step_per_rank") for run in runs)
    rows = []
    for run in runs:
        if run.summary.get("collective_bytes_per_step_per_rank"):
            measured_ranks = list(enumerate(run.summary["collective_bytes_per_step_per_rank"]))
            formulas = run.summary.get("collective_bytes_formula_per_rank") or []
        else:
            measured_ranks = [(0, rank0_collectives(run))]
            formulas = [run.summary.get("collective_bytes_formula")]
        for rank, measured in measured_ranks:
            measured = measured or {}
            formula = formulas[rank] if rank < len(formulas) else None
            keys = sorted(set(measured) | set(formula or {}))
            lead = [run.name] + ([str(rank)] if per_rank else [])
            if not keys:
                rows.append(lead + ["none"] + ["-"] * 6)
                continue
            for key in keys:
                got, want = measured.get(key), (formula or {}).get(key)
                if formula is None:
                    mark = "-"
                else:
                    got_calls, got_bytes = (got["calls"], got["bytes"]) if got else (0, 0)
                    want_calls, want_bytes = (want["calls"], want["bytes"]) if want else (0, 0)
                    mark = "✓" if close_enough(got_calls, want_calls) and close_enough(got_bytes, want_bytes) else "✗"
                try:
                    wire = wire_bytes(make_plots.collective_kind(key), got["bytes"], world_size(run)) if got else None
                except ValueError:  # a collective without a ring formula
                    wire = None
                rows.append(lead + [key, show(got and got["calls"], "g"), show(want and want["calls"], "g"),
                                    show(got and got["bytes"] / MIB, ",.2f"),
                                    show(want and want["bytes"] / MIB, ",.2f"),
                                    show(wire and wire / MIB, ",.2f"), mark])
    headers = ["run"] + (["rank"] if per_rank else []) + [
        "collective", "calls/step", "calls (formula)", "MiB/step", "MiB (formula)", "wire MiB/step per rank", "match"]
    numeric = [False] + ([True] if per_rank else []) + [False, True, True, True, True, True, False]
    note = ("MiB handed to the collective per optimizer step (an all-gather's local shard, a reduce-scatter's full "
            "input), measured by torch.profiler on rank 0" + (" (every rank for pipelines)" if per_rank else "")
            + "; formula: common/comm.py; wire: what one rank sends with ring algorithms.")
    return f"{markdown_table(headers, rows, numeric)}\n\n{note}"


def gen_state(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    # DeepSpeed keeps buffers beside the model states (its gradient-reduction bucket, allocated for the whole run):
    # shown in their own column when a run measured them, never added to the states' total.
    buffers = any("buffers" in kinds for run in runs for kinds in run.summary.get("state_bytes_per_rank") or [])
    rows = []
    for run in runs:
        measured = run.summary.get("state_bytes_per_rank")
        if not measured:
            rows.append([run.name, "-"] + ["-"] * (len(STATE_KINDS) + 2 + buffers))
            continue
        for rank, kinds in enumerate(measured):
            predicted = make_plots.predicted_state(run.summary, rank)
            predicted_kinds = predicted if isinstance(predicted, dict) else {}
            cells = []
            for kind in STATE_KINDS:
                text = show(kinds.get(kind, 0) / MIB, ",.1f")
                if kind in predicted_kinds:
                    text += f" / {show(predicted_kinds[kind] / MIB, ',.1f')}"
                cells.append(text)
            total, predicted_total = state_total(kinds), state_total(predicted)
            total_text = show(total / MIB, ",.1f") + (f" / {show(predicted_total / MIB, ',.1f')}"
                                                      if predicted_total is not None else "")
            ratio = total / predicted_total if predicted_total else None
            extra = [show(kinds["buffers"] / MIB, ",.1f") if "buffers" in kinds else "-"] if buffers else []
            rows.append([run.name, str(rank)] + cells + [total_text, show(ratio, ".3f")] + extra)
    headers = (["run", "rank"] + [f"{kind} MiB" for kind in STATE_KINDS] + ["total MiB", "measured / predicted"]
               + (["engine buffers MiB"] if buffers else []))
    note = ("Each cell: measured (the bytes of the tensors the rank holds after a step) / predicted (common.memory)."
            + (" Engine buffers: DeepSpeed's gradient-reduction bucket, measured, outside the total." if buffers else ""))
    return f"{markdown_table(headers, rows, [False] + [True] * (len(STATE_KINDS) + 3 + buffers))}\n\n{note}"


def gen_bubble(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    rows = []
    for run in runs:
        schedule, p, v, m = make_plots.pipeline_shape(run.summary)
        rows.append([run.name, show(schedule), show(p), show(v if schedule else None), show(m),
                     show(run.summary.get("bubble_fraction"), ".3f"),
                     show(run.summary.get("bubble_fraction_per_rank"), ".2f"),
                     show(run.summary.get("bubble_fraction_textbook"), ".3f"),
                     show(run.summary.get("bubble_formula"))])
    headers = ["run", "schedule", "p", "v", "m", "bubble (mean over ranks)", "per rank", "textbook", "formula"]
    return markdown_table(headers, rows, [False, False, True, True, True, True, True, True, False])


SWEEP_NUMBERS = {"step_ms": float, "comm_ms": float, "toks/s": float, "peak_mem_gib": float, "t_eff": int,
                 "mfu": float, "final_loss": float, "scaling_eff": float}


def gen_sweep(ctx: Context, args: dict) -> str:
    from common import sweep  # its own table code, so the page shows the sweep's table as the sweep writes it

    run_dir = args["run-dir"].rstrip("/")
    path = ctx.site.file(f"{run_dir}/sweep.csv")
    rows = []
    for row in csv.DictReader(path.read_text().splitlines()):
        rows.append({key: (None if value == "" else SWEEP_NUMBERS[key](float(value)) if key in SWEEP_NUMBERS
                           else value) for key, value in row.items()})
    if not rows:
        raise RegionError(f"{run_dir}/sweep.csv has no cells")
    ctx.site.runs(f"{run_dir}/*")  # the cells' runs: committed, and listed in the page's provenance
    return sweep.markdown_table(rows)


def gen_memory_cli(ctx: Context, args: dict) -> str:
    from common import memory  # imports torch and transformers: only when a page shows a prediction

    argv = shlex.split(args["args"])
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        try:
            memory.main(argv)
        except SystemExit as stop:
            if stop.code not in (0, 1, None):  # 1: the CLI answered that nothing fits
                message = errors.getvalue().strip().splitlines() or [str(stop.code)]
                raise RegionError(f"python -m common.memory {args['args']}: {message[-1]}") from None
    return fence(f"$ uv run python -m common.memory {shlex.join(argv)}\n{printed.getvalue().rstrip()}", "text")


def memory_case(text: str):
    """One case of a memory-table or answer-table: the flags of `python -m common.memory`, parsed and answered as the
    command line answers them (common.memory.ask)."""
    from common import memory  # imports torch and transformers: only when a page shows a prediction

    parser = memory.build_parser()
    parser.exit_on_error = False
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return memory.ask(shlex.split(text), parser)
    except (argparse.ArgumentError, memory.AnswerError, ValueError) as error:
        raise RegionError(f"case '{text.strip()}': {error}") from None
    except SystemExit:
        message = errors.getvalue().strip().splitlines() or ["bad flags"]
        raise RegionError(f"case '{text.strip()}': {message[-1]}") from None


def model_label(shape) -> str:
    """qwen3-4b -> Qwen3-4B, as the posts write the published sizes."""
    name = shape.name.replace("qwen3", "Qwen3").replace("-0.6b", "-0.6B").replace("-1.7b", "-1.7B")
    return re.sub(r"-(\d+)b\b", lambda m: f"-{m.group(1)}B", name).replace("-a3b", "-A3B")


def gen_memory_table(ctx: Context, args: dict) -> str:
    """common.memory's prediction for several settings in one table: GiB per GPU of every strategy, each at the
    largest micro-batch that fits (or the micro-batch a case fixes), and the rung recommend() picks (a prediction,
    regenerated from the code)."""
    from common import memory  # imports torch and transformers: only when a page shows a prediction

    cases = [memory_case(text) for text in args["cases"].split(";") if text.strip()]
    if not cases:
        raise RegionError("memory-table needs cases=\"--model ... --gpus ...; --model ...\"")
    strategies = [name for name in memory.STRATEGIES if any(e.strategy == name for c in cases
                                                            for e in c.advice.estimates)]
    if "strategies" in args:
        wanted = [name.strip() for name in args["strategies"].split(",") if name.strip()]
        unknown = [name for name in wanted if name not in memory.STRATEGIES]
        if unknown:
            raise RegionError(f"memory-table: unknown strategies {', '.join(unknown)}; common.memory has "
                              f"{', '.join(memory.STRATEGIES)}")
        strategies = [name for name in wanted if name in strategies]

    def label(estimate) -> str:
        return (estimate.strategy + (" + checkpointing" if estimate.activation_checkpointing else "")
                + (f" + QLoRA r{estimate.lora_rank}" if estimate.qlora else
                   f" + LoRA r{estimate.lora_rank}" if estimate.lora_rank else "")
                + (f", micro-batch {estimate.micro_batch_size}" if estimate.micro_batch_size > 1 else ""))

    rows = []
    for case in cases:
        flags = case.args
        details = [f"{flags.gpus} x {case.gpu_mem_gb:g} GB"]
        details += [f"seq {flags.seq_len:,}"] * (flags.seq_len != 1024)
        details += [f"micro-batch {flags.micro_batch_size}"] * bool(flags.micro_batch_size)
        details += [f"LoRA r{flags.lora_rank}"] * bool(flags.lora_rank) + ["QLoRA"] * flags.qlora
        details += ["checkpointing"] * flags.activation_checkpointing + ["no speed flags"] * (not flags.fast)
        details += [flags.interconnect.replace("nvlink", "NVLink").replace("pcie", "PCIe")] * (flags.gpus > 1)
        cells = []
        chosen = case.advice.choice
        for strategy in strategies:
            found = next((e for e in case.advice.estimates if e.strategy == strategy), None)
            if found is None:
                cells.append("-")
                continue
            text = f"{found.total_gib:.1f}" + ("" if found.fits(case.gpu_mem_gb) else " ✗")
            if chosen is not None and label(chosen) == label(found):
                text = f"**{text}**"
            cells.append(text)
        verdict = "none fits" if chosen is None else f"{label(chosen)} ({chosen.total_gib:.1f} GiB)"
        rows.append([f"{model_label(case.shape)}, {', '.join(details)}"] + cells + [verdict])
    table = markdown_table(["setting"] + strategies + ["first rung that fits"], rows,
                           [False] + [True] * len(strategies) + [False])
    return (f"{table}\n\nGiB per GPU predicted by common.memory (`--dtype bf16`, each strategy as its experiment "
            f"keeps it, with the speed flags it takes unless the row says otherwise, at the largest micro-batch of 8 "
            f"rows per step that fits); usable: {memory.USABLE_FRACTION:.0%} of the card; ✗: over it; bold: the rung "
            f"`recommend()` picks when it needs no more than the setting gives (else its own total, last column).")


def gen_answer_table(ctx: Context, args: dict) -> str:
    """The answer of the decision guide: per setting (GPUs x model x full / LoRA / QLoRA), the command recommend()
    gives, what it is predicted to hold per GPU, and its tokens/s: measured where one of the `measured` runs ran that
    command on that GPU, otherwise scaled from the `reference` run (a measured GPU run) by the card's peak FLOP/s and
    the model's FLOPs per token, which assumes the reference's MFU (median step) and counts no communication."""
    from common import memory  # imports torch and transformers: only when a page shows a prediction
    from common.metrics import peak_flops_per_device
    from common.models import model_config, training_flops

    cases = [memory_case(text) for text in args["cases"].split(";") if text.strip()]
    if not cases:
        raise RegionError("answer-table needs cases=\"--model ... --gpus ... --gpu ...; ...\"")
    reference = ctx.site.run(args["reference"])
    reference_device = reference.summary["hardware"]["device_name"]
    reference_peak = peak_flops_per_device(reference_device)
    if reference_peak is None:
        raise RegionError(f"answer-table: the reference ran on {reference_device}, whose peak is not in the table")
    reference_tokens_s = median_of("tokens_per_s")(reference)

    def flops_per_token(model: str, lora_rank: int, seq_len: int) -> float:
        return training_flops(model_config(model), lora_rank).dense_per_token(seq_len)

    reference_flops = flops_per_token(reference.config["model"], reference.config["lora_rank"],
                                      reference.config["seq_len"])
    measured = ctx.site.runs(args.get("measured", args["reference"]), allow_missing=True)

    def ran(run, case) -> bool:
        """`run` is the rung's command on this case's kind of GPU."""
        rung, config = case.advice.rung, run.config
        same_card = peak_flops_per_device(run.summary["hardware"]["device_name"]) == \
            peak_flops_per_device(case.args.gpu.replace("-", " "))
        return (run.summary["experiment"] == memory.RUN_WITH[rung.strategy].split("/")[1] and same_card
                and run.summary["model"]["parameters"] == case.shape.total_parameters
                and (config["seq_len"], config["micro_batch_size"], config["grad_accum"], config["lora_rank"],
                     config["activation_checkpointing"]) == (case.args.seq_len, rung.micro_batch_size, rung.grad_accum,
                                                             rung.lora_rank, rung.activation_checkpointing)
                and ((config["attn"] == "varlen", bool(config.get("loss_chunk_tokens")), bool(config.get("compile")))
                     == rung.fast))

    rows = []
    for case in cases:
        flags, advice = case.args, case.advice
        if not flags.gpu:
            raise RegionError(f"answer-table: case '{flags.model}' names no --gpu (its peak sets the tokens/s)")
        gpus, model = f"{flags.gpus} x {flags.gpu.replace('-', ' ')}", model_label(case.shape)
        if advice.rung is None:
            rows.append([gpus, model, "-", "nothing fits", "-", "-", "-"])
            continue
        rung = advice.rung
        training = f"QLoRA r{rung.lora_rank}" if rung.qlora else f"LoRA r{rung.lora_rank}" if rung.lora_rank else "full"
        command = re.sub(r"^uv run (python|torchrun --nproc_per_node=\d+) experiments/([\w-]+)/train\.py", r"\2",
                         advice.command()).replace(f" --model {advice.model}", "")
        peak = peak_flops_per_device(flags.gpu.replace("-", " "))
        run = next((run for run in measured if ran(run, case)), None)
        if run is not None:
            tokens, source = f"{median_of('tokens_per_s')(run):,.0f}", f"measured ({run.name.rsplit('/', 1)[-1]})"
        elif rung.strategy in memory.OFFLOAD_LADDER:
            tokens, source = "-", "not predicted: AdamW runs on the CPU"
        elif peak is None:
            tokens, source = "-", f"not predicted: no peak FLOP/s for {flags.gpu} in common/metrics.py"
        else:
            replicas = 1 if rung.strategy == "single" else flags.gpus
            scaled = (reference_tokens_s * peak / reference_peak * reference_flops
                      / flops_per_token(flags.model, rung.lora_rank, flags.seq_len) * replicas)
            tokens, source = f"~{scaled:,.0f}", "predicted"
        rows.append([gpus, model, training, f"`{command}`",
                     f"{advice.choice.total_gib:.1f} of {case.gpu_mem_gb * memory.USABLE_FRACTION:.1f}", tokens,
                     source])
    table = markdown_table(["GPUs", "model", "training", "experiment and flags (add `--model`)", "GiB per GPU",
                            "tokens/s", "tokens/s is"], rows, [False, False, False, False, True, True, False])
    return (f"{table}\n\nEach row is what `uv run python -m common.memory --model ... --gpus N --gpu NAME` answers "
            f"(`--lora-rank 16`, `--qlora` where the row trains adapters): the experiment and flags of its `run:` line, "
            f"and its predicted peak per GPU of what is usable (90% of the card). Predicted tokens/s scale the median "
            f"step of {reference.name.rsplit('/', 1)[-1]} ({reference_tokens_s:,.0f} tokens/s on one "
            f"{reference_device}) by the card's dense bf16 peak and the model's FLOPs per token, times the GPUs: the "
            f"same MFU, no communication and no host time counted, so read them as upper bounds.")


LANGUAGES = {".py": "python", ".sh": "bash", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json",
             ".md": "markdown", ".jinja": "jinja"}


def symbol_lines(source: str, symbol: str, name: str) -> tuple[int, int]:
    """First and last line (1-based) of a top-level function, class or assignment, or `Class.method`."""
    body = ast.parse(source).body
    *parents, last = symbol.split(".")
    for parent in parents:
        classes = [node for node in body if isinstance(node, ast.ClassDef) and node.name == parent]
        if not classes:
            raise RegionError(f"{name} has no class {parent}")
        body = classes[0].body

    def names(node) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [t.id for t in node.targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    found = [node for node in body if last in names(node)]
    if not found:
        raise RegionError(f"{name} defines no {symbol} at its top level")
    if len(found) > 1:
        lines = ", ".join(str(node.lineno) for node in found)
        raise RegionError(f"{name} defines {symbol} {len(found)} times (lines {lines})")
    node = found[0]
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


def line_matching(lines: list[str], text: str, name: str, what: str, after: int = 0, unique: bool = True) -> int:
    hits = [index for index in range(after, len(lines)) if text in lines[index]]
    if not hits:
        raise RegionError(f"{what}: no line of {name}{' after the start' if after else ''} contains '{text}'")
    if unique and len(hits) > 1:
        raise RegionError(f"{what}: '{text}' is on {len(hits)} lines of {name} "
                          f"({', '.join(str(h + 1) for h in hits[:6])}): make it unique")
    return hits[0]


def gen_code(ctx: Context, args: dict) -> str:
    name = args["file"]
    source = ctx.site.file(name).read_text()
    lines = source.splitlines()
    if "symbol" in args:
        if "start" in args or "end" in args:
            raise RegionError("code takes symbol= or start= and end=, not both")
        first, last = symbol_lines(source, args["symbol"], name)
        first, last = first - 1, last - 1
    elif "start" in args and "end" in args:
        first = line_matching(lines, args["start"], name, "start")
        last = line_matching(lines, args["end"], name, "end", after=first, unique=False)
    else:
        raise RegionError("code needs symbol=NAME, or start=\"TEXT\" and end=\"TEXT\"")
    language = args.get("lang", LANGUAGES.get(Path(name).suffix, ""))
    return fence(textwrap.dedent("\n".join(lines[first:last + 1])), language)


def gen_diff(ctx: Context, args: dict) -> str:
    a, b = ctx.site.file(args["a"]).read_text().splitlines(), ctx.site.file(args["b"]).read_text().splitlines()
    try:
        context = int(args.get("context", 3))
    except ValueError:
        raise RegionError(f"context={args['context']} is not a number of lines") from None
    diff = list(difflib.unified_diff(a, b, fromfile=args["a"], tofile=args["b"], n=context, lineterm=""))
    if not diff:
        raise RegionError(f"{args['a']} and {args['b']} are the same")
    hunks: list[list[str]] = []
    for line in diff[2:]:
        if line.startswith("@@"):
            hunks.append([])
        hunks[-1].append(line)
    if "match" in args:
        hunks = [hunk for hunk in hunks if any(args["match"] in line for line in hunk)]
        if not hunks:
            raise RegionError(f"no hunk of the diff of {args['a']} and {args['b']} contains '{args['match']}'")
    return fence("\n".join(diff[:2] + [line for hunk in hunks for line in hunk]), "diff")


def gen_diffstat(ctx: Context, args: dict) -> str:
    base_name = args["base"]
    base = ctx.site.file(base_name).read_text().splitlines()
    names = sorted(ctx.site.relative(Path(path)) for path in glob.glob(str(ctx.site.root / args["files"]))
                   if Path(path).is_file())
    names = [name for name in names if name != ctx.site.relative(ctx.site.root / base_name)]
    if not names:
        raise RegionError(f"diffstat: files={args['files']} matches no file besides the base")
    rows = []
    for name in names:
        lines = ctx.site.file(name).read_text().splitlines()
        changes = list(difflib.unified_diff(base, lines, n=0, lineterm=""))[2:]
        added = sum(1 for line in changes if line.startswith("+"))
        removed = sum(1 for line in changes if line.startswith("-"))
        rows.append([f"`{name}`", f"{len(lines):,}", f"+{added:,}", f"-{removed:,}"])
    table = markdown_table(["file", "lines", "added", "removed"], rows, [False, True, True, True])
    return f"{table}\n\nLines added and removed against `{base_name}` ({len(base):,} lines), as difflib counts them."


def gen_commands(ctx: Context, args: dict) -> str:
    return commands_block(ctx.site.runs(args["runs"]))


def gen_hardware(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    commits = distinct(run.summary.get("commit") for run in runs) or ["not recorded"]
    return f"{device_text(runs)}; {world_sizes_text(runs)}; {software_text(runs)}; commit {', '.join(commits)}"


def parameters_text(count: int) -> str:
    return f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"


# Settings that make a run deliberately compute something else (to show what a mechanism prevents): such runs are
# left out of the box's parity statement.
BREAKS_PARITY = {"sync_qk_norm_grads": False}


def box_parity(runs: list[Run]) -> tuple[float, float, int] | None:
    """The largest relative per-step loss difference (first steps, all steps) between fp32 runs doing the same
    optimizer steps, against each group's single-ft run (else its first), and how many runs that covers; None
    without such a group."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        if run.steps and run.config.get("dtype") == "fp32" and \
                not any(run.config.get(key) == value for key, value in BREAKS_PARITY.items()):
            groups.setdefault(run.step_key(), []).append(run)
    first, everywhere, count = 0.0, 0.0, 0
    for group in groups.values():
        if len(group) < 2:
            continue
        group.sort(key=lambda run: run.summary.get("experiment") != "single-ft")  # single-ft is the reference
        for run in group[1:]:
            differences = loss_differences(run, group[0])
            if differences:
                first = max(first, max(differences[:PARITY_FIRST_STEPS]))
                everywhere = max(everywhere, max(differences))
        count += len(group)
    return (first, everywhere, count) if count else None


# The section of post 2 that explains, once, why each point of the box carries over to a GPU or does not.
BOX_EXPLAINED = "blogs/02-the-reference-step.md#what-cpu-numbers-can-and-cannot-tell"


def box_link(ctx: Context) -> str:
    """ " [Why](...)" to BOX_EXPLAINED, when the repository has that post (a test site may not)."""
    target = BOX_EXPLAINED.split("#")[0]
    if not (ctx.site.root / target).is_file():
        return ""
    link = "#" + BOX_EXPLAINED.split("#")[1] if ctx.page == target else ctx.link(target) + "#" + \
        BOX_EXPLAINED.split("#")[1]
    return f" [Why each point holds]({link})."


def cpu_box(ctx: Context, runs: list[Run], rss_run: Run | None) -> str:
    """One paragraph: where the runs ran, what of them carries over to GPUs and what does not (each point only when
    it applies to these runs), with the numbers of these runs."""
    hardware = runs[0].summary.get("hardware", {})
    cpus, cores = distinct(r.summary.get("hardware", {}).get("cpu") for r in runs), hardware.get("cpu_cores")
    sizes = sorted({world_size(run) for run in runs})
    ranks = [f"{size} ranks over gloo" for size in sizes if size > 1]
    processes = (["one process"] if 1 in sizes else []) + ranks
    multi = max(sizes) > 1
    carries = []
    if multi and any(rank0_collectives(run) or run.summary.get("collectives_per_step") for run in runs):
        carries.append("which collectives each strategy runs, how many and how many bytes")
    if any(run.summary.get("state_bytes_per_rank") for run in runs):
        carries.append("the model-state bytes each rank holds")
    parity = box_parity(runs)
    if parity is not None:
        first, everywhere, count = parity
        carries.append(f"loss parity (the {count} runs here that do another's steps agree in fp32 within "
                       f"{small(first)} over the first {PARITY_FIRST_STEPS} steps, {small(everywhere)} over all; the "
                       f"tests hold the first steps to {PARITY_TOLERANCE_TEXT})")
    if any(run.summary.get("bubble_fraction") is not None for run in runs):
        carries.append("bubble fractions, as ratios of times in one run, and which stage is the slow one")
    not_carried = []
    if multi:
        not_carried.append(f"speed-ups (the {max(sizes)} ranks share the {cores} cores)")
        not_carried.append("the cost of communication (gloo, through host memory, with no native reduce-scatter)")
    else:
        not_carried.append(f"speed (these are {cores} CPU cores)")
    if rss_run is None:
        candidates = [run for run in runs if run.summary.get("peak_mem_gib") is not None]
        candidates.sort(key=lambda run: (run.summary.get("model", {}).get("parameters") or 0, world_size(run),
                                         run.name))
        rss_run = candidates[0] if candidates else None
    if rss_run is not None and rss_run.summary.get("peak_mem_gib") is not None:
        parameters = rss_run.summary.get("model", {}).get("parameters")
        size = f"{parameters_text(parameters)}-parameter " if parameters else ""
        experiment = rss_run.summary.get("experiment", rss_run.name)
        named = "" if experiment == rss_run.name else f" ({rss_run.name})"
        not_carried.append(f"memory (peak RSS counts the whole process: {rss_run.summary['peak_mem_gib']:.2f} GiB "
                           f"for a {size}{experiment} run{named})")
    not_carried.append("MFU (no CPU peak)")
    lines = [f"**Measured on a CPU** ({' / '.join(cpus)}, {cores} cores; {' and '.join(processes)})."]
    if carries:
        lines.append(f"Carries over to GPUs: {'; '.join(carries)}.")
    lines.append(f"Does not: {'; '.join(not_carried)}.{box_link(ctx)}")
    return "> " + " ".join(lines)


def gpu_box(runs: list[Run]) -> str:
    shows = "step times, communication time, tokens/s and `max_memory_reserved` per device"
    if any(run.summary.get("mfu") is not None for run in runs):
        shows += ", and MFU against its dense bf16 peak"
    return (f"> **Measured on {device_text(runs)}.** These are this device's {shows}; collective counts and bytes, "
            f"model-state bytes and loss parity are the same on any device. They do not tell how other GPUs, links "
            f"(PCIe, NVLink, Infinity Fabric), models or sequence lengths would do.")


def gen_cpu_box(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    rss_run = ctx.site.run(args["rss-run"]) if "rss-run" in args else None
    on_cpu = [run for run in runs if run.summary.get("hardware", {}).get("device_kind") == "cpu"]
    on_gpu = [run for run in runs if run not in on_cpu]
    boxes = ([cpu_box(ctx, on_cpu, rss_run)] if on_cpu else []) + ([gpu_box(on_gpu)] if on_gpu else [])
    return "\n\n".join(boxes)


def gen_gpu_slot(ctx: Context, args: dict) -> str:
    recording, ctx.site.recording = ctx.site.recording, None  # the CPU runs the globs match are not quoted
    try:
        runs = ctx.site.runs(args["runs"], allow_missing=True)
    finally:
        ctx.site.recording = recording
    on_gpu = [ctx.site.run(ctx.site.relative(run.folder)) for run in runs
              if run.summary.get("hardware", {}).get("device_kind") in GPU_KINDS]
    if on_gpu:
        return gen_table(ctx, args, on_gpu)
    return (f"Not measured on a GPU yet: no run of `{args['runs']}` ran on one. The GPU commands of this page's "
            f"\"Run it\" measure them, and this table fills in when their runs are committed under devlog/data/.")


def gen_provenance(ctx: Context, args: dict) -> str:
    if not ctx.page_runs:
        raise RegionError("the page quotes no run: remove the region")
    return provenance(ctx, ctx.page_runs)


def posts_in_order(site: Site) -> list[tuple[str, str]]:
    """(title, file) of every post blogs/README.md links to, in its order."""
    index = site.root / "blogs" / "README.md"
    if not index.exists():
        raise RegionError("nav: no blogs/README.md to read the order of the posts from")
    posts = []
    for title, target in re.findall(r"\[([^\]]+)\]\((\d\d-[\w.-]+\.md)\)", index.read_text()):
        if target not in [t for _, t in posts]:
            posts.append((title, target))
    return posts


def gen_nav(ctx: Context, args: dict) -> str:
    page = Path(ctx.page)
    if page.parent.as_posix() != "blogs":
        raise RegionError("nav is for posts in blogs/")
    posts = posts_in_order(ctx.site)
    files = [target for _, target in posts]
    if page.name not in files:
        raise RegionError(f"nav: blogs/README.md does not list {page.name}: add it to the list of posts")
    position = files.index(page.name)
    links = []
    if position > 0:
        links.append(f"[← Previous: {posts[position - 1][0]}]({posts[position - 1][1]})")
    links.append("[Index](README.md)")
    if position + 1 < len(posts):
        links.append(f"[Next: {posts[position + 1][0]} →]({posts[position + 1][1]})")
    return " · ".join(links)


def gen_figure(ctx: Context, args: dict) -> str:
    name = args["name"]
    if name not in FIGURES:
        raise RegionError(f"figure: unknown figure '{name}'; assets/make_plots.py has {', '.join(FIGURES)}")
    figure = FIGURES[name]
    ctx.figures.setdefault(name, ctx.line)
    runs, missing = make_plots.figure_runs(figure, ctx.site.root)
    if missing:
        raise RegionError(f"figure {name}: no run folder matches {', '.join(missing)}")
    for run in runs:
        ctx.site.run(ctx.site.relative(run.folder))  # the committed check
    png, csv_path = f"{PLOTS_DIR.as_posix()}/{name}.png", f"{PLOTS_DIR.as_posix()}/{name}.csv"
    source = "" if runs else ": a prediction of common/memory, not a measurement"
    return f"![{figure.title}]({ctx.link(png)})\n\n[The figure's data ({name}.csv)]({ctx.link(csv_path)}){source}."


# KIND -> (generator, required arguments, optional arguments, may stand inline in a line of prose)
GENERATORS: dict[str, tuple[Callable[[Context, dict], str], tuple[str, ...], tuple[str, ...], bool]] = {
    "table": (gen_table, ("runs",), ("cols", "sort", "label", "ref"), False),
    "value": (gen_value, (), ("*",), True),
    "parity": (gen_parity, ("runs", "ref"), (), False),
    "collectives": (gen_collectives, ("runs",), (), False),
    "state": (gen_state, ("runs",), (), False),
    "bubble": (gen_bubble, ("runs",), (), False),
    "sweep": (gen_sweep, ("run-dir",), (), False),
    "memory-cli": (gen_memory_cli, ("args",), (), False),
    "memory-table": (gen_memory_table, ("cases",), ("strategies",), False),
    "answer-table": (gen_answer_table, ("cases", "reference"), ("measured",), False),
    "code": (gen_code, ("file",), ("symbol", "start", "end", "lang"), False),
    "diff": (gen_diff, ("a", "b"), ("match", "context"), False),
    "diffstat": (gen_diffstat, ("base", "files"), (), False),
    "commands": (gen_commands, ("runs",), (), False),
    "hardware": (gen_hardware, ("runs",), (), True),
    "cpu-box": (gen_cpu_box, ("runs",), ("rss-run",), False),
    "gpu-slot": (gen_gpu_slot, ("runs",), ("cols", "sort", "label", "ref"), False),
    "nav": (gen_nav, (), (), True),
    "figure": (gen_figure, ("name",), (), False),
    "provenance": (gen_provenance, (), (), False),
}


def generate(ctx: Context, region: Region) -> str:
    """The content of a region (without the markers)."""
    if region.kind not in GENERATORS:
        raise RegionError(f"unknown generator '{region.kind}'; there are: {', '.join(GENERATORS)}")
    function, required, optional, inline_ok = GENERATORS[region.kind]
    missing = [key for key in required if key not in region.args]
    unknown = [key for key in region.args if key not in required + optional] if "*" not in optional else []
    if missing or unknown:
        raise RegionError(f"{region.kind} needs {', '.join(required) or 'no arguments'}"
                          + (f" and takes {', '.join(optional)}" if optional else "")
                          + (f"; missing: {', '.join(missing)}" if missing else "")
                          + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    if region.inline and not inline_ok:
        raise RegionError(f"{region.kind} writes a block: put its opening and closing comments on their own lines")
    content = function(ctx, dict(region.args))
    if region.inline:
        if "\n" in content:
            raise RegionError(f"{region.kind} gave more than one line: make it a block region")
        return content
    body = "\n".join(region.indent + line if line else "" for line in content.split("\n"))
    return f"\n{body}\n\n"


# ---------------------------------------------------------------------------------------------------------------
# Pages: regenerate the regions, then check links and hand-typed numbers


@dataclass
class Page:
    path: str  # relative to the repository root
    text: str  # as it is on disk
    regenerated: str  # with every region that could be generated rewritten
    errors: list[str]
    figures: dict[str, int]  # figures the page shows (by a region or a link) -> the line


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
    pieces, cursor = [], 0
    for index, region in enumerate(regions):
        pieces += [text[cursor:region.start], contents[index]]
        cursor = region.end
    pieces.append(text[cursor:])
    regenerated = "".join(pieces)
    if not check:
        regenerated = keep_values_in_their_paragraphs(regenerated)
    figures = dict(ctx.figures)
    # Checking, the page as it is (what readers see); writing, the page as it is about to be.
    shown = text if check else regenerated
    shown_regions = find_regions(shown)[0]
    errors += lint(site, path, shown, shown_regions, figures)
    errors += [f"{path}:{line}: {message}" for line, message in values_outside_paragraphs(shown, shown_regions, check)]
    return Page(path, text, regenerated, errors, figures)


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
    `required` (the check), else nothing (writing a page on a machine without it, such as the GPU suite's)."""
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
                          f"a word before it on that line (assets/make_posts.py joins such a line to the one before "
                          f"when it writes)")
            for region in inline if region.line - 1 in outside]


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_SOURCE = re.compile(r"<(?:img|a|source)\b[^>]*?\s(?:src|href)=[\"']([^\"']+)[\"']", re.I)
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
    site.current_text = text
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
            error = check_link(site, page_folder, target, figures, number)
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


def check_link(site: Site, page_folder: Path, target: str, figures: dict[str, int], line: int) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
        return None  # a URL (https:, mailto:)
    from urllib.parse import unquote

    clean = unquote(target.split("#")[0].split("?")[0])
    anchor = unquote(target.split("#", 1)[1]) if "#" in target else ""
    if not clean:
        if anchor and site.current_text is not None and anchor not in heading_anchors(site.current_text):
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


# ---------------------------------------------------------------------------------------------------------------
# Figures: redraw them (full mode), or recompute their CSVs and compare (check mode)


def check_figures(site: Site, linked: dict[str, str], print_fn) -> list[str]:
    """Every figure a page shows, or whose CSV is in assets/plots: its runs committed, its CSV what they give.
    `linked`: figure name -> "page:line" where a page shows it."""
    errors = []
    for name, figure in FIGURES.items():
        csv_path = site.root / PLOTS_DIR / f"{name}.csv"
        where = linked.get(name)
        if where is None and not csv_path.exists():
            continue  # shown nowhere and never drawn: nothing to keep in step
        rows, why = make_plots.figure_rows(figure, site.root)
        if rows is None:
            if where:
                errors.append(f"{where}: figure {name} cannot be made: {why}")
            else:
                print_fn(f"note: figure {name} not checked: {why}")
            continue
        try:
            for run in make_plots.figure_runs(figure, site.root)[0]:
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
        if csv_path.read_text() != make_plots.csv_text(rows):
            source = ", ".join(figure.runs) or "common/memory"
            hint = first_difference(csv_path.read_text(), make_plots.csv_text(rows), "the CSV")
            errors.append(f"{PLOTS_DIR}/{name}.csv: differs from what its runs give ({source}): {hint}; "
                          f"run assets/make_posts.py")
    return errors


def pages(root: Path) -> list[str]:
    return [path.relative_to(root).as_posix() for pattern in PAGE_GLOBS for path in sorted(root.glob(pattern))]


def referenced_figures(text: str) -> list[str]:
    """Figures a page shows, found without generating it (to draw them before the page's links are checked)."""
    names = re.findall(r"generated:figure\s+name=[\"']?([\w-]+)", text)
    names += re.findall(rf"{re.escape(PLOTS_DIR.as_posix())}/([\w-]+)\.(?:png|csv)", text)
    return [name for name in dict.fromkeys(names) if name in FIGURES]


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
            make_plots.pyplot()
        except ImportError:
            print_fn("drawing the figures needs matplotlib: uv run --group plots python assets/make_posts.py "
                     "(or --no-figures for the regions only)")
            return 1
        make_plots.draw_series(root, wanted, print_fn=lambda line: print_fn(f"figure {line}"))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="regenerate in memory and fail where a page or a figure's CSV differs (CI); no matplotlib")
    parser.add_argument("--only", metavar="FILE", help="only this page (and, unless --check, the figures it shows)")
    parser.add_argument("--no-figures", action="store_true",
                        help="do not redraw the figures (no matplotlib needed); --check always compares their CSVs")
    args = parser.parse_args(argv)
    return 1 if build(REPO_ROOT, check=args.check, only=args.only, figures=not args.no_figures) else 0


if __name__ == "__main__":
    sys.exit(main())
