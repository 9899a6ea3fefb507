"""Sweep: run a grid of real training runs (strategy x micro-batch x grad-accum x checkpointing x dtype) and
write a table of step_ms, comm_ms, tokens/s and peak memory per cell for a devlog.

    uv run python -m common.sweep --grid cpu-small                          # a few minutes on a 2-core CPU
    uv run python -m common.sweep --grid t-eff-100k --out runs/sweep-100k   # two GPUs, T_eff = 102,400 tokens
    uv run python -m common.sweep --grid pp-bubble                          # pipeline bubble vs micro-batches
    uv run python -m common.sweep --strategies single-ft fsdp-ft zero-ft:2 pp-ft:1f1b --micro-batch-sizes 1 2 \\
        --grad-accums 4 --checkpointing off on --dtypes bf16 --model Qwen/Qwen3-0.6B-Base --seq-len 1024 --steps 20
    uv run python -m common.sweep --grid cpu-small --dry-run                # print the cells and their commands

Each cell is one run of an experiment script exactly as a user would launch it: `python experiments/single-ft/
train.py ...` for single-ft, `python -m torch.distributed.run --standalone --nproc_per_node=N ...` for the others.
A strategy is an experiment name with an optional strategy flag after a colon: `zero-ft:2` adds `--zero-stage 2`,
`pp-ft:1f1b` adds `--schedule 1f1b`. Every cell writes metrics.jsonl, summary.json and its console output
(train.log) to its own folder under --out; the sweep writes sweep.md (the table, ready to paste into a devlog)
and sweep.csv there.

Tokens per optimizer step: T_eff = seq_len x micro_batch_size x grad_accum x data-parallel ranks (the seed
document's definition). Only ddp-ft, fsdp-ft and zero-ft give each rank its own rows; tensor- and
pipeline-parallel ranks work on the same rows, so for them T_eff does not grow with --nproc. fsdp-tp-ft is in
between: its --nproc / tp rows of the mesh each read their own rows (tp: --tp-degree in --extra-args, else 2). Grids can
give a target T_eff (--tokens-per-step) instead of --grad-accums: each cell then gets the grad-accum that reaches it for
its own number of data-parallel ranks, so a 1-rank and a 2-rank cell do the same optimizer step.

Scaling efficiency (seed definition): tokens/s on N ranks / (N x tokens/s on 1 rank), for two cells that do the
same optimizer step (same model, seq_len, micro-batch, T_eff, checkpointing, dtype, extra args) on 1 and N ranks.
The 1-rank reference is the same strategy at --nproc 1 when the sweep has it, else single-ft.

Resume: rerunning the same command skips every cell whose summary.json exists (after checking it is the same
cell), so an interrupted sweep continues where it stopped. A failing cell does not stop the sweep: its failure
(exit status and last error line) goes into the table, its log stays in its folder, the remaining cells run, and
the sweep exits with status 1 at the end. A rerun retries the failed cells.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# The strategy flag a `name:value` spec sets, per experiment.
STRATEGY_FLAGS = {"zero-ft": "--zero-stage", "pp-ft": "--schedule"}
# Experiments whose ranks each take their own rows of the step (data parallel); the others split the model.
DATA_PARALLEL = {"ddp-ft", "fsdp-ft", "zero-ft"}
# Experiments whose ranks share rows in groups of this many (the default tensor-parallel degree; a --tp-degree in
# the cell's extra args overrides it): each group reads its own rows.
TENSOR_PARALLEL_DEGREE = {"fsdp-tp-ft": 2}


# ---------------------------------------------------------------------------------------------------------------
# Cells and grids


@dataclass(frozen=True)
class Cell:
    """One run of the sweep: the settings that go on its command line."""
    strategy: str  # experiment name, optionally with a strategy flag value: "fsdp-ft", "zero-ft:2", "pp-ft:1f1b"
    nproc: int  # ranks (processes) the run is launched with
    micro_batch_size: int  # rows per forward per rank
    grad_accum: int  # micro-batches per optimizer step per rank (pipeline: micro-batches in flight)
    activation_checkpointing: bool
    dtype: str  # bf16 | fp32
    model: str
    seq_len: int  # tokens per packed row
    steps: int  # optimizer steps
    extra_args: tuple[str, ...] = ()  # appended to every cell's command line

    @property
    def experiment(self) -> str:
        return self.strategy.split(":", 1)[0]

    @property
    def data_parallel_ranks(self) -> int:
        if self.experiment in TENSOR_PARALLEL_DEGREE:
            args = list(self.extra_args)
            tp = int(args[args.index("--tp-degree") + 1]) if "--tp-degree" in args[:-1] \
                else TENSOR_PARALLEL_DEGREE[self.experiment]
            return max(1, self.nproc // tp)
        return self.nproc if self.experiment in DATA_PARALLEL else 1

    @property
    def tokens_per_step(self) -> int:
        """T_eff: token slots per optimizer step over all ranks (real tokens are fewer by the packing efficiency)."""
        return self.seq_len * self.micro_batch_size * self.grad_accum * self.data_parallel_ranks

    @property
    def name(self) -> str:
        """The cell's folder name: every setting that varies inside a sweep, readable in a file listing."""
        return (f"{self.strategy.replace(':', '-')}_n{self.nproc}_mb{self.micro_batch_size}_ga{self.grad_accum}"
                f"_ckpt{'T' if self.activation_checkpointing else 'F'}_{self.dtype}")


