"""Tables of what the runs measured beside what the code predicts: `parity` (losses against the reference),
`collectives` (calls and bytes against common/comm.py), `state` (model-state bytes against common.memory),
`bubble` (pipelines) and `sweep` (a common.sweep grid)."""

from __future__ import annotations

import csv

from plotting.data import MIB, STATE_KINDS, collective_formulas, collective_kind, pipeline_shape, predicted_state, \
    textbook_bubble
from run_files import STEP_SETTINGS

from ..engine import RegionError, generator
from ..markup import markdown_table
from ..site import Context
from .runs import PARITY_FIRST_STEPS, PARITY_TOLERANCE_TEXT, loss_differences, rank0_collectives, \
    relative_difference, show, small, state_total, world_size


@generator("parity", ("runs", "ref"), ("tolerance",))
def gen_parity(ctx: Context, args: dict) -> str:
    """Per-step loss agreement with `ref`; `tolerance` (default the fp32 tests' 1e-5) for runs that round otherwise,
    as bf16 runs do."""
    runs, ref = ctx.site.runs(args["runs"]), ctx.site.run(args["ref"])
    tolerance_text = args.get("tolerance", PARITY_TOLERANCE_TEXT)
    try:
        tolerance = float(tolerance_text)
    except ValueError:
        raise RegionError(f"parity: tolerance={tolerance_text!r} is not a number") from None
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
        within = f"{show(everywhere <= tolerance)} / {show(first <= tolerance)}"
        rows.append([run.name, str(len(differences)), small(everywhere), small(first),
                     small(relative_difference(run.summary.get("eval_loss"), ref.summary.get("eval_loss"))), within])
    headers = ["run", "steps compared", "max rel. loss difference, all steps",
               f"same, first {PARITY_FIRST_STEPS} steps", "eval loss rel. difference",
               f"within {tolerance_text} (all / first {PARITY_FIRST_STEPS})"]
    table = markdown_table(headers, rows, [False, True, True, True, True, False])
    return f"{table}\n\nRelative difference: |loss - {ref.name}'s| / {ref.name}'s, per step."


def close_enough(measured: float, formula: float) -> bool:
    return abs(measured - formula) <= 1e-6 * max(abs(measured), abs(formula), 1.0)


@generator("collectives", ("runs",))
def gen_collectives(ctx: Context, args: dict) -> str:
    from common.comm import wire_bytes  # imports torch: only for a page with a collectives table

    runs = ctx.site.runs(args["runs"])
    per_rank = any(run.summary.get("collective_bytes_per_step_per_rank") for run in runs)
    rows = []
    for run in runs:
        if run.summary.get("collective_bytes_per_step_per_rank"):
            measured_ranks = list(enumerate(run.summary["collective_bytes_per_step_per_rank"]))
        else:
            measured_ranks = [(0, rank0_collectives(run))]
        formulas = collective_formulas(run.summary)
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
                    wire = wire_bytes(collective_kind(key), got["bytes"], world_size(run)) if got else None
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


@generator("state", ("runs",))
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
            predicted = predicted_state(run.summary, rank)
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
            + (" Engine buffers: DeepSpeed's gradient-reduction bucket, measured, outside the total."
               if buffers else ""))
    return f"{markdown_table(headers, rows, [False] + [True] * (len(STATE_KINDS) + 3 + buffers))}\n\n{note}"


@generator("bubble", ("runs",))
def gen_bubble(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    rows = []
    for run in runs:
        schedule, p, v, m = pipeline_shape(run.summary)
        textbook, formula = textbook_bubble(run.summary)
        rows.append([run.name, show(schedule), show(p), show(v if schedule else None), show(m),
                     show(run.summary.get("bubble_fraction"), ".3f"),
                     show(run.summary.get("bubble_fraction_per_rank"), ".2f"), show(textbook, ".3f"), show(formula)])
    headers = ["run", "schedule", "p", "v", "m", "bubble (mean over ranks)", "per rank", "textbook", "formula"]
    return markdown_table(headers, rows, [False, False, True, True, True, True, True, True, False])


SWEEP_NUMBERS = {"step_ms": float, "comm_ms": float, "toks/s": float, "peak_mem_gib": float, "t_eff": int,
                 "mfu": float, "final_loss": float, "scaling_eff": float}


@generator("sweep", ("run-dir",))
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
