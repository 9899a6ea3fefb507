"""Draw functions: rows -> PNG, one per figure (matplotlib is imported only here, and only when drawing)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from common.comm import bubble_textbook

from .data import GIB, MIB, STATE_KINDS, imbalance_floor

PARITY_RELATIVE_TOLERANCE = 1e-5  # the tests' bound: fp32 per-step losses match single-ft within this
KIND_COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green", "loss": "tab:gray"}
KIND_NAMES = {"F": "forward", "B": "backward (input gradient under zbv)", "W": "weight gradient (zbv)",
              "loss": "loss"}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed (CI, ssh sessions)
    import matplotlib.pyplot as plt

    return plt


def save(figure, path: Path, top: float = 1.0) -> None:
    """`top` < 1 keeps that share of the height for a title and legend placed on the figure itself."""
    figure.tight_layout(rect=(0, 0, 1, top))
    figure.savefig(path, dpi=120)
    pyplot().close(figure)


def grouped(rows: list[dict], key: str) -> dict:
    """Rows by the value of `key`, in first-seen order."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(row[key], []).append(row)
    return groups


def number(value) -> float | None:
    return None if value in ("", None) else float(value)


def draw_loss_curves(rows: list[dict], path: Path) -> None:
    """Left: the reference runs' losses (the runs that do their steps lie on them, which the right panel shows).
    Right: each run's relative difference from its reference on a log axis; a difference of exactly 0 has no
    place on a log axis, so exact zeros are drawn on a row of their own below the axis' range, lines broken there."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    figure, (curves, differences) = plt.subplots(1, 2, figsize=(15, 5), width_ratios=(1, 1.1))
    runs = grouped(rows, "run")
    references = {p["reference"] for points in runs.values() for p in points if p["reference"]}
    shown = [run for run in runs if run in references or not any(p["reference"] for p in runs[run])]
    for index, run in enumerate(shown):
        followers = sorted({r for r, points in runs.items() if points[0]["reference"] == run})
        label = run + (f" (and, on the same line, {len(followers)} runs of its steps)" if followers else "")
        curves.plot([p["step"] for p in runs[run]], [p["loss"] for p in runs[run]], color=plt.cm.tab10(index),
                    label=label)
    curves.set(xlabel="optimizer step", ylabel="training loss (token-weighted)",
               title="Loss per step of the reference")
    nonzero = [number(p["relative_difference"]) for points in runs.values() for p in points
               if number(p["relative_difference"])]
    zero_row = min(nonzero + [PARITY_RELATIVE_TOLERANCE]) / 30  # below every difference drawn
    compared = 0
    for index, (run, points) in enumerate(runs.items()):
        pairs = [(p["step"], number(p["relative_difference"])) for p in points if p["reference"]]
        pairs = [(step, d) for step, d in pairs if d is not None]
        if not pairs:
            continue
        colour = plt.cm.tab20(index % 20)
        differences.plot([s for s, _ in pairs], [d if d > 0 else float("nan") for _, d in pairs], marker=".",
                         color=colour, label=f"{run} vs {points[0]['reference']}")
        exact = [s for s, d in pairs if d == 0]
        differences.scatter(exact, [zero_row] * len(exact), marker="|", color=colour, s=30)
        compared += 1
    differences.axhline(PARITY_RELATIVE_TOLERANCE, color="red", linestyle="--", label="tests' tolerance (fp32)")
    differences.set(yscale="log", xlabel="optimizer step", ylabel="|loss - reference| / reference",
                    title="Relative difference from the reference on the same steps")
    if compared:
        differences.axhline(zero_row * 3, color="grey", linewidth=0.5)
        low, high = differences.get_ylim()
        differences.set_ylim(zero_row / 3, high)
        ticks = [t for t in differences.get_yticks() if zero_row * 3 < t <= high]
        differences.set_yticks([zero_row] + ticks, ["exactly 0"] + [f"$10^{{{round(math.log10(t))}}}$"
                                                                    for t in ticks])
    else:
        differences.text(0.5, 0.5, "no two runs did the same steps", ha="center", va="center",
                         transform=differences.transAxes)
    for axis in (curves, differences):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    curves.legend(fontsize="x-small")
    differences.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the points
    save(figure, path)


def draw_bars(axis, labels: list[str], values: list[float], fmt: str, colour: str) -> None:
    bars = axis.barh(labels, values, color=colour)
    axis.bar_label(bars, fmt=fmt, fontsize="small", padding=2)
    axis.margins(x=0.18)  # room for the value labels at the bars' ends


def draw_throughput_memory(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(13, 1.5 + 0.4 * len(rows)), sharey=True)
    labels = [row["run"] for row in rows]
    # Horizontal bars: run names are long and stay readable on the y axis.
    draw_bars(speed, labels, [row["tokens_per_s_median"] for row in rows], "{:,.0f}", "tab:blue")
    where = " / ".join([", ".join(sorted({str(row[key]).upper() if key == "device_kind" else str(row[key])
                                          for row in rows})) for key in ("device_kind", "model")])
    speed.set(xlabel="tokens/s by median step (real tokens, all ranks)",
              title=f"Throughput of each run by median step ({where})")
    draw_bars(memory, labels, [row["peak_mem_gib"] or 0.0 for row in rows], "{:.2f}", "tab:orange")
    memory.set(xlabel=f"GiB per process: {rows[0]['memory_measure']}", title="Peak memory of each run (rank 0)")
    speed.invert_yaxis()  # first run on top, as listed
    save(figure, path)


def draw_memory_predicted(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(max(7, 1.1 * len(rows) + 3), 5))
    positions = list(range(len(rows)))
    width = 0.4
    measured = axis.bar([p - width / 2 for p in positions], [row["measured_peak_gib"] or 0.0 for row in rows], width,
                        label=f"measured ({rows[0]['memory_measure']})")
    predicted = axis.bar([p + width / 2 for p in positions], [row["predicted_peak_gib"] for row in rows], width,
                         label="predicted (common/memory)")
    for bars in (measured, predicted):
        axis.bar_label(bars, fmt="{:.1f}", fontsize="x-small", padding=2)
    axis.set_xticks(positions, [row["run"] for row in rows], rotation=30, ha="right")
    axis.set(ylabel="GiB per device (rank 0)",
             title="Peak memory on the GPU (max_memory_reserved) beside common/memory's prediction; measured / "
                   "predicted above each pair")
    tallest = max([row["measured_peak_gib"] or 0.0 for row in rows] + [row["predicted_peak_gib"] for row in rows])
    axis.set_ylim(0, tallest * 1.3)  # room for the legend above the bars' labels
    for position, row in zip(positions, rows):  # measured over predicted, above each pair
        if row["measured_peak_gib"]:
            axis.annotate(f"{row['measured_peak_gib'] / row['predicted_peak_gib']:.2f}x",
                          (position, max(row["measured_peak_gib"], row["predicted_peak_gib"]) + tallest * 0.07),
                          ha="center", fontsize="x-small", color="dimgray")
    axis.legend(loc="upper left", ncols=2)
    save(figure, path)


def draw_state_bytes(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    bars = grouped(rows, "run")
    labels = [f"{run}\nrank {rank}" for run, points in bars.items()
              for rank in dict.fromkeys(p["rank"] for p in points)]
    figure, axis = plt.subplots(figsize=(max(8, 0.9 * len(labels) + 3), 5.5))
    width = 0.4
    colours = dict(zip(STATE_KINDS, ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    kinds = [kind for kind in STATE_KINDS if any(number(row["measured_bytes"]) or number(row["predicted_bytes"])
                                                 for row in rows if row["kind"] == kind)]
    top = 0.0
    for offset, column, hatch, what in ((-width / 2, "measured_bytes", "", "measured"),
                                        (width / 2, "predicted_bytes", "//", "predicted")):
        bottom = [0.0] * len(labels)
        for kind in kinds:
            values = [(number(p[column]) or 0.0) / GIB for points in bars.values()
                      for p in points if p["kind"] == kind]
            axis.bar([i + offset for i in range(len(labels))], values, width, bottom=bottom, color=colours[kind],
                     hatch=hatch, edgecolor="white", label=f"{kind} ({what})")
            bottom = [b + v for b, v in zip(bottom, values)]
        top = max(top, *bottom)
    axis.set_ylim(0, top * 1.3)  # room for the legend above the tallest bar
    axis.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
    axis.set(ylabel="GiB held by the rank",
             title="Model-state bytes per rank: measured from the rank's tensors (left) vs predicted (right, hatched)")
    axis.legend(fontsize="x-small", ncol=len(kinds), loc="upper center")
    save(figure, path)


def draw_memory_breakdown(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    models = grouped(rows, "model")
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.5), squeeze=False)
    parts = [part for part in dict.fromkeys(row["part"] for row in rows)
             if any(row["gib"] for row in rows if row["part"] == part)]
    for axis, (model, points) in zip(axes[0], models.items()):
        strategies = list(dict.fromkeys(p["strategy"] for p in points))
        labels = [f"{s} (x{next(p['gpus'] for p in points if p['strategy'] == s)})" for s in strategies]
        left = [0.0] * len(strategies)
        for index, part in enumerate(parts):
            values = [next(p["gib"] for p in points if p["strategy"] == s and p["part"] == part) for s in strategies]
            axis.barh(labels, values, left=left, color=plt.cm.tab10(index), label=part)
            left = [a + b for a, b in zip(left, values)]
        axis.axvline(points[0]["usable_gib"], color="red", linestyle="--",
                     label=f"usable: {points[0]['usable_gib']:.1f} GiB of 24 GB")
        axis.invert_yaxis()
        axis.set(xlabel="GiB per GPU (predicted)", title=f"{model}: predicted memory per GPU")
        axis.legend(fontsize="x-small", loc="lower right")
    figure.suptitle("A prediction, not a measurement: common.memory.estimate, 2 x 24 GB, bf16 (fp32 master), "
                    "seq 1024, micro-batch 1; fsdp-offload keeps its model states in host memory", fontsize="medium")
    save(figure, path)


def draw_collective_bytes(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    runs = list(dict.fromkeys(row["run"] for row in rows))
    kinds = list(dict.fromkeys(row["collective"] for row in sorted(rows, key=lambda r: r["collective"])))
    figure, axis = plt.subplots(figsize=(10, 1.5 + 0.55 * len(runs)))
    height = 0.8 / len(kinds)
    for index, kind in enumerate(kinds):
        points = [(runs.index(row["run"]), row["bytes"] / MIB, row["calls"]) for row in rows
                  if row["collective"] == kind and row["bytes"] > 0]
        bars = axis.barh([y + (index - (len(kinds) - 1) / 2) * height for y, _, _ in points],
                         [max(mib, SMALLEST_SHOWN_MIB) for _, mib, _ in points], height, color=plt.cm.tab10(index),
                         label=kind)
        axis.bar_label(bars, labels=[f"{byte_text(mib * MIB)}, {calls:g} call{'s' * (calls != 1)}"
                                     for _, mib, calls in points], fontsize="xx-small", padding=2)
    axis.set_yticks(range(len(runs)), runs)
    axis.invert_yaxis()
    axis.set_xscale("log")
    largest = max(row["bytes"] for row in rows) / MIB
    axis.set_xlim(SMALLEST_SHOWN_MIB, largest * 10)  # room for the labels
    axis.set(xlabel="MiB per optimizer step handed to the collective (rank 0, measured)\nlog scale from 1 KiB: "
                    "the collectives of a few bytes sit at the left edge, labelled with their size",
             title="Collective bytes per step, by strategy")
    axis.legend(fontsize="small")
    save(figure, path)


SMALLEST_SHOWN_MIB = 1 / 1024  # collective_bytes' axis starts at 1 KiB: a few bytes would stretch it over decades


def byte_text(n_bytes: float) -> str:
    if n_bytes < 1024:
        return f"{n_bytes:,.0f} B"
    return f"{n_bytes / 1024:,.1f} KiB" if n_bytes < MIB else f"{n_bytes / MIB:,.2f} MiB"


def draw_fsdp_collectives(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    kinds = list(dict.fromkeys(row["collective"] for row in rows))
    figure, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.8), squeeze=False)
    settings = (((True, True), "reshard after forward (default)"), ((False, True), "--no-reshard-after-forward"),
                ((False, False), "--no-reshard-after-forward --no-reshard-after-backward"))
    for axis, kind in zip(axes[0], kinds):
        points = [row for row in rows if row["collective"] == kind]
        for index, (setting, label) in enumerate(settings):
            line = sorted((p for p in points if (p["reshard_after_forward"], p["reshard_after_backward"]) == setting
                           and not p["reduce_every_micro_batch"]), key=lambda p: p["grad_accum"])
            if not line:
                continue
            ga = [p["grad_accum"] for p in line]
            axis.plot(ga, [p["calls_measured"] for p in line], marker="o", color=plt.cm.tab10(index),
                      label=f"measured, {label}")
            formula = [(p["grad_accum"], number(p["calls_formula"])) for p in line
                       if number(p["calls_formula"]) is not None]
            axis.plot([g for g, _ in formula], [c for _, c in formula], linestyle="--", marker="x",
                      color=plt.cm.tab10(index), label=f"formula, {label}")
        every = [p for p in points if p["reduce_every_micro_batch"]]
        if every:
            axis.scatter([p["grad_accum"] for p in every], [p["calls_measured"] for p in every], marker="s",
                         color="tab:red", zorder=3, label="measured, reduce every micro-batch")
        all_ga = sorted({p["grad_accum"] for p in points})  # a linear axis: the calls are linear in m
        axis.set_xticks(all_ga, [str(g) for g in all_ga])
        axis.set_xlim(0, max(all_ga) + 1)
        axis.set_ylim(bottom=0)
        axis.set(xlabel="grad-accum m (micro-batches per step)", ylabel="calls per optimizer step (rank 0)",
                 title=f"{kind}")
        axis.legend(fontsize="x-small")
    figure.suptitle("FSDP collectives per step against grad-accum: measured (profiler) and common/comm.py's formula")
    save(figure, path)


def draw_ddp_buckets(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    figure, (calls, comm, accumulation) = plt.subplots(1, 3, figsize=(16, 4.5))
    # The bucket runs share grad-accum and sync once per step; the bucket size is the only thing that differs.
    buckets = sorted((r for r in rows if not r["reduce_every_micro_batch"]), key=lambda r: r["bucket_cap_mb"])
    ga = {r["grad_accum"] for r in buckets}
    by_ga = {g: [r for r in buckets if r["grad_accum"] == g] for g in sorted(ga)}
    for g, line in by_ga.items():
        sizes = sorted({r["bucket_cap_mb"] for r in line})
        if len(sizes) < 2:
            continue
        for axis, key in ((calls, "all_reduce_calls"), (comm, "comm_ms")):
            means = [statistics.mean(r[key] for r in line if r["bucket_cap_mb"] == size) for size in sizes]
            drawn = axis.plot(sizes, means, label=f"GA {g}: mean of the runs at each size")
            repeated = any(sum(r["bucket_cap_mb"] == size for r in line) > 1 for size in sizes)
            axis.scatter([r["bucket_cap_mb"] for r in line], [r[key] for r in line], color=drawn[0].get_color(),
                         zorder=3, label=f"GA {g}: each run" + (" (two runs of the same setting at one size)"
                                                               if repeated else ""))
    for axis, ylabel, title in ((calls, "all-reduce calls per optimizer step", "All-reduce calls vs bucket size"),
                                (comm, "comm_ms per step (profiler)", "Time in collectives vs bucket size")):
        axis.set(xlabel="--bucket-cap-mb (MiB)", ylabel=ylabel, title=title)
        if axis.lines:
            axis.set_xscale("log")
            axis.legend(fontsize="x-small", loc="upper right")
        else:
            axis.text(0.5, 0.5, "needs runs with two or more bucket sizes", ha="center", va="center",
                      transform=axis.transAxes)
    labels, values, colours = [], [], []
    for row in sorted(rows, key=lambda r: (r["grad_accum"], r["reduce_every_micro_batch"], r["bucket_cap_mb"])):
        when = "every micro-batch" if row["reduce_every_micro_batch"] else "once per step"
        labels.append(f"GA {row['grad_accum']}, {when}, bucket {row['bucket_cap_mb']:g} MiB\n{row['run']}")
        values.append(row["all_reduce_calls"])
        colours.append("tab:red" if row["reduce_every_micro_batch"] else "tab:blue")
    bars = accumulation.barh(labels, values, color=colours)
    accumulation.bar_label(bars, fmt="{:g}", fontsize="small", padding=2)
    accumulation.invert_yaxis()
    accumulation.tick_params(axis="y", labelsize="x-small")
    accumulation.set(xlabel="all-reduce calls per optimizer step",
                     title="no_sync: reduce once per step, not per micro-batch")
    save(figure, path)


def draw_tp_activations(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    shown = [row for row in rows if row["sync_qk_norm_grads"] is not False]  # a variant with the same activations
    seqs = sorted({row["seq_len"] for row in shown})
    experiments = list(dict.fromkeys(row["experiment"] for row in shown))
    figure, axis = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(experiments)
    for index, experiment in enumerate(experiments):
        values = [next((r["activation_mib"] for r in shown if r["experiment"] == experiment and r["seq_len"] == s), 0)
                  for s in seqs]
        bars = axis.bar([i + (index - (len(experiments) - 1) / 2) * width for i in range(len(seqs))], values, width,
                        label=experiment)
        axis.bar_label(bars, fmt="{:.1f}", fontsize="small", padding=2)
    axis.set_xticks(range(len(seqs)), [f"seq {s}" for s in seqs])
    axis.margins(y=0.15)  # room for the value labels and the legend
    axis.set(ylabel="MiB saved for backward (one micro-batch, rank 0)",
             title="Activation memory: tensor parallel vs tensor + sequence parallel")
    axis.legend()
    save(figure, path)


def draw_moe(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    figure, (load, parity) = plt.subplots(1, 2, figsize=(15, 4.8))
    loads = [r for r in rows if r["kind"] == "load" and r["ranks"] == 2]
    shown = loads and min(r["lr"] for r in loads)
    loads = [r for r in loads if r["lr"] == shown and r["run"] == next(x["run"] for x in loads if x["lr"] == shown)]
    layers = sorted({r["layer"] for r in loads})
    experts = sorted({r["expert"] for r in loads})
    width = 0.8 / max(1, len(layers))
    for index, layer in enumerate(layers):
        line = sorted((r for r in loads if r["layer"] == layer), key=lambda r: r["expert"])
        load.bar([r["expert"] + (index - (len(layers) - 1) / 2) * width for r in line], [r["tokens"] for r in line],
                 width, color=[("tab:blue", "tab:orange")[r["rank"] % 2] for r in line], alpha=0.35 + 0.65 * (
                     index + 1) / len(layers), label=f"layer {layer}")
    if loads:
        mean = sum(r["tokens"] for r in loads) / len(loads)
        load.axhline(mean, color="black", linewidth=0.8, linestyle="--", label="even load")
    load.set_xticks(experts, [f"E{e}\nrank {next(r['rank'] for r in loads if r['expert'] == e)}" for e in experts])
    load.set(ylabel="(token, slot) rows routed over the run", title="Tokens per expert, ep-ft on 2 ranks "
             "(blue: rank 0's experts, orange: rank 1's)")
    load.legend(fontsize="small", ncols=2)
    for lr in sorted({r["lr"] for r in rows if r["kind"] == "parity"}):
        line = sorted((r for r in rows if r["kind"] == "parity" and r["lr"] == lr and r["ranks"] == 2),
                      key=lambda r: r["step"])
        parity.plot([r["step"] for r in line], [max(r["loss_rel_diff"], 1e-9) for r in line], marker=".",
                    label=f"lr {lr:g}: loss, relative difference")
        moved = [r for r in line if r["moved_rows"]]
        if moved:
            first = moved[0]
            parity.annotate(f"first step with tokens on other experts: {first['step']}",
                            (first["step"], max(first["loss_rel_diff"], 1e-9)), textcoords="offset points",
                            xytext=(10, -25), fontsize="small", arrowprops=dict(arrowstyle="->"))
    parity.axhline(1e-5, color="grey", linestyle=":", label="the tests' bound, 1e-5")
    parity.set_yscale("log")
    parity.set(xlabel="optimizer step", ylabel="|ep-ft - single-ft| / single-ft (floor 1e-9)",
               title="ep-ft vs single-ft per step, fp32")
    parity.legend(fontsize="small")
    save(figure, path)


def draw_pp_bubble(rows: list[dict], path: Path) -> None:
    """The idle share of the less busy rank (rank 0 with the LM head on the last stage; rank 1 under zbv, whose V
    puts the head on rank 0), per schedule against m, beside the floor its busy-time ratio r sets,
    1 - m r / (m + r) (tending to 1 - r), and the textbook (p-1)/(m+p-1), which assumes equal stages."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(9, 5.5))
    even = [row for row in rows if not row["split"]]

    def idle_rank(row: dict) -> tuple[float, float]:
        """(the idle share of the less busy rank, its busy-time ratio r to the other)."""
        busy = [float(b) for b in row["busy_ms_per_rank"].split(";") if b]
        bubble = [float(b) for b in row["bubble_per_rank"].split(";") if b]
        light = min(range(len(busy)), key=busy.__getitem__)
        return bubble[light], busy[light] / max(busy)

    for index, (schedule, points) in enumerate(grouped(even, "schedule").items()):
        points = sorted((p for p in points if p["busy_ms_per_rank"]), key=lambda p: p["m"])
        if not points:
            continue
        colour = plt.cm.tab10(index)
        rank = "rank 1" if schedule == "zbv" else "rank 0"
        axis.plot([p["m"] for p in points], [idle_rank(p)[0] for p in points], marker="o", color=colour,
                  label=f"measured, {schedule} ({rank}, the less busy)")
        if points[0]["v"] == 1:  # the floor's derivation: one stage per rank
            axis.plot([p["m"] for p in points], [imbalance_floor(p["m"], idle_rank(p)[1]) for p in points],
                      marker="x", linestyle=":", color=colour,
                      label=f"{schedule}: 1 - m r/(m + r), r = its measured busy ratio")
    for row in rows:
        if row["split"] and row["busy_ms_per_rank"]:
            axis.scatter([row["m"]], [idle_rank(row)[0]], marker="D", color="black", zorder=3,
                         label=f"measured, {row['schedule']} --split {row['split']} (m={row['m']}): balanced stages")
    all_m = sorted({p["m"] for p in rows})
    m_range = [all_m[0] + (all_m[-1] - all_m[0]) * i / 50 for i in range(51)]
    for p in sorted({row["p"] for row in rows}):
        axis.plot(m_range, [bubble_textbook("1f1b", p, m, 1)[0] for m in m_range], color="gray", linestyle="--",
                  label=f"textbook (p-1)/(m+p-1), p={p}: equal stages")
    ratios = [idle_rank(row)[1] for row in even if row["busy_ms_per_rank"] and row["v"] == 1]
    if ratios:
        floor = 1 - statistics.mean(ratios)
        axis.axhline(floor, color="black", linewidth=0.8, linestyle="-.",
                     label=f"1 - r, the limit as m grows (mean r of the one-stage-per-rank runs: {1 - floor:.2f})")
    axis.set_xticks(all_m, [str(m) for m in all_m])
    axis.set_xlim(0, max(all_m) + 1)
    axis.set(xlabel="micro-batches per step m (--grad-accum)", ylabel="idle share of the schedule's time",
             title="Pipeline bubble of the less busy rank, against the floor its stage imbalance sets", ylim=(0, 1))
    axis.legend(fontsize="x-small", loc="upper right")
    save(figure, path)


