"""The GPU suite's instruments: where a fast rung's step time goes (torch.profiler) and its host syncs
(torch.cuda.set_sync_debug_mode), both measured inside the rung's own timing warm-up by
`python3 assets/gpu_suite.py --instrument-child RUN_DIR train.py ARGS...` (instrument_child), and their lines in the
suite's devlog entry (profile_lines, syncs_lines)."""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

PROFILE_STEPS = 3  # profiled optimizer steps of an instrumented rung, right after its first (compilation)
SYNC_STEPS = 3  # then the steps whose host syncs are counted; both inside the rung's timing warm-up


KERNEL_CATEGORIES = (  # first match wins; names of CUDA kernels (or CPU ops in a dry run), lower case
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "varlen", "softmax_warp")),
    ("loss", ("cross_entropy", "softmax", "nll_loss", "logsumexp")),  # cunn_SoftMax*: the loss's log-softmax
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_adam")),
    ("matmul", ("gemm", "matmul", "cutlass", "xmma", "cublas", "nvjet", "linear", "addmm", "mm")),
)
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode's warning


def profile_summary(prof, cuda: bool, step_ms: float | None) -> dict:
    """Kernels by device time per step, their categories, and the share of the step the device sat idle."""
    # Kernels only: a record_function span (ProfilerStep, Optimizer.step#AdamW.step) also gets device time, that of
    # the kernels inside it, which would count them twice.
    events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == cuda
              and not e.key.startswith("ProfilerStep") and not getattr(e, "is_user_annotation", False)]
    time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    busy = sum(time_of(e) for e in events) / 1e3 / PROFILE_STEPS  # ms per step
    shares: dict[str, float] = {}
    for event in events:
        name = event.key.lower()
        category = next((c for c, words in KERNEL_CATEGORIES if any(w in name for w in words)), "other")
        shares[category] = shares.get(category, 0.0) + time_of(event) / 1e3 / PROFILE_STEPS
    top = sorted(events, key=time_of, reverse=True)[:25]
    return {"steps": PROFILE_STEPS, "device": "cuda" if cuda else "cpu", "step_ms": step_ms, "busy_ms": busy,
            "idle_share": None if not step_ms or not cuda else max(0.0, 1 - busy / step_ms),
            "categories_ms": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            "top": [{"name": e.key[:120], "ms_per_step": time_of(e) / 1e3 / PROFILE_STEPS, "calls": e.count}
                    for e in top]}


class SyncCounter:
    """Counts torch.cuda.set_sync_debug_mode's warnings by the Python line that made them, between start() and
    stop(); every other warning is shown as usual."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.counting = False
        self.show = warnings.showwarning

    def _count(self, message, category, filename, lineno, file=None, line=None):
        if self.counting and SYNC_MESSAGE in str(message):
            where = f"{Path(filename).name}:{lineno}"
            self.counts[where] = self.counts.get(where, 0) + 1
            return
        self.show(message, category, filename, lineno, file, line)

    def start(self) -> None:
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")  # each occurrence, not once per line
        warnings.showwarning = self._count
        self.counting = True

    def stop(self, steps: int) -> dict:
        self.counting = False
        warnings.showwarning = self.show
        return {"steps_counted": steps, "per_step": {where: n / steps for where, n in sorted(self.counts.items())},
                "total_per_step": sum(self.counts.values()) / steps}


def instrument_child(argv: list[str]) -> None:
    """`gpu_suite.py --instrument-child RUN_DIR train.py ARGS...`: run the experiment as `python3 train.py ARGS` would.
    After its first optimizer step (compilation), torch.profiler over the next PROFILE_STEPS steps (RUN_DIR/
    profile.json), then the host syncs of the SYNC_STEPS after them, each synchronising CUDA call warned by
    torch.cuda.set_sync_debug_mode and counted by its Python line (RUN_DIR/host-syncs.json). Both windows lie inside
    the run's --timing-warmup-steps, which its averages leave out: one process measures all three, no second
    start-up."""
    import runpy

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile

    run_dir, script, *args = argv
    run_dir = Path(run_dir)
    warmup = int(args[args.index("--timing-warmup-steps") + 1]) if "--timing-warmup-steps" in args else 2
    cuda = torch.cuda.is_available()
    sync_steps = SYNC_STEPS if cuda else 0  # no CUDA, no sync to count
    if warmup < 1 + PROFILE_STEPS + sync_steps:
        raise SystemExit(f"--instrument-child: --timing-warmup-steps {warmup} leaves no room for step 1, "
                         f"{PROFILE_STEPS} profiled and {sync_steps} sync-counted steps")
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    state = {"step": 0, "start": 0.0}
    syncs = SyncCounter()

    def after_optimizer_step(*_):
        state["step"] += 1
        step = state["step"]
        if step == 1:  # after compilation: the profiled window starts, its edges synchronised
            if cuda:
                torch.cuda.synchronize()
            state["start"] = time.perf_counter()
            prof.start()
        elif step == 1 + PROFILE_STEPS:
            if cuda:
                torch.cuda.synchronize()
            step_ms = (time.perf_counter() - state["start"]) / PROFILE_STEPS * 1e3
            prof.stop()
            (run_dir / "profile.json").write_text(json.dumps(profile_summary(prof, cuda, step_ms), indent=1) + "\n")
            if sync_steps:
                syncs.start()
                torch.cuda.set_sync_debug_mode("warn")
        elif sync_steps and step == 1 + PROFILE_STEPS + sync_steps:
            torch.cuda.set_sync_debug_mode(0)
            # Each step's one read comes after its optimizer step: the window holds SYNC_STEPS of them.
            counts = syncs.stop(sync_steps) | {"first_step": 2 + PROFILE_STEPS}
            (run_dir / "host-syncs.json").write_text(json.dumps(counts, indent=1) + "\n")

    register_optimizer_step_post_hook(after_optimizer_step)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def profile_lines(profiled: dict, source: str) -> list[str]:
    idle = profiled.get("idle_share_vs_median")
    lines = [f"Where the step of `{profiled.get('profiled_run', 'the fastest rung')}` goes ({source}, torch.profiler "
             f"over {profiled['steps']} steps; {profiled['device']} time per step {profiled['busy_ms']:.1f} ms"
             + (f", the run's median step {profiled['unprofiled_median_step_ms']:.1f} ms"
                if profiled.get("unprofiled_median_step_ms") else "")
             + (f": the device idle {idle:.0%} of it" if idle is not None else "") + "):", ""]
    lines += [f"- {name}: {ms:.2f} ms" for name, ms in profiled["categories_ms"].items()]
    lines += ["", "Top kernels:", ""]
    lines += [f"- {row['ms_per_step']:.2f} ms, {row['calls']} calls: `{row['name']}`"
              for row in profiled["top"][:16]] + [""]
    return lines


def syncs_lines(counts: dict, source: str) -> list[str]:
    first = counts.get("first_step")
    window = f"steps {first}-{first + counts['steps_counted'] - 1}" if first else \
        f"{counts['steps_counted']} steps after the warm-up"
    lines = [f"Host syncs per optimizer step over {window} ({source}): {counts['total_per_step']:g} in all", ""]
    return lines + [f"- `{where}`: {n:g}" for where, n in sorted(counts["per_step"].items())] + [""]
