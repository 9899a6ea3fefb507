"""Figures for the posts and the devlog, made only from runs' summary.json and metrics.jsonl (never typed-in numbers),
except the one labelled a prediction, which comes from common/memory.

    uv run --group plots python assets/make_plots.py                         # the series' figures -> assets/plots
    uv run --group plots python assets/make_plots.py --only pp_schedule      # one of them
    uv run --group plots python assets/make_plots.py runs/a runs/b --out /tmp/plots   # the same figures from any runs

Each figure is two functions: a data function (plotting/data.py: runs -> rows, plain dicts, no matplotlib) and a
draw function (plotting/draw.py: rows -> PNG). The rows are written as `<name>.csv` beside `<name>.png`, so every
plotted value can be read back, and `assets/make_posts.py --check` recomputes the CSVs without matplotlib. FIGURES,
at the end of this file, says which committed runs (globs under devlog/data) each figure of the series is made from;
`assets/make_posts.py` draws them all. A figure whose runs are missing, or whose runs hold none of its fields, is
skipped with a note.

The figures:
- loss_curves: the reference's loss per step, and each run's relative difference from single-ft doing the same steps,
  against the 1e-5 the parity tests allow (fp32; exact zeros on a row of their own);
- throughput_memory: tokens/s by median step and peak memory per run;
- memory_predicted: max_memory_reserved of the GPU runs beside common.memory's prediction for their settings
  (common/memory; a CPU's peak RSS counts the whole process, not the tensors the prediction models);
- state_bytes: model-state bytes per rank by kind (weights, gradients, optimizer, master), measured from the
  tensors each rank holds, beside the prediction;
- memory_breakdown: common.memory.estimate per strategy for Qwen3-0.6B and 4B on 2 x 24 GB (a prediction, no run);
- collective_bytes: MiB per optimizer step handed to each backend collective, per strategy (log scale from 1 KiB);
- fsdp_collectives: FSDP's all-gather and reduce-scatter calls per step against grad-accum (linear), measured and
  formula, for each resharding setting;
- ddp_buckets: DDP's all-reduce calls and comm_ms against the bucket size (every run a point, the line through each
  size's mean), and per step vs per micro-batch;
- tp_activations: activation MiB saved for backward by tensor parallelism with and without sequence parallelism;
- pp_bubble: the idle share of the less busy rank against m, beside the floor its stage imbalance sets
  (1 - m r / (m + r), r the ranks' busy-time ratio) and the textbook (p-1)/(m+p-1);
- pp_schedule: one traced step of each pipeline schedule as a timeline per rank (forward, backward, weight
  gradient, loss, each box labelled with its micro-batch);
- sweep: tokens/s and peak memory of every cell of a common.sweep grid, grouped by tokens per step.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from plotting.data import (collective_bytes_data, csv_text, ddp_buckets_data, fsdp_collectives_data, loss_curves_data,
                           memory_breakdown_data, memory_predicted_data, moe_data, pp_bubble_data, pp_schedule_data,
                           state_bytes_data, sweep_data, throughput_memory_data, tp_activations_data)
from plotting.draw import (draw_collective_bytes, draw_ddp_buckets, draw_fsdp_collectives, draw_loss_curves,
                           draw_memory_breakdown, draw_memory_predicted, draw_moe, draw_pp_bubble, draw_pp_schedule,
                           draw_state_bytes, draw_sweep, draw_throughput_memory, draw_tp_activations)
from run_files import Run, find_runs, load_run, run_folders

REPO_ROOT = Path(__file__).resolve().parent.parent
PLOTS_DIR = Path("assets/plots")  # relative to the repository root


@dataclass(frozen=True)
class Figure:
    name: str  # assets/plots/<name>.png and .csv
    title: str  # what the figure compares; the posts use it as the image's alt text
    runs: tuple[str, ...]  # globs of run folders relative to the repository root; () for a prediction without runs
    data: Callable[[list[Run]], list[dict]]
    draw: Callable[[list[dict], Path], None]
    from_any_runs: bool = True  # also drawn by `make_plots.py RUN_DIR ...` (the sweep's is throughput_memory there)


SERIES = "devlog/data/2026-11-23-"
FIGURES = {figure.name: figure for figure in (
    Figure("loss_curves", "Loss per step of every strategy on the workload, and its relative difference from single-ft",
           (SERIES + "workload/*",), loss_curves_data, draw_loss_curves),
    Figure("throughput_memory", "Tokens/s by median step and peak memory of every strategy on the workload, on a CPU "
                                "with qwen3-tiny",
           (SERIES + "workload/*",), throughput_memory_data, draw_throughput_memory),
    Figure("memory_predicted", "Qwen3-0.6B on one GPU: max_memory_reserved beside common/memory's prediction",
           ("devlog/data/*-gpu-suite-*/*",), memory_predicted_data, draw_memory_predicted),
    Figure("state_bytes", "Qwen3-0.6B: model-state bytes per rank by kind, measured vs predicted",
           ("devlog/data/2026-11-28-memory-0.6b/*",), state_bytes_data, draw_state_bytes),
    Figure("memory_breakdown", "Predicted memory per GPU by strategy, Qwen3-0.6B and 4B on 2 x 24 GiB (a prediction)",
           (), memory_breakdown_data, draw_memory_breakdown),
    Figure("collective_bytes", "Collective bytes per optimizer step by strategy on the workload (measured, log scale)",
           (SERIES + "workload/*",), collective_bytes_data, draw_collective_bytes),
    Figure("fsdp_collectives", "FSDP all-gather and reduce-scatter calls per step against grad-accum, with the formula",
           (SERIES + "fsdp/*",), fsdp_collectives_data, draw_fsdp_collectives),
    Figure("ddp_buckets", "DDP all-reduce calls and comm_ms against the bucket size",
           (SERIES + "ddp/*",), ddp_buckets_data, draw_ddp_buckets),
    Figure("tp_activations", "Activation MiB saved for backward: tensor parallel vs tensor + sequence parallel",
           (SERIES + "tp/*",), tp_activations_data, draw_tp_activations),
    Figure("pp_bubble", "The less busy pipeline rank's idle share against m: measured, its imbalance floor, textbook",
           (SERIES + "pp/*",), pp_bubble_data, draw_pp_bubble),
    Figure("pp_schedule", "One step of GPipe, 1F1B, interleaved 1F1B and ZBV at m = 4, per rank",
           tuple(f"{SERIES}pp/pp-ft-{schedule}-m4" for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zbv")),
           pp_schedule_data, draw_pp_schedule),
    Figure("moe", "A mixture of experts on 2 ranks: tokens per expert, and ep-ft against single-ft per step",
           ("devlog/data/2026-11-26-moe/*",), moe_data, draw_moe),
    Figure("sweep", "Sweep cells, grouped by tokens per step: tokens/s and peak memory",
           (SERIES + "sweep/*",), sweep_data, draw_sweep, from_any_runs=False),
)}


def figure_runs(figure: Figure, root: Path) -> tuple[list[Run], list[str]]:
    """The figure's runs under `root`, and the globs that matched no run folder."""
    runs, missing = [], []
    for pattern in figure.runs:
        folders = run_folders(root, pattern)
        if not folders:
            missing.append(pattern)
        runs += [load_run(folder) for folder in folders if folder not in [run.folder for run in runs]]
    return runs, missing