def draw_pp_schedule(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    from matplotlib.patches import Patch

    runs = grouped(rows, "run")
    # Each timeline is as tall as its ranks need, plus room for its title.
    heights = [0.6 * len({a["rank"] for a in actions}) + 0.7 for actions in runs.values()]
    figure, axes = plt.subplots(len(runs), 1, figsize=(13, 1.0 + sum(heights)), squeeze=False,
                                gridspec_kw=dict(height_ratios=heights))
    for axis, (run, actions) in zip(axes[:, 0], runs.items()):
        ranks = sorted({a["rank"] for a in actions})
        span = max(a["end_ms"] for a in actions)
        # With v > 1 a rank holds several stages: the first is drawn plain, the later ones hatched.
        first_stage = {rank: min(a["stage"] for a in actions if a["rank"] == rank) for rank in ranks}
        for action in actions:
            width = action["end_ms"] - action["start_ms"]
            axis.barh(action["rank"], width, left=action["start_ms"], height=0.7, color=KIND_COLOURS[action["kind"]],
                      edgecolor="black", linewidth=0.4,
                      hatch="//" if action["stage"] != first_stage[action["rank"]] else None)
            if width > span / 70 and action["kind"] != "loss":  # label only boxes wide enough to hold it
                axis.text(action["start_ms"] + width / 2, action["rank"], str(action["microbatch"]), ha="center",
                          va="center", fontsize="x-small", color="white")
        first = actions[0]
        axis.set_yticks(ranks, [f"rank {r}" for r in ranks])
        axis.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)  # rank 0 on top
        axis.set_xlim(0, span * 1.01)
        axis.set_title(f"{run}: {first['schedule']}, p={first['p']}, v={first['v']}, m={first['m']} "
                       f"(step {first['step']}, {span:,.0f} ms)", fontsize="small", loc="left")
    axes[-1, 0].set_xlabel("ms since the step's first action")
    kinds = [kind for kind in KIND_COLOURS if any(row["kind"] == kind for row in rows)]
    handles = [Patch(color=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    if any(row["v"] > 1 for row in rows):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="the rank's second stage (v=2)"))
    heading = 0.6 / figure.get_figheight()  # the title and the legend take a fixed height above the plots
    figure.suptitle("One step of each pipeline schedule: boxes are a rank computing, numbered by micro-batch; "
                    "gaps are the bubble", fontsize="medium", y=1 - 0.15 * heading)
    figure.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.45 * heading), fontsize="small",
                  ncol=len(handles), frameon=False)
    save(figure, path, top=1 - heading)