@dataclass
class Grid:
    """The axes of a sweep; every combination is one cell. Give grad_accums or tokens_per_step, not both."""
    strategies: list[str]
    micro_batch_sizes: list[int]
    checkpointing: list[bool]
    dtypes: list[str]
    model: str
    seq_len: int
    steps: int
    nproc: list[int] = field(default_factory=lambda: [2])  # ranks for multi-rank strategies; single-ft always runs 1
    grad_accums: list[int] | None = None
    tokens_per_step: int | None = None  # target T_eff; each cell's grad-accum is derived from it


GRIDS: dict[str, Grid] = {
    # CPU: the three data-parallel-capable scripts and the reference on qwen3-tiny, every cell doing the same
    # 512-token step, so both ddp-ft and fsdp-ft get a scaling efficiency against single-ft. A few minutes on 2 cores.
    "cpu-small": Grid(strategies=["single-ft", "ddp-ft", "fsdp-ft"], micro_batch_sizes=[1, 2],
                      checkpointing=[False], dtypes=["fp32"], model="qwen3-tiny", seq_len=128, steps=4,
                      tokens_per_step=512),
    # The setting of a published 2x MI100 Qwen3-0.6B SFT demo: T_eff = 1024 x 1 x 50 x 2 = 102,400 tokens per step on
    # two GPUs. 102,400 is 100 rows of 1024, which splits exactly into micro x GA x data-parallel ranks for micro 1, 2
    # and 5 (so every strategy does exactly the same step, and single-ft, at GA 100/micro, is the 1-rank reference). 34
    # steps = 2 timing warm-up steps + 32 measured steps.
    "t-eff-100k": Grid(strategies=["single-ft", "ddp-ft", "fsdp-ft", "zero-ft:2", "pp-ft:1f1b"],
                       micro_batch_sizes=[1, 2, 5], checkpointing=[True], dtypes=["bf16"],
                       model="Qwen/Qwen3-0.6B-Base", seq_len=1024, steps=34, tokens_per_step=102_400),
    # Pipeline bubble against the number of micro-batches m (summary.json's bubble_fraction; plotted by
    # assets/make_plots.py next to the textbook (p-1)/(m+p-1)).
    "pp-bubble": Grid(strategies=["pp-ft:gpipe", "pp-ft:1f1b"], micro_batch_sizes=[1], grad_accums=[2, 4, 8, 16],
                      checkpointing=[False], dtypes=["bf16"], model="Qwen/Qwen3-0.6B-Base", seq_len=1024, steps=12),
}


def parse_strategy(spec: str) -> tuple[str, list[str]]:
    """`zero-ft:2` -> ("zero-ft", ["--zero-stage", "2"]); `fsdp-ft` -> ("fsdp-ft", [])."""
    experiment, _, value = spec.partition(":")
    if not (REPO_ROOT / "experiments" / experiment / "train.py").exists():
        raise ValueError(f"strategy '{spec}': no experiments/{experiment}/train.py")
    if not value:
        return experiment, []
    if experiment not in STRATEGY_FLAGS:
        raise ValueError(f"strategy '{spec}': {experiment} takes no ':value' (only "
                         f"{', '.join(f'{e}:<{f[2:]}>' for e, f in STRATEGY_FLAGS.items())} do)")
    return experiment, [STRATEGY_FLAGS[experiment], value]


