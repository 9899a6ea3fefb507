"""Plots for the devlog and the posts, made only from runs' summary.json and metrics.jsonl (never typed-in numbers).

    uv run --group plots python assets/make_plots.py runs/sweep-cpu-small --out assets/plots
    uv run --group plots python assets/make_plots.py runs/single-ft-A runs/fsdp-ft-B runs/pp-ft-C --out assets/plots

Each argument is a run folder (holding summary.json) or any folder above run folders (a sweep folder): every
summary.json below it is one run. Writes, into --out:
- loss_curves.png: loss per step of every run, and each run's relative difference from the reference run
  (single-ft when present) doing the same step, against the 1e-5 the parity tests allow (fp32);
- throughput_memory.png: tokens/s and peak memory per run (bars);
- memory_predicted.png: measured peak memory next to summary.json's `predicted_peak_mem_gib` (common/memory.py),
  for the runs that have it;
- pp_bubble.png: measured bubble fraction of pp-ft runs against the number of micro-batches m, with the
  textbook (p-1)/(m+p-1) of GPipe and 1F1B.
A plot whose data no run has is skipped with a note, not drawn empty.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed (CI, ssh sessions)
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

PARITY_RELATIVE_TOLERANCE = 1e-5  # the tests' bound: fp32 per-step losses match single-ft within this
SMALLEST_SHOWN_DIFFERENCE = 1e-12  # a log axis cannot show 0: exact matches are drawn at this floor
# Config fields that, with the model and T_eff, fix every step's rows and update. A run whose config lacks one
# (TRL's in the peer baseline, which packs its own way) is never taken for a twin of one that has it.
STEP_SETTINGS = ("data", "seq_len", "seed", "eval_fraction", "packing", "dtype", "lr", "warmup_steps",
                 "weight_decay", "max_grad_norm", "lora_rank")


@dataclass
class Run:
    folder: Path
    summary: dict
    steps: list[dict]  # metrics.jsonl records
    label: str = ""

    @property
    def config(self) -> dict:
        return self.summary.get("config", {})

    def step_key(self) -> tuple:
        """Runs with the same key did the same optimizer steps (the parity the tests check): the same model and
        tokens per step, and the same value for every setting that fixes the rows and the update."""
        return (self.summary.get("model", {}).get("name"), self.summary.get("t_eff"),
                *(self.config.get(key) for key in STEP_SETTINGS))


def find_runs(paths: list[Path]) -> list[Run]:
    """Every run folder at or below the given paths, in the order given (then sorted within a folder)."""
    runs = []
    for path in paths:
        if not path.exists():
            raise SystemExit(f"{path}: no such folder")
        summaries = [path / "summary.json"] if (path / "summary.json").exists() else sorted(path.rglob("summary.json"))
        for summary_path in summaries:
            metrics_path = summary_path.parent / "metrics.jsonl"
            steps = ([json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
                     if metrics_path.exists() else [])
            runs.append(Run(summary_path.parent, json.loads(summary_path.read_text()), steps))
    if not runs:
        raise SystemExit(f"no summary.json under {', '.join(map(str, paths))}")
    # The experiment's name where it is unique, else the folder name (sweep cells' names say what differs).
    names = [run.summary.get("experiment", run.folder.name) for run in runs]
    for run, name in zip(runs, names):
        run.label = name if names.count(name) == 1 else run.folder.name
    return runs


# ---------------------------------------------------------------------------------------------------------------
# The plots


def plot_loss_curves(runs: list[Run], out: Path) -> str:
    with_steps = [run for run in runs if run.steps]
    if not with_steps:
        return "loss_curves.png skipped: no run has metrics.jsonl records"
    figure, (curves, differences) = plt.subplots(1, 2, figsize=(13, 4.8))
    # Lines that coincide (the point of a parity plot) stay visible: thinner and dashed as the list goes on.
    for index, run in enumerate(with_steps):
        curves.plot([r["step"] for r in run.steps], [r["loss"] for r in run.steps], label=run.label,
                    color=plt.cm.tab20(index % 20),  # 20 distinct colours: a sweep easily has more than 10 runs
                    linewidth=max(0.8, 3.0 - 0.5 * index), linestyle=("-", "--", "-.", ":")[index % 4], marker=".")
    curves.set(xlabel="optimizer step", ylabel="training loss (token-weighted)", title="Loss per step")
    curves.legend(fontsize="small")

    compared: list[tuple[Run, Run]] = []
    for run in with_steps:
        references = [ref for ref in with_steps if ref is not run and ref.step_key() == run.step_key()]
        references.sort(key=lambda ref: ref.summary.get("experiment") != "single-ft")
        if not references or run.summary.get("experiment") == "single-ft" or (references[0], run) in compared:
            continue
        reference = {r["step"]: r["loss"] for r in references[0].steps}
        pairs = [(r["step"], abs(r["loss"] - reference[r["step"]]) / abs(reference[r["step"]]))
                 for r in run.steps if r["step"] in reference]
        differences.plot([step for step, _ in pairs], [max(d, SMALLEST_SHOWN_DIFFERENCE) for _, d in pairs],
                         marker="o", label=f"{run.label} vs {references[0].label}")
        compared.append((run, references[0]))
    differences.axhline(PARITY_RELATIVE_TOLERANCE, color="red", linestyle="--", label="test tolerance (fp32)")
    differences.set(yscale="log", xlabel="optimizer step", ylabel="|loss - reference| / reference",
                    title="Difference from the reference on the same steps")
    for axis in (curves, differences):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if not compared:
        differences.text(0.5, 0.5, "no two runs did the same steps\n(same model, seq_len, seed, T_eff, dtype, lr)",
                         ha="center", va="center", transform=differences.transAxes)
    differences.legend(fontsize="small")
    return save(figure, out / "loss_curves.png")


def plot_throughput_memory(runs: list[Run], out: Path) -> str:
    measured = [run for run in runs if run.summary.get("tokens_per_s") is not None]
    if not measured:
        return "throughput_memory.png skipped: no run has tokens_per_s"
    labels = [run.label for run in measured]
    # Horizontal bars: run labels (sweep cell names) are long and stay readable on the y axis.
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(13, 1.5 + 0.4 * len(measured)), sharey=True)
    bars = speed.barh(labels, [run.summary["tokens_per_s"] for run in measured], color="tab:blue")
    speed.bar_label(bars, fmt="{:,.0f}", fontsize="small")
    speed.set(xlabel="tokens/s (real tokens, all ranks)", title="Throughput")
    bars = memory.barh(labels, [run.summary.get("peak_mem_gib") or 0.0 for run in measured], color="tab:orange")
    memory.bar_label(bars, fmt="{:.2f}", fontsize="small")
    memory.set(xlabel="GiB per device", title=f"Peak memory ({measured[0].summary.get('memory_measure', '?')})")
    speed.invert_yaxis()  # first run on top, as listed
    return save(figure, out / "throughput_memory.png")


def plot_memory_predicted(runs: list[Run], out: Path) -> str:
    predicted = [run for run in runs if run.summary.get("predicted_peak_mem_gib") is not None]
    if not predicted:
        return "memory_predicted.png skipped: no summary.json has predicted_peak_mem_gib"
    figure, axis = plt.subplots(figsize=(max(7, 1.2 * len(predicted) + 3), 4.8))
    positions = range(len(predicted))
    width = 0.4
    axis.bar([p - width / 2 for p in positions], [run.summary.get("peak_mem_gib") or 0.0 for run in predicted],
             width, label=f"measured ({predicted[0].summary.get('memory_measure', '?')})")
    axis.bar([p + width / 2 for p in positions], [run.summary["predicted_peak_mem_gib"] for run in predicted],
             width, label="predicted (common/memory.py)")
    axis.set_xticks(list(positions), [run.label for run in predicted], rotation=30, ha="right")
    axis.set(ylabel="GiB per device", title="Peak memory: measured vs predicted")
    axis.legend()
    return save(figure, out / "memory_predicted.png")


def plot_pp_bubble(runs: list[Run], out: Path) -> str:
    pipelined = [run for run in runs if run.summary.get("bubble_fraction") is not None]
    if not pipelined:
        return "pp_bubble.png skipped: no summary.json has bubble_fraction (pp-ft runs)"
    figure, axis = plt.subplots(figsize=(7, 4.8))
    by_schedule: dict[str, list[Run]] = {}
    for run in pipelined:
        pipeline = run.summary["pipeline"]
        by_schedule.setdefault(f"{pipeline['schedule']} (p={pipeline['ranks']})", []).append(run)
    for schedule, members in sorted(by_schedule.items()):
        members.sort(key=lambda run: run.summary["pipeline"]["microbatches"])
        m_values = [run.summary["pipeline"]["microbatches"] for run in members]
        line, = axis.plot(m_values, [run.summary["bubble_fraction"] for run in members], marker="o",
                          label=f"measured: {schedule}")
        # Schedules with their own formula (interleaved, zero-bubble): the run's textbook value, same colour.
        own_formula = [run for run in members if run.summary.get("bubble_formula") != "(p-1)/(m+p-1)"]
        if own_formula:
            axis.plot([run.summary["pipeline"]["microbatches"] for run in own_formula],
                      [run.summary["bubble_fraction_textbook"] for run in own_formula], marker="x", linestyle=":",
                      color=line.get_color(), label=f"textbook: {own_formula[0].summary.get('bubble_formula')}")
    all_m = sorted({run.summary["pipeline"]["microbatches"] for run in pipelined})
    m_range = [all_m[0] * (all_m[-1] / all_m[0]) ** (i / 50) for i in range(51)]
    for p in sorted({run.summary["pipeline"]["ranks"] for run in pipelined}):
        axis.plot(m_range, [(p - 1) / (m + p - 1) for m in m_range], color="gray", linestyle="--",
                  label=f"textbook (p-1)/(m+p-1), p={p}")
    axis.set_xscale("log", base=2)
    axis.set_xticks(all_m, [str(m) for m in all_m])
    axis.set(xlabel="micro-batches per step m (--grad-accum)", ylabel="bubble fraction (idle / schedule time)",
             title="Pipeline bubble", ylim=(0, 1))
    axis.legend(fontsize="small")
    return save(figure, out / "pp_bubble.png")


def save(figure, path: Path) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"wrote {path}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, or folders above them (a sweep)")
    parser.add_argument("--out", type=Path, default=Path("assets/plots"))
    args = parser.parse_args(argv)
    runs = find_runs(args.runs)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(runs)} runs: {', '.join(run.label for run in runs)}")
    for plot in (plot_loss_curves, plot_throughput_memory, plot_memory_predicted, plot_pp_bubble):
        print(plot(runs, args.out))


if __name__ == "__main__":
    main()
