"""What the generators read of a run, and how they write what they read: fields and paths, the steps the averages
count, the device and software a run had, relative differences, values as text."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from plotting.data import STATE_KINDS, collective_formulas
from run_files import Run

from ..engine import RegionError

PARITY_TOLERANCE_TEXT = "1e-5"  # the tests' bound on fp32 per-step losses against single-ft (relative)
PARITY_FIRST_STEPS = 5
GPU_KINDS = ("cuda", "rocm")


def run_fields(run: Run, prediction: bool = False, formula: bool = False) -> dict:
    """What a path in a region can read: summary.json's fields, `steps` (metrics.jsonl), `timed` (the steps the
    summary's averages count: after the timing warm-up, profiled steps left out), `name` (the folder) and, asked
    for, `prediction` (current_prediction: common.memory's peak for the run's settings, as the code prices it now)
    and `formula` (common.comm's collectives per step of rank 0 for the run's settings, as the code prices it now)."""
    fields = {**run.summary, "steps": run.steps, "timed": timed_steps(run), "name": run.name}
    if prediction:
        fields["prediction"] = current_prediction(run)
    if formula:
        fields["formula"] = collective_formulas(run.summary)[0]
    return fields


def current_prediction(run: Run) -> float | None:
    """common.memory's peak GiB for the settings the run had (common.memory.predict_run), priced by the code as it is
    now; summary.json's predicted_peak_mem_gib is what the code predicted when the run started. None for a run that
    is not one of this repository's experiments."""
    from common import memory  # imports torch and transformers: only when a page quotes a prediction

    try:
        return memory.predict_run(run.summary).total_gib
    except ValueError:
        return None


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


def world_size(run: Run) -> int:
    return run.summary.get("hardware", {}).get("world_size") or 1


def rank0_collectives(run: Run) -> dict:
    return run.summary.get("collective_bytes_per_step") or {}


def state_total(kinds: dict | int | float | None) -> float | None:
    if kinds is None:
        return None
    if isinstance(kinds, (int, float)):
        return kinds
    return sum(kinds.get(kind) or 0 for kind in STATE_KINDS)


@dataclass(frozen=True)
class Missing:
    """A `field:` column's value in a run that lacks the field."""
    why: str


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
