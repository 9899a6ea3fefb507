"""`cpu-box`: what the runs' numbers can and cannot tell for the device they ran on (CPU or GPU)."""

from __future__ import annotations

from run_files import Run

from ..engine import generator
from ..site import Context
from .runs import PARITY_FIRST_STEPS, PARITY_TOLERANCE_TEXT, device_text, distinct, loss_differences, \
    rank0_collectives, small, world_size


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
        carries.append("which pipeline stage is the slow one, and the bubble's form; its size only as far as the "
                       "stages' compute ratio does, which a GPU sets otherwise (post 7 measured it off its "
                       "prediction)")
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


@generator("cpu-box", ("runs",), ("rss-run",))
def gen_cpu_box(ctx: Context, args: dict) -> str:
    runs = ctx.site.runs(args["runs"])
    rss_run = ctx.site.run(args["rss-run"]) if "rss-run" in args else None
    on_cpu = [run for run in runs if run.summary.get("hardware", {}).get("device_kind") == "cpu"]
    on_gpu = [run for run in runs if run not in on_cpu]
    boxes = ([cpu_box(ctx, on_cpu, rss_run)] if on_cpu else []) + ([gpu_box(on_gpu)] if on_gpu else [])
    return "\n\n".join(boxes)