def draw_sweep(rows: list[dict], path: Path) -> None:
    """tokens/s and peak memory per cell, cells of equal tokens per step (T_eff) side by side, one colour per
    experiment: across groups the cells do different work."""
    plt = pyplot()
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(13, 1.8 + 0.4 * len(rows)), sharey=True)
    experiments = list(dict.fromkeys(row["experiment"] for row in rows))
    colours = [plt.cm.tab10(experiments.index(row["experiment"])) for row in rows]
    labels = [f"T_eff {row['t_eff']:,}: {row['run']}" for row in rows]
    for axis, key, fmt in ((speed, "tokens_per_s", "{:,.0f}"), (memory, "peak_mem_gib", "{:.2f}")):
        bars = axis.barh(labels, [row[key] or 0.0 for row in rows], color=colours)
        axis.bar_label(bars, fmt=fmt, fontsize="small", padding=2)
        axis.margins(x=0.18)
        edges = [i - 0.5 for i in range(1, len(rows)) if rows[i]["t_eff"] != rows[i - 1]["t_eff"]]
        for edge in edges:
            axis.axhline(edge, color="black", linewidth=0.8)
    speed.set(xlabel="tokens/s (real tokens, all ranks)", title="Throughput, grouped by tokens per step")
    memory.set(xlabel=f"GiB per process: {rows[0]['memory_measure']}", title="Peak memory (rank 0)")
    speed.invert_yaxis()
    from matplotlib.patches import Patch

    speed.legend(handles=[Patch(color=plt.cm.tab10(i), label=name) for i, name in enumerate(experiments)],
                 fontsize="small", loc="lower right")
    save(figure, path)