def derived_grad_accum(tokens_per_step: int, seq_len: int, micro_batch_size: int, data_parallel_ranks: int) -> int:
    """The grad-accum that makes T_eff = tokens_per_step; an error when no whole number does."""
    rows_per_micro_step = seq_len * micro_batch_size * data_parallel_ranks
    if tokens_per_step % rows_per_micro_step:
        raise ValueError(f"--tokens-per-step {tokens_per_step:,} is not a multiple of seq_len {seq_len} x micro-batch "
                         f"{micro_batch_size} x {data_parallel_ranks} data-parallel rank(s): choose micro-batch sizes "
                         f"that divide it")
    return tokens_per_step // rows_per_micro_step


def expand(grid: Grid, extra_args: tuple[str, ...] = ()) -> list[Cell]:
    """Every cell of the grid, ordered by strategy, nproc, micro-batch, checkpointing, dtype, grad-accum."""
    if (grid.grad_accums is None) == (grid.tokens_per_step is None):
        raise ValueError("give either grad-accums or a tokens-per-step target, not both and not neither")
    if grid.steps < 1:
        raise ValueError(f"--steps must be at least 1 (a sweep measures training steps), got {grid.steps}")
    cells: list[Cell] = []
    for strategy, nproc, micro, checkpointing, dtype in itertools.product(
            grid.strategies, grid.nproc, grid.micro_batch_sizes, grid.checkpointing, grid.dtypes):
        parse_strategy(strategy)  # fail before anything runs
        ranks = 1 if strategy == "single-ft" else nproc
        base = Cell(strategy, ranks, micro, 1, checkpointing, dtype, grid.model, grid.seq_len, grid.steps,
                    tuple(extra_args))
        if grid.tokens_per_step is None:
            accums = grid.grad_accums
        else:
            accums = [derived_grad_accum(grid.tokens_per_step, grid.seq_len, micro, base.data_parallel_ranks)]
        for grad_accum in accums:
            cell = replace(base, grad_accum=grad_accum)
            if cell not in cells:  # single-ft appears once however many --nproc values there are
                cells.append(cell)
    return cells


def command(cell: Cell, out_dir: Path) -> list[str]:
    """The exact argv of one cell, run from the repository root."""
    experiment, strategy_flags = parse_strategy(cell.strategy)
    script = f"experiments/{experiment}/train.py"
    if experiment == "single-ft":
        launcher = [sys.executable, script]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cell.nproc}",
                    script]
    flags = ["--model", cell.model, "--seq-len", str(cell.seq_len), "--steps", str(cell.steps),
             "--micro-batch-size", str(cell.micro_batch_size), "--grad-accum", str(cell.grad_accum),
             "--dtype", cell.dtype]
    if cell.activation_checkpointing:
        flags.append("--activation-checkpointing")
    return launcher + flags + strategy_flags + ["--out-dir", str(out_dir)] + list(cell.extra_args)


# ---------------------------------------------------------------------------------------------------------------
# Running


def finished_summary(cell: Cell, cell_dir: Path) -> dict | None:
    """The summary.json of an earlier run of this cell, or None. Stops if the folder holds a different run."""
    path = cell_dir / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    config = summary.get("config", {})
    expected = dict(micro_batch_size=cell.micro_batch_size, grad_accum=cell.grad_accum, dtype=cell.dtype,
                    activation_checkpointing=cell.activation_checkpointing, seq_len=cell.seq_len, steps=cell.steps)
    if cell.model != "auto":  # summary.json holds the resolved name
        expected["model"] = cell.model
    different = {key: (config.get(key), value) for key, value in expected.items() if config.get(key) != value}
    world_size = summary.get("hardware", {}).get("world_size")
    if world_size != cell.nproc:
        different["world_size"] = (world_size, cell.nproc)
    if different:
        details = ", ".join(f"{key} {found} (this sweep: {wanted})" for key, (found, wanted) in different.items())
        raise SystemExit(f"{path} is from a different run: {details}. Use another --out, or delete that folder.")
    return summary


