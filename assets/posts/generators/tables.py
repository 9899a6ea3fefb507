"""`table` and `gpu-slot`: one row per run, columns by name (COLUMNS), a summary.json field or a ratio to a
reference run."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from plotting.data import MIB, STATE_KINDS, collective_kind, pipeline_shape, predicted_state, textbook_bubble
from run_files import Run

from ..engine import RegionError, generator
from ..expressions import lookup
from ..markup import markdown_table
from ..site import Context
from .runs import GPU_KINDS, Missing, current_prediction, measured_steps, median_of, rank0_collectives, run_fields, \
    show, state_total, world_size


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


def collectives_text(run: Run) -> str:
    measured = rank0_collectives(run)
    if measured:
        counts = {collective_kind(key): entry["calls"] for key, entry in measured.items()}
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
    from common.comm import wire_bytes  # imports torch: only for a table with a wire column

    try:
        return sum(wire_bytes(collective_kind(key), entry["bytes"], world_size(run))
                   for key, entry in measured.items()) / MIB
    except ValueError:
        return None


def measured_state(run: Run, kind: str | None) -> list | None:
    """MiB per rank of one kind of model state (None: the total)."""
    per_rank = run.summary.get("state_bytes_per_rank")
    if not per_rank:
        return None
    return [(state_total(rank) if kind is None else rank.get(kind, 0)) / MIB for rank in per_rank]


def predicted_state_mib(run: Run) -> list | None:
    ranks = len(run.summary.get("state_bytes_per_rank") or []) or world_size(run)
    predicted = [state_total(predicted_state(run.summary, rank)) for rank in range(ranks)]
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
    "schedule": Column("schedule", lambda run: pipeline_shape(run.summary)[0]),
    "m": Column("m", lambda run: pipeline_shape(run.summary)[3], "d"),
    "bubble": Column("bubble", summary_field("bubble_fraction"), ".3f"),
    "bubble_ranks": Column("bubble per rank", summary_field("bubble_fraction_per_rank"), ".2f"),
    "bubble_textbook": Column("textbook bubble", lambda run: textbook_bubble(run.summary)[0], ".3f"),
    "bubble_formula": Column("formula", lambda run: textbook_bubble(run.summary)[1]),
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


@generator("table", ("runs",), ("cols", "sort", "label", "ref"))
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
    """What a table's MFU column is for runs recorded before their steps carried their FLOPs: recounted once into their
    summary.json and metrics.jsonl (`mfu_recount` says how; `mfu_recorded` keeps the figure of the old count); and for
    fused-loss runs recorded before the LM head was counted on loss tokens (`lm_head_recount`)."""
    how = {run.name: run.summary.get("mfu_recount") for run in runs if run.summary.get("mfu_recount")}
    again = [name for name, text in how.items() if text.startswith("recounted")]
    left = [f"{name} ({text[len('not recounted: '):]})" for name, text in how.items() if name not in again]
    parts = []
    if again:
        which = "MFU" if len(again) == len(runs) else f"MFU of {', '.join(again)}"
        parts.append(f"{which} recounted from the documents of each step, rebuilt from the run's config and data "
                     f"(common/models.py's training_flops: attention per document, 4 FLOPs per frozen weight under "
                     f"LoRA); summary.json keeps the figure of the count the run was recorded with as mfu_recorded")
    if left:
        parts.append(f"no MFU for {', '.join(left)}")
    head = [run.name for run in runs if run.summary.get("lm_head_recount")]
    if head:
        which = "the MFU" if len(head) == len(runs) else f"the MFU of {', '.join(head)}"
        parts.append(f"{which} counts the LM head on loss tokens only, where the fused loss (--loss-chunk-tokens) "
                     f"runs it: recounted once from each step's tokens and loss tokens (assets/recount_head_flops.py), "
                     f"the figure before kept as mfu_head_every_token")
    text = "; ".join(parts)
    return (text[0].upper() + text[1:] + ".") if parts else ""


@generator("gpu-slot", ("runs",), ("cols", "sort", "label", "ref"))
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
