"""Data functions: runs -> rows (plain dicts, no matplotlib), one per figure; each figure's CSV is its rows."""

from __future__ import annotations

import csv
import io

from run_files import Run

MIB, GIB = 2**20, 2**30
STATE_KINDS = ("weights", "grads", "optimizer", "master")


def csv_text(rows: list[dict]) -> str:
    """The rows as CSV, columns in the first row's order (floats written exactly, as Python's repr)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def collective_kind(key: str) -> str:
    """`gloo:all_reduce` -> `all_reduce`."""
    return key.split(":", 1)[-1]


def loss_curves_data(runs: list[Run]) -> list[dict]:
    """One row per run and step: the loss, and its relative difference from the reference that did the same steps:
    the single-ft run with the same step key, else the first run listed with it (empty for the reference itself)."""
    with_steps = [run for run in runs if run.steps]
    rows = []
    for run in with_steps:
        twins = [other for other in with_steps if other.step_key() == run.step_key()]
        references = [t for t in twins if t.summary.get("experiment") == "single-ft"] or twins[:1]
        reference = None if references[0] is run else references[0]
        losses = {r["step"]: r["loss"] for r in reference.steps} if reference else {}
        for record in run.steps:
            ref_loss = losses.get(record["step"])
            difference = "" if ref_loss is None else abs(record["loss"] - ref_loss) / abs(ref_loss)
            rows.append(dict(run=run.label, experiment=run.summary.get("experiment"), step=record["step"],
                             loss=record["loss"], reference=reference.label if reference else "",
                             relative_difference=difference))
    return rows


def median_timed(run: Run, field: str) -> float | None:
    """The median of a metrics.jsonl field over the steps the summary's averages count: after the warm-up steps,
    without the profiled ones (as common/metrics.py and the posts count them)."""
    import statistics

    warmup = run.summary.get("warmup_steps_excluded", run.config.get("timing_warmup_steps", 0))
    profiled = set(run.summary.get("profiled_steps") or [])
    values = [step[field] for step in run.steps if step.get("step", 0) > warmup and step.get("step") not in profiled
              and step.get(field) is not None]
    return statistics.median(values) if values else None


def throughput_memory_data(runs: list[Run]) -> list[dict]:
    """Per run: tokens/s by median step (the mean beside it), peak memory, and where it ran (the figure's title)."""
    return [dict(run=run.label, experiment=run.summary.get("experiment"),
                 ranks=run.summary.get("hardware", {}).get("world_size"),
                 device_kind=run.summary.get("hardware", {}).get("device_kind"),
                 model=run.summary.get("model", {}).get("name"),
                 tokens_per_s_median=median_timed(run, "tokens_per_s") or run.summary["tokens_per_s"],
                 tokens_per_s=run.summary["tokens_per_s"],
                 tokens_per_s_per_device=run.summary.get("tokens_per_s_per_device"),
                 peak_mem_gib=run.summary.get("peak_mem_gib"), memory_measure=run.summary.get("memory_measure"))
            for run in runs if run.summary.get("tokens_per_s") is not None]


def memory_predicted_data(runs: list[Run]) -> list[dict]:
    """Runs of this repository's experiments measured on a GPU (max_memory_reserved: the allocator's blocks, what
    the prediction models) beside common.memory's prediction for their settings as the code prices them now
    (predict_run), and the one they recorded when they ran; a CPU's peak RSS counts the whole process and is no
    test of a tensor-only prediction."""
    from common import memory  # here: it imports torch and transformers, which only this figure needs

    rows = []
    for run in runs:
        if run.summary.get("hardware", {}).get("device_kind") not in ("cuda", "rocm"):
            continue
        try:
            predicted = memory.predict_run(run.summary).total_gib
        except ValueError:  # not one of ours (the peer baseline's TRL run)
            continue
        rows.append(dict(run=run.label, experiment=run.summary.get("experiment"),
                         measured_peak_gib=run.summary.get("peak_mem_gib"), predicted_peak_gib=predicted,
                         predicted_at_run_gib=run.summary.get("predicted_peak_mem_gib"),
                         memory_measure=run.summary.get("memory_measure")))
    return rows


def predicted_state(summary: dict, rank: int) -> dict | None:
    """common.memory's model-state bytes by kind for one rank, for the run's settings as the code prices them now
    (predict_state_bytes); None for a run it does not price."""
    from common import memory  # imports torch and transformers: only for the runs that show a prediction

    try:
        per_rank = memory.predict_state_bytes(summary)
    except ValueError:  # not one of ours (the peer baseline's TRL run)
        return None
    return per_rank[rank] if per_rank and rank < len(per_rank) else None


def collective_formulas(summary: dict) -> list[dict | None]:
    """common.comm's formula for each rank's collectives per step (one entry for all but the pipelines), computed
    from the run's summary.json (predict_collectives). A run it cannot price now, as the ep-ft runs made before
    summary.json kept their routed rows, shows the formula it recorded."""
    from common import comm

    try:
        formula = comm.predict_collectives(summary)
    except ValueError:
        formula = None
    if formula is None:
        formula = summary.get("collective_bytes_formula_per_rank") or summary.get("collective_bytes_formula")
    return formula if isinstance(formula, list) else [formula]


def textbook_bubble(summary: dict) -> tuple[float | None, str | None]:
    """The pipeline's idle share if its stages were equal, and the formula (common.comm.predict_bubble)."""
    from common import comm

    return comm.predict_bubble(summary) or (None, None)


def state_bytes_data(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        for rank, measured in enumerate(run.summary.get("state_bytes_per_rank") or []):
            predicted = predicted_state(run.summary, rank) or {}
            rows += [dict(run=run.label, rank=rank, kind=kind, measured_bytes=measured.get(kind, 0),
                          predicted_bytes=predicted.get(kind, "")) for kind in STATE_KINDS]
    return rows


# The prediction drawn without runs: the setting most users ask about (two 24 GB cards, bf16, seq 1024).
BREAKDOWN_MODELS = ("qwen3-0.6b", "qwen3-4b")
BREAKDOWN_SETTING = dict(gpus=2, gpu_mem_gib=24, seq_len=1024, micro_batch_size=1)
BREAKDOWN_PARTS = (("weights", "weights_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"),
                   ("master", "master_bytes"), ("bf16 copies", "compute_copy_bytes"),
                   ("activations", "activations_bytes"), ("logits", "logits_bytes"), ("buffers", "buffers_bytes"))


def memory_breakdown_data(runs: list[Run]) -> list[dict]:
    """common.memory.estimate per strategy and part, GiB per GPU (the fullest pipeline stage for pp)."""
    from common import memory  # here: it imports torch and transformers, which only this figure needs

    rows = []
    for model in BREAKDOWN_MODELS:
        dense = not memory.model_shape(model).is_moe
        for strategy in memory.STRATEGIES:
            if dense and strategy == "ep":
                continue  # ep splits a mixture of experts' experts
            world = 1 if strategy == "single" else BREAKDOWN_SETTING["gpus"]
            estimate = memory.estimate(model, strategy, world, seq_len=BREAKDOWN_SETTING["seq_len"],
                                       micro_batch_size=BREAKDOWN_SETTING["micro_batch_size"],
                                       precision="bf16")  # each strategy as its experiment runs --dtype bf16
            usable_gib = BREAKDOWN_SETTING["gpu_mem_gib"] * memory.USABLE_FRACTION
            rows += [dict(model=model, strategy=strategy, gpus=world, part=part,
                          gib=getattr(estimate, field) / GIB, total_gib=estimate.total_gib, usable_gib=usable_gib,
                          host_gib=estimate.cpu_bytes / GIB) for part, field in BREAKDOWN_PARTS]
    return rows


def collective_bytes_data(runs: list[Run]) -> list[dict]:
    """Rank 0's calls and bytes per optimizer step for every backend collective."""
    return [dict(run=run.label, experiment=run.summary.get("experiment"), collective=key, calls=entry["calls"],
                 bytes=entry["bytes"])
            for run in runs for key, entry in sorted((run.summary.get("collective_bytes_per_step") or {}).items())]


def fsdp_collectives_data(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        measured = run.summary.get("collective_bytes_per_step")
        if run.summary.get("experiment") != "fsdp-ft" or not measured:
            continue
        formula = collective_formulas(run.summary)[0] or {}
        for key in sorted(set(measured) | set(formula)):
            rows.append(dict(run=run.label, grad_accum=run.config.get("grad_accum"),
                             reshard_after_forward=run.config.get("reshard_after_forward"),
                             reshard_after_backward=run.config.get("reshard_after_backward", True),
                             reduce_every_micro_batch=run.config.get("reduce_every_micro_batch"), collective=key,
                             calls_measured=measured.get(key, {}).get("calls", 0),
                             calls_formula=formula[key]["calls"] if key in formula else ""))
    return rows


def ddp_buckets_data(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        measured = run.summary.get("collective_bytes_per_step")
        if run.summary.get("experiment") != "ddp-ft" or not measured:
            continue
        all_reduce = {"calls": 0, "bytes": 0}
        for key, entry in measured.items():
            if collective_kind(key) == "all_reduce":
                all_reduce = {"calls": all_reduce["calls"] + entry["calls"],
                              "bytes": all_reduce["bytes"] + entry["bytes"]}
        rows.append(dict(run=run.label, bucket_cap_mb=run.config.get("bucket_cap_mb"),
                         grad_accum=run.config.get("grad_accum"),
                         reduce_every_micro_batch=bool(run.config.get("reduce_every_micro_batch")),
                         all_reduce_calls=all_reduce["calls"], all_reduce_mib=all_reduce["bytes"] / MIB,
                         comm_ms=run.summary.get("comm_ms")))
    return rows


def tp_activations_data(runs: list[Run]) -> list[dict]:
    return [dict(run=run.label, experiment=run.summary.get("experiment"), seq_len=run.config.get("seq_len"),
                 sync_qk_norm_grads=run.config.get("sync_qk_norm_grads"), activation_mib=run.summary["activation_mib"])
            for run in runs if run.summary.get("activation_mib") is not None]


def pipeline_shape(summary: dict) -> tuple[str, int, int, int]:
    """(schedule, p ranks, v stages per rank, m micro-batches) from summary.json's `pipeline` (pp-ft, pp-ds-ft)."""
    pipeline = summary.get("pipeline", {})
    p = pipeline.get("ranks", pipeline.get("stages"))
    return pipeline.get("schedule"), p, pipeline.get("stages_per_rank") or 1, pipeline.get("microbatches")


def pp_bubble_data(runs: list[Run]) -> list[dict]:
    rows = []
    for run in runs:
        if run.summary.get("bubble_fraction") is None:
            continue
        schedule, p, v, m = pipeline_shape(run.summary)
        busy = run.summary.get("busy_ms_per_rank") or []
        textbook, formula = textbook_bubble(run.summary)
        rows.append(dict(run=run.label, schedule=schedule, p=p, v=v, m=m, split=run.config.get("split") or "",
                         bubble=run.summary["bubble_fraction"],
                         bubble_per_rank=";".join(repr(b) for b in run.summary.get("bubble_fraction_per_rank", [])),
                         textbook=textbook, formula=formula,
                         busy_ms_per_rank=";".join(repr(b) for b in busy)))
    return rows


def imbalance_floor(m: float, r: float) -> float:
    """The idle share of the less busy of two stages (busy-time ratio r <= 1) with m micro-batches: the step lasts
    one of its own micro-batches plus m of the slow stage's, t_0 + m t_1, of which it works m t_0 (post 7)."""
    return 1 - m * r / (m + r)


def pp_schedule_data(runs: list[Run]) -> list[dict]:
    """Every action of each run's traced step, times from the step's first action."""
    rows = []
    for run in runs:
        trace = run.summary.get("schedule_trace")
        if not trace or not trace.get("actions"):
            continue
        schedule, p, v, m = pipeline_shape(run.summary)
        origin = min(action["start_ms"] for action in trace["actions"])
        rows += [dict(run=run.label, schedule=schedule, p=p, v=v, m=m, step=trace.get("step"),
                      rank=action["rank"], stage=action["stage"], microbatch=action["microbatch"],
                      kind=action["kind"], start_ms=action["start_ms"] - origin, end_ms=action["end_ms"] - origin)
                 for action in trace["actions"]]
    return rows


def moe_data(runs: list[Run]) -> list[dict]:
    """Two kinds of rows. "load": the tokens each expert of each layer received over an ep-ft run, with the rank that
    holds it. "parity": per step, an ep-ft run against the single-ft run of the same steps (same learning rate):
    the relative loss difference and the (token, expert) rows routed to another expert than single-ft's."""
    blank = dict(kind=None, run=None, lr=None, ranks=None, layer=None, expert=None, rank=None, tokens=None, step=None,
                 loss_rel_diff=None, moved_rows=None)
    rows = []
    for run in runs:
        load = run.summary.get("expert_load")
        if run.summary.get("experiment") != "ep-ft" or not load:
            continue
        ranks = run.summary["hardware"]["world_size"]
        for layer, counts in enumerate(load["tokens_per_expert"]):
            per_rank = len(counts) // ranks
            rows += [{**blank, "kind": "load", "run": run.label, "lr": run.config.get("lr"), "ranks": ranks,
                      "layer": layer, "expert": expert, "rank": expert // per_rank, "tokens": tokens}
                     for expert, tokens in enumerate(counts)]
        reference = next((other for other in runs if other.summary.get("experiment") == "single-ft"
                          and other.step_key() == run.step_key()), None)
        if reference is None:
            continue
        for mine, theirs in zip(run.steps, reference.steps):
            moved = sum(abs(a - b) for x, y in zip(mine["expert_tokens"], theirs["expert_tokens"])
                        for a, b in zip(x, y)) / 2
            rows.append({**blank, "kind": "parity", "run": run.label, "lr": run.config.get("lr"), "ranks": ranks,
                         "step": mine["step"], "loss_rel_diff": abs(mine["loss"] - theirs["loss"]) / theirs["loss"],
                         "moved_rows": moved})
    return rows


def sweep_data(runs: list[Run]) -> list[dict]:
    """One row per cell, sorted by tokens per optimizer step: only cells of equal T_eff do the same work."""
    rows = [dict(run=run.label, experiment=run.summary.get("experiment"), t_eff=run.summary.get("t_eff"),
                 micro_batch_size=run.config.get("micro_batch_size"), grad_accum=run.config.get("grad_accum"),
                 activation_checkpointing=run.config.get("activation_checkpointing"),
                 tokens_per_s=run.summary["tokens_per_s"], peak_mem_gib=run.summary.get("peak_mem_gib"),
                 memory_measure=run.summary.get("memory_measure"))
            for run in runs if run.summary.get("tokens_per_s") is not None]
    return sorted(rows, key=lambda row: (row["t_eff"] or 0, row["experiment"] or "", row["run"]))