def last_error_line(log: Path) -> str:
    """The line of a failed run's log that most likely says why (the last one naming an error)."""
    # The first line is the command the sweep wrote, not the run's output.
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()[1:] if line.strip()]
    errors = [line for line in lines if re.search(r"Error|Exception|error:|Killed", line)]
    text = (errors or lines or ["(no output)"])[-1]
    return text if len(text) <= 160 else text[:157] + "..."


def run_cell(cell: Cell, cell_dir: Path) -> dict:
    """Run one cell, its console output into cell_dir/train.log. Returns {"summary": ...} or {"error": ...}."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    argv = command(cell, cell_dir)
    log = cell_dir / "train.log"
    with open(log, "w") as handle:
        handle.write(f"$ {shlex.join(argv)}\n")
        handle.flush()
        # check=False: a failed cell is recorded in the table, and the sweep goes on.
        returncode = subprocess.run(argv, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                    check=False).returncode
    if returncode == 0 and (cell_dir / "summary.json").exists():
        return {"summary": json.loads((cell_dir / "summary.json").read_text())}
    reason = f"exit {returncode}" if returncode else "exit 0 but no summary.json"
    return {"error": f"{reason}: {last_error_line(log)}"}


def format_duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def run_sweep(cells: list[Cell], out: Path, print_fn=print) -> dict[Cell, dict]:
    """Run (or skip, if finished) every cell in order, printing progress. Returns each cell's result."""
    results: dict[Cell, dict] = {}
    to_run = []
    for cell in cells:
        summary = finished_summary(cell, out / cell.name)
        if summary is None:
            to_run.append(cell)
        else:
            results[cell] = {"summary": summary}
    if results:
        print_fn(f"resume: {len(results)} of {len(cells)} cells already have a summary.json in {out}; skipping them")
    started = time.perf_counter()
    for done, cell in enumerate(to_run):
        elapsed_s = time.perf_counter() - started
        # The estimate assumes the remaining cells take as long as the mean of those run so far.
        remaining = f", ~{format_duration(elapsed_s / done * (len(to_run) - done))} remaining" if done else ""
        print_fn(f"[{cells.index(cell) + 1}/{len(cells)}] {cell.name} (T_eff {cell.tokens_per_step:,}) | "
                 f"elapsed {format_duration(elapsed_s)}{remaining} | log: {out / cell.name / 'train.log'}")
        cell_started = time.perf_counter()
        results[cell] = result = run_cell(cell, out / cell.name)
        took = format_duration(time.perf_counter() - cell_started)
        if "error" in result:
            print_fn(f"    FAILED after {took}: {result['error']}")
        else:
            summary = result["summary"]
            print_fn(f"    done in {took}: {summary['tokens_per_s']:,.0f} tok/s, step_ms {summary['step_ms']:,.0f}, "
                     f"final loss {summary['final_loss']:.4f}")
    return {cell: results[cell] for cell in cells}


# ---------------------------------------------------------------------------------------------------------------
# The table


def scaling_efficiencies(results: dict[Cell, dict]) -> dict[Cell, tuple[float, Cell]]:
    """For each multi-rank cell with a 1-rank cell doing the same step: (tokens/s / (N x 1-rank tokens/s), ref)."""
    finished = {cell: result["summary"] for cell, result in results.items() if "summary" in result}

    def same_step(cell: Cell) -> tuple:
        # The run's own T_eff: extra args (pp-ds-ft's --stages, say) can make it differ from the planned one.
        tokens_per_step = finished[cell].get("t_eff", cell.tokens_per_step)
        return (cell.model, cell.seq_len, cell.micro_batch_size, tokens_per_step, cell.activation_checkpointing,
                cell.dtype, cell.extra_args)

    efficiencies = {}
    for cell, summary in finished.items():
        if cell.nproc == 1:
            continue
        references = [ref for ref in finished if ref.nproc == 1 and same_step(ref) == same_step(cell)]
        # Prefer the same script on one rank (the strategy's own overhead cancels), then the reference script.
        references.sort(key=lambda ref: (ref.strategy != cell.strategy, ref.strategy != "single-ft"))
        if references and summary.get("tokens_per_s") and finished[references[0]].get("tokens_per_s"):
            reference = references[0]
            ratio = summary["tokens_per_s"] / (cell.nproc * finished[reference]["tokens_per_s"])
            efficiencies[cell] = (ratio, reference)
    return efficiencies