def figure_rows(figure: Figure, root: Path = REPO_ROOT) -> tuple[list[dict] | None, str]:
    """(rows, "") or (None, why the figure cannot be made from the runs under `root`)."""
    runs, missing = figure_runs(figure, root)
    if missing:
        return None, f"no run folder matches {', '.join(missing)}"
    rows = figure.data(runs)
    if not rows:
        return None, f"its runs ({', '.join(figure.runs)}) hold none of the fields it plots"
    return rows, ""


def write_figure(figure: Figure, rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{figure.name}.csv").write_text(csv_text(rows))
    figure.draw(rows, out / f"{figure.name}.png")


def draw_series(root: Path = REPO_ROOT, names: list[str] | None = None, print_fn=print) -> None:
    """Draw the registered figures (all, or `names`) from the runs under `root` into root/assets/plots."""
    for name in list(FIGURES) if names is None else names:
        figure = FIGURES[name]
        rows, why = figure_rows(figure, root)
        if rows is None:
            print_fn(f"{name}: skipped, {why}")
            continue
        write_figure(figure, rows, root / PLOTS_DIR)
        print_fn(f"{name}: wrote {PLOTS_DIR / name}.png and .csv ({len(rows)} rows)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path,
                        help="run folders, or folders above them (a sweep); none: the series' figures (FIGURES)")
    parser.add_argument("--out", type=Path, help="where the PNGs and CSVs go (default assets/plots)")
    parser.add_argument("--only", nargs="+", choices=sorted(FIGURES), help="draw only these figures")
    args = parser.parse_args(argv)
    if not args.runs:
        if args.out:
            parser.error("--out goes with run folders; the series' figures always go to assets/plots")
        draw_series(REPO_ROOT, args.only)
        return
    runs = find_runs(args.runs)
    out = args.out or REPO_ROOT / PLOTS_DIR
    print(f"{len(runs)} runs: {', '.join(run.label for run in runs)}")
    for name in args.only or list(FIGURES):
        figure = FIGURES[name]
        if not figure.runs or not figure.from_any_runs:
            continue  # a prediction without runs, or a series' own view of figures drawn here anyway
        rows = figure.data(runs)
        if not rows:
            print(f"{name}: skipped, no run holds the fields it plots")
            continue
        write_figure(figure, rows, out)
        print(f"{name}: wrote {out / name}.png and .csv")


if __name__ == "__main__":
    main()