COLUMNS = ("strategy", "nproc", "micro_bsz", "GA", "ckpt", "bf16", "step_ms", "comm_ms", "toks/s", "peak_mem_gib",
           "t_eff", "mfu", "final_loss", "scaling_eff", "scaling_ref", "status")


def table_rows(results: dict[Cell, dict]) -> list[dict]:
    """One dict per cell with the COLUMNS (numbers unformatted; None where a failed run has no value)."""
    efficiencies = scaling_efficiencies(results)
    rows = []
    for cell, result in results.items():
        summary = result.get("summary", {})
        efficiency, reference = efficiencies.get(cell, (None, None))
        rows.append({
            "strategy": cell.strategy, "nproc": cell.nproc, "micro_bsz": cell.micro_batch_size,
            "GA": cell.grad_accum, "ckpt": "T" if cell.activation_checkpointing else "F",
            "bf16": "T" if cell.dtype == "bf16" else "F",
            "step_ms": summary.get("step_ms"), "comm_ms": summary.get("comm_ms"),
            "toks/s": summary.get("tokens_per_s"), "peak_mem_gib": summary.get("peak_mem_gib"),
            # The run's own count when it ran; the planned one when it failed.
            "t_eff": summary.get("t_eff", cell.tokens_per_step), "mfu": summary.get("mfu"),
            "final_loss": summary.get("final_loss"), "scaling_eff": efficiency,
            "scaling_ref": reference.name if reference else None,
            "status": "ok" if "summary" in result else f"FAILED {result['error']}",
        })
    return rows


MARKDOWN_FORMATS = {"step_ms": ",.0f", "comm_ms": ",.0f", "toks/s": ",.0f", "peak_mem_gib": ".2f", "t_eff": ",",
                    "mfu": ".3f", "final_loss": ".4f", "scaling_eff": ".2f"}


def markdown_table(rows: list[dict]) -> str:
    columns = [c for c in COLUMNS if c != "scaling_ref"]  # the markdown names the reference inside scaling_eff
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for column in columns:
            value = row[column]
            if value is None:
                text = "-"
            elif column in MARKDOWN_FORMATS:
                text = format(value, MARKDOWN_FORMATS[column])
            else:
                text = str(value)
            if column == "scaling_eff" and value is not None:
                text += f" (vs {row['scaling_ref'].split('_')[0]})"
            cells.append(text.replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def report(results: dict[Cell, dict], sweep_command: str) -> str:
    """sweep.md: what ran, where, the table, and how to read it."""
    summaries = [result["summary"] for result in results.values() if "summary" in result]
    failed = [cell for cell, result in results.items() if "error" in result]
    first_cell = next(iter(results))
    lines = [f"# Sweep: {first_cell.model}, seq_len {first_cell.seq_len}, {first_cell.steps} steps", ""]
    if summaries:
        hardware = summaries[0].get("hardware", {})
        if hardware.get("device_kind") == "cpu":
            device = f"CPU only: {hardware.get('cpu')}, {hardware.get('cpu_cores')} cores"
        else:
            device = f"{hardware.get('device_name')} ({hardware.get('device_kind')})"
        lines.append(f"- hardware: {device}; torch {hardware.get('torch')}")
        lines.append(f"- averages exclude the first {summaries[0].get('warmup_steps_excluded')} steps of each run; "
                     f"peak_mem_gib: {summaries[0].get('memory_measure')}")
    lines.append(f"- sweep command: `{sweep_command}`")
    lines.append(f"- cells: {len(results) - len(failed)} ok, {len(failed)} failed")
    lines += ["", markdown_table(table_rows(results)), ""]
    lines.append("t_eff: tokens per optimizer step (seq_len x micro x GA x data-parallel ranks). scaling_eff: tokens/s "
                 "on N ranks / (N x tokens/s of the named 1-rank run doing the same step).")
    lines += ["", "## Commands", "", "```bash", *(summary.get("command", "?") for summary in summaries), "```"]
    if failed:
        lines += ["", "## Failed cells", ""]
        lines += [f"- {cell.name}: {results[cell]['error']} (log: {cell.name}/train.log)" for cell in failed]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Command line


def on_off(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("on", "true", "t", "1", "yes"):
        return True
    if lowered in ("off", "false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on/off, got '{text}'")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.sweep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=sorted(GRIDS), help="a named grid; the options below override its axes")
    parser.add_argument("--strategies", nargs="+", help="e.g. single-ft ddp-ft fsdp-ft zero-ft:2 pp-ft:1f1b")
    parser.add_argument("--micro-batch-sizes", nargs="+", type=int)
    parser.add_argument("--grad-accums", nargs="+", type=int)
    parser.add_argument("--tokens-per-step", type=int, help="target T_eff; derives each cell's grad-accum instead")
    parser.add_argument("--checkpointing", nargs="+", type=on_off, help="activation checkpointing: on and/or off")
    parser.add_argument("--dtypes", nargs="+", choices=["bf16", "fp32"])
    parser.add_argument("--model")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--nproc", nargs="+", type=int, help="ranks for multi-rank strategies (e.g. 1 2); default 2")
    parser.add_argument("--extra-args", default="", help="appended to every cell, e.g. \"--lr 1e-4 --attn sdpa\"")
    parser.add_argument("--out", help="the sweep folder (default runs/sweep-<grid>); rerun to resume")
    parser.add_argument("--dry-run", action="store_true", help="print the cells and their commands, run nothing")
    return parser.parse_args(argv)


def grid_from_args(args: argparse.Namespace) -> Grid:
    """The named grid (or an empty one) with every given option replacing its axis."""
    if args.grid:
        grid = replace(GRIDS[args.grid])
    else:
        missing = [name for name in ("strategies", "micro_batch_sizes", "model", "seq_len", "steps")
                   if getattr(args, name) is None]
        if missing:
            raise SystemExit(f"without --grid, give --{' --'.join(n.replace('_', '-') for n in missing)}")
        import torch  # only here: the experiments' own dtype default, bf16 on GPU, fp32 on CPU

        grid = Grid(strategies=[], micro_batch_sizes=[], checkpointing=[False],
                    dtypes=["bf16" if torch.cuda.is_available() else "fp32"], model="", seq_len=0, steps=0,
                    grad_accums=[1])
    for name in ("strategies", "micro_batch_sizes", "checkpointing", "dtypes", "model", "seq_len", "steps", "nproc"):
        if getattr(args, name) is not None:
            setattr(grid, name, getattr(args, name))
    # An explicit grad-accum list replaces a T_eff target and the other way round.
    if args.grad_accums is not None:
        grid.grad_accums, grid.tokens_per_step = args.grad_accums, None
    if args.tokens_per_step is not None:
        grid.grad_accums, grid.tokens_per_step = None, args.tokens_per_step
    return grid


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # progress lines appear at once, also when piped to tee or a file
    grid = grid_from_args(args)
    try:
        cells = expand(grid, tuple(shlex.split(args.extra_args)))
    except ValueError as error:
        raise SystemExit(f"sweep: {error}") from None
    out = Path(args.out) if args.out else REPO_ROOT / "runs" / f"sweep-{args.grid or 'custom'}"
    sweep_command = shlex.join(["uv", "run", "python", "-m", "common.sweep", *(sys.argv[1:] if argv is None else argv)])
    print(f"sweep: {len(cells)} cells -> {out}")
    if args.dry_run:
        for index, cell in enumerate(cells, start=1):
            print(f"[{index}/{len(cells)}] {cell.name} (T_eff {cell.tokens_per_step:,})\n    "
                  f"{shlex.join(command(cell, out / cell.name))}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    results = run_sweep(cells, out)
    rows = table_rows(results)
    write_csv(rows, out / "sweep.csv")
    (out / "sweep.md").write_text(report(results, sweep_command))
    print(f"\n{markdown_table(rows)}\n\nwrote {out / 'sweep.md'} and {out / 'sweep.csv'}")
    failed = [cell.name for cell, result in results.items() if "error" in result]
    if failed:
        print(f"{len(failed)} cell(s) failed: {', '.join(failed)}; their logs are in {out}/<cell>/train.log. "
              f"Rerun the same command to retry them (finished cells are skipped).")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
