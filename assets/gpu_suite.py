"""The GPU suite: one command that turns a GPU machine into committed numbers.

    python3 assets/gpu_suite.py              # on a GPU machine, from the repository root; no uv or network needed
    python3 assets/gpu_suite.py --list       # the runs it would make, their commands and predictions; runs nothing
    python3 assets/gpu_suite.py --wheels     # which wheels the TRL comparison needs on an offline machine, and how
    python3 assets/gpu_suite.py --dry-run    # the stages on the CPU, tiny preset, fewer rungs (what the tests run)

Stages, in order of what matters most, each kept as soon as it finishes:
1. Kernels: every variable-length attention kernel installed (common/attention.py: torch's varlen_attn, flash-attn,
   FlexAttention, the per-document reference) against SDPA with the block-diagonal mask, forward and gradients, on
   packed random q/k/v of Qwen3-0.6B's head geometry (kernel-check.json).
2. Ladders: single-ft on the `qwen3-0.6b` preset (Qwen3-0.6B's geometry, random weights, bf16), each rung adding one
   feature to the one before: baseline (SDPA with the packed rows' mask) -> + varlen attention -> + chunked loss ->
   + compile -> larger micro-batches, at sequence 1024 and 4096, full-parameter and LoRA r16. Every rung that does
   the baseline's optimizer steps is compared step by step with the baseline's losses (bf16: within
   BF16_TOLERANCE, not fp32's 1e-5) and shown in a parity table. Fused AdamW, pinned batches and the single host
   sync per step are always on in single-ft, so they have no rung of their own; stage 3 checks the last one.
3. After the first ladder: its compile rung again under torch.cuda.set_sync_debug_mode, every synchronising call
   counted per optimizer step by source line (host-syncs.json); then torch.profiler over its fastest rung: device
   time by kernel and category (attention, matmul, loss, optimizer, other) and the idle share (profile.json); then
   TRL's SFTTrainer beside single-ft on the same weights, data and batch (assets/peer_baseline.py), when trl and
   datasets are installed (`--wheels` says how to bring them; otherwise noted as skipped).
4. fsdp-ft on one rank: the wrapper's cost without communication. The lent machines have one GPU: two-rank
   comparisons cannot be measured there, and the suite does not pretend to.

The runs go by priority, so that a budget cut off early loses the least: the first ladder whole, the profile, TRL,
fsdp-ft; then each other ladder's baseline and last rung (its whole gain); then the rungs between; the host syncs
last. The entry shows them by ladder, in the order above. Each run is the experiment's own command line (`python3
experiments/<x>/train.py ...`), launched as a user would, with the repository on PYTHONPATH so that it needs nothing
but torch, transformers and peft.

Every run that finishes is kept at once, as the devlog keeps runs: its summary.json and metrics.jsonl go to
devlog/data/<date>-gpu-suite-<device>/<run>/, and devlog/<date>-gpu-suite-<device>.md is (re)written with generated
regions (assets/make_posts.py) over what is kept so far. A suite cut off by its time budget (--budget-min, default 9)
or by the machine going away therefore leaves a usable partial entry; runs the budget would overrun are skipped with a
note; a later call, on the same or another machine of the same kind, adds them to the same entry: `python3
assets/gpu_suite.py --date <the entry's date> --only '<names or patterns>'` (with the entry's devlog/data/ folder in
the checkout). The whole plan takes about 20 minutes on an H200, most of it starting processes and compiling; a lent
machine's one command runs 10 minutes at most, hence the default budget of 9. Each rung carries its prediction,
written here before any GPU run: the entry prints it beside the measurement.

From a fresh GPU machine to the committed entry:
1. Bring the checkout (and .whl/ from `--wheels` for the TRL comparison) to the machine; no uv, lock or network is
   needed there (Python 3.10+, torch 2.10+ for PyTorch's varlen kernel, transformers 5, peft).
2. From the repository root: `python3 assets/gpu_suite.py` (on a machine whose results come back only from one
   folder: `--root <folder>`, then copy <folder>/devlog/ into the repository; the runs' own output stays under the
   checkout's runs/).
3. On a machine with the environment: `uv run python assets/make_posts.py` (fills the posts' GPU slots from the kept
   runs; `--check` must pass), then commit devlog/data/<date>-gpu-suite-<device>/ and the entry.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
for folder in (REPO_ROOT / "assets", REPO_ROOT):  # make_plots and run_series; common (no install on a lent machine)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from make_plots import load_run  # noqa: E402  (after the path set-up above)
from run_series import keep  # noqa: E402

BF16_TOLERANCE = 2e-2  # largest relative per-step loss difference from the baseline rung, first 5 steps, bf16
FIRST_STEPS = 5
RUN_ESTIMATE_S = {False: 45, True: 90}  # a run without / with --compile, until one of its kind has been timed


@dataclass(frozen=True)
class Rung:
    name: str  # run folder name; starts with the experiment's name so the posts' GPU slots find it
    experiment: str
    args: tuple[str, ...]
    prediction: str  # written before any GPU run
    ladder: str  # the rungs of one ladder share it; the first rung of a ladder is its baseline
    nproc: int = 1
    syncs: bool = False  # run under torch.cuda.set_sync_debug_mode to count host syncs (not timed, not kept)
    profile: bool = False  # profile the fastest rung of its ladder so far (its args are chosen when it runs)
    priority: int = 0  # runs go in this order (stable), so that a budget cut off early loses the least


@dataclass
class Plan:
    model: str
    dtype: str
    steps: int
    warmup: int  # --timing-warmup-steps (compilation and allocator growth stay out of the averages)
    chunk: int  # --loss-chunk-tokens
    ladders: list[tuple[str, int, int, tuple[int, ...]]] = field(default_factory=list)  # (label, seq, lora, micros)
    fsdp_seq: int = 1024
    peer_micro: int = 4  # rows per optimizer step of the TRL comparison
    compile: bool = True  # the dry run leaves torch.compile out (tests/test_loss.py checks it; on CPU it only costs)
    syncs: bool = True  # the host-sync count (the dry run leaves it out: no CUDA, no sync to count on a CPU)
    fsdp: bool = True  # fsdp-ft on one rank (the dry run leaves it out: tests/test_ddp_fsdp.py runs fsdp-ft)


GPU_PLAN = Plan(model="qwen3-0.6b", dtype="bf16", steps=20, warmup=5, chunk=1024,
                ladders=[("s1024-full", 1024, 0, (4, 8)), ("s1024-lora16", 1024, 16, (4, 8)),
                         ("s4096-full", 4096, 0, (2,)), ("s4096-lora16", 4096, 16, (2,))],
                fsdp_seq=1024)
# The dry run leaves out the larger micro-batch rungs (the same code path as the compile rung, with other flags), and
# the host-sync count and fsdp-ft's rung: each rung is a process that spends most of its time importing, and tests
# cover those elsewhere (count_syncs on a log in tests/test_gpu_suite.py; fsdp-ft on one rank, and launched by torchrun
# as the suite launches it, in tests/test_ddp_fsdp.py).
DRY_PLAN = Plan(model="qwen3-tiny", dtype="fp32", steps=4, warmup=1, chunk=32,
                ladders=[("s64-full", 64, 0, ())], fsdp_seq=64, peer_micro=2, compile=False, syncs=False, fsdp=False)
PEER_WHEELS = ("trl", "datasets", "dill", "multiprocess")  # what the peer baseline needs beyond the lent machine's


def rungs(plan: Plan) -> list[Rung]:
    common = ("--model", plan.model, "--dtype", plan.dtype, "--steps", str(plan.steps), "--eval-fraction", "0",
              "--timing-warmup-steps", str(plan.warmup), "--comm-profile-steps", "0")
    out = []
    first = plan.ladders[0][0]
    for label, seq, lora, micros in plan.ladders:
        # The first ladder whole, then the profile, TRL and FSDP; then each other ladder's baseline and its last
        # rung (the whole gain), then the rungs between them; the host-sync count last.
        ends, middle = (0, 0) if label == first else (4, 5)
        base = (*common, "--seq-len", str(seq), *(("--lora-rank", str(lora)) if lora else ()), "--attn", "sdpa")
        varlen = (*base[:-1], "varlen")
        chunked = (*varlen, "--loss-chunk-tokens", str(plan.chunk))
        compiled = (*chunked, "--compile") if plan.compile else chunked
        out += [
            Rung(f"single-ft-{label}-1-baseline", "single-ft", base, ladder=label, priority=ends, prediction=(
                "the reference: SDPA over packed rows with a block-diagonal [seq x seq] mask, eager, micro-batch 1")),
            Rung(f"single-ft-{label}-2-varlen", "single-ft", varlen, ladder=label, priority=middle, prediction=(
                "same losses; a variable-length kernel skips the masked-out blocks between documents and needs no "
                "mask nor repeated K/V: attention is a small share of a 0.6B model's FLOPs at seq 1024 (the "
                "attention term of common/models.py), so 5-15% more tokens/s there and 20-40% at seq 4096, "
                "where the mask alone is 16M entries per layer call")),
            Rung(f"single-ft-{label}-3-chunked-loss", "single-ft", chunked, ladder=label, priority=middle,
                 prediction=(
                "same losses; peak memory lower by about the logits and their gradient (tokens x 151,936 vocab in "
                "bf16 and fp32), which matters most at seq 4096; tokens/s up by 0-10%: the LM head runs on loss "
                "tokens only (about half the positions of this data) at 4/3 of its cost per token (recomputed)")),
        ]
        if plan.compile:
            out.append(Rung(f"single-ft-{label}-4-compile", "single-ft", compiled, ladder=label,
                            priority=middle if micros else ends, prediction=(
                "same losses; 10-30% more tokens/s from fused norms, activations and rotary embeddings in each "
                "compiled decoder layer; the first steps slower (compilation, left out of the averages)")))
        out += [Rung(f"single-ft-{label}-5-micro{micro}", "single-ft", (*compiled, "--micro-batch-size", str(micro)),
                     ladder=label, priority=ends if micro == micros[-1] else middle, prediction=(
                         f"{micro}x the tokens per step; more tokens/s while micro-batch 1 leaves the GPU "
                         f"under-occupied (most at seq 1024), until memory runs out"))
                for micro in micros]
        if label == plan.ladders[0][0]:
            if plan.syncs:  # right after the first ladder, its compile rung's step again, every host sync counted
                out.append(Rung(f"syncs-{label}", "single-ft", (*compiled, "--steps", str(plan.warmup + 3)),
                                ladder="syncs", syncs=True, priority=6, prediction=(
                    "one synchronisation per optimizer step from train.py (the step line's loss and gradient norm "
                    "together), plus one per forward in transformers' packed-row detection "
                    "(find_packed_sequence_indices reads a flag on the device)")))
            out.append(Rung(f"profile-{label}", "single-ft", (), ladder=label, profile=True, priority=1, prediction=(
                "the fastest rung's step by kernel: matmuls the largest share, attention second at seq 1024, "
                "the optimizer a few percent (fused AdamW), idle gaps small once compiled")))
            # Then TRL's SFTTrainer beside single-ft on the same weights, data and batch, when its wheels are here.
            out.append(Rung(f"peer-{label}", "peer", (
                "--model", plan.model, "--dtype", plan.dtype, "--steps", str(plan.steps), "--seq-len", str(seq),
                "--micro-batch-size", str(plan.peer_micro), "--grad-accum", "1", "--attn", "sdpa",
                "--timing-warmup-steps", str(plan.warmup)), ladder="peer", priority=2, prediction=(
                "both with SDPA and eager: within 20% of each other (the same model code and kernels; TRL packs "
                "best-fit into one padding-free row); single-ft's own fast path is the ladder above")))
    if plan.fsdp:
        out.append(Rung(f"fsdp-ft-s{plan.fsdp_seq}-full-1rank", "fsdp-ft",
                        (*common, "--seq-len", str(plan.fsdp_seq), "--attn", "varlen"), ladder="fsdp", priority=3,
                        prediction=(
                            "FSDP2 on one rank: nothing to shard or communicate, so the cost of its wrapping alone; "
                            "within 5% of single-ft's varlen rung at the same sequence length")))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Stage 1: the variable-length kernels against masked SDPA, before any timing

KERNEL_SHAPE = dict(heads=16, kv_heads=8, head_dim=128)  # Qwen3-0.6B's attention geometry
KERNEL_DOCUMENTS = (700, 300, 24, 1000, 24)  # two rows of 1,024 slots, packed as a real row is (pads included)


def kernel_check(device_name: str) -> list[dict]:
    """Every installed varlen kernel (common/attention.py) on packed random q/k/v, forward and backward, against SDPA
    with the block-diagonal mask in fp32. The same masked SDPA in the working dtype (bf16 on a GPU) sets the scale of
    a normal rounding error: a kernel passes within 3x that (1e-5 in fp32)."""
    import torch

    from common import attention

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    tokens = sum(KERNEL_DOCUMENTS)
    shapes = {"q": (tokens, KERNEL_SHAPE["heads"]), "k": (tokens, KERNEL_SHAPE["kv_heads"]),
              "v": (tokens, KERNEL_SHAPE["kv_heads"])}
    base = {name: torch.randn(*shape, KERNEL_SHAPE["head_dim"], generator=generator) for name, shape in shapes.items()}
    grad_out = torch.randn(tokens, KERNEL_SHAPE["heads"], KERNEL_SHAPE["head_dim"], generator=generator)
    bounds = torch.tensor([0, *torch.tensor(KERNEL_DOCUMENTS).cumsum(0).tolist()], dtype=torch.int32)
    longest, scale = max(KERNEL_DOCUMENTS), KERNEL_SHAPE["head_dim"] ** -0.5
    document = torch.searchsorted(bounds[1:].long(), torch.arange(tokens), right=True).to(device)
    mask = (document[:, None] == document[None, :]).tril()

    def masked_sdpa(q, k, v, cu_seq_lens, max_length, scale):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    def run(function, run_dtype, backward=True):
        inputs = {name: t.to(device, run_dtype).requires_grad_(backward) for name, t in base.items()}
        out = function(inputs["q"], inputs["k"], inputs["v"], bounds.to(device), longest, scale)
        results = {"out": out.detach().float()}
        if backward:
            out.backward(grad_out.to(device, run_dtype))
            results.update({f"d{name}": t.grad.float() for name, t in inputs.items()})
        return results

    def error(result, reference):
        return max(float((result[key] - reference[key]).abs().max() / reference[key].abs().max())
                   for key in result)

    reference = run(masked_sdpa, torch.float32)
    rounding = error(run(masked_sdpa, dtype), reference)
    tolerance = max(3 * rounding, 1e-5)
    rows = [{"kernel": "masked SDPA", "dtype": str(dtype).removeprefix("torch."), "backward": True,
             "max_rel_error": rounding, "tolerance": None, "ok": True}]
    kernels = [k for k in attention.available_varlen_kernels() if device.type == "cuda" or k in ("flex", "reference")]
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # CPU: no compile
    for kernel in kernels:
        backward = device.type == "cuda" or kernel != "flex"  # FlexAttention has no CPU backward
        row = {"kernel": kernel, "dtype": str(dtype).removeprefix("torch."), "backward": backward,
               "tolerance": tolerance}
        try:
            row["max_rel_error"] = error(run(attention._VARLEN_FUNCTIONS[kernel], dtype, backward), reference)
            row["ok"] = row["max_rel_error"] <= tolerance
        except Exception as exc:  # a kernel that cannot run here is a result, not a crash of the suite
            row.update(max_rel_error=None, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Stage 3: host syncs per step, counted by torch.cuda.set_sync_debug_mode

# Runs an experiment as `python3 train.py ...` would, with every synchronizing CUDA call warned (each occurrence,
# with the Python line that made it).
SYNC_CHILD = ("import runpy, sys, warnings, torch; warnings.simplefilter('always'); "
              "torch.cuda.is_available() and torch.cuda.set_sync_debug_mode('warn'); "
              "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
SYNC_WARNING = re.compile(r"^(.+?):(\d+): UserWarning: called a synchronizing CUDA operation")
STEP_LINE = re.compile(r"^step (\d+)/(\d+) \|")


def count_syncs(log: str, skip_steps: int) -> dict:
    """Synchronising calls per optimizer step, by source line, from a SYNC_CHILD log (stdout and stderr in order).
    A step's warnings come before its step line; the first `skip_steps` steps (compilation) are not counted."""
    counted, pending, per_line = 0, [], {}
    for line in log.splitlines():
        if match := SYNC_WARNING.match(line):
            pending.append(f"{Path(match.group(1)).name}:{match.group(2)}")
        elif match := STEP_LINE.match(line):
            if int(match.group(1)) > skip_steps:
                counted += 1
                for where in pending:
                    per_line[where] = per_line.get(where, 0) + 1
            pending = []
    # What is pending after the last step line belongs to the evaluation and the summary, not to a step.
    return {"steps_counted": counted, "per_step": {where: n / max(counted, 1) for where, n in per_line.items()},
            "total_per_step": sum(per_line.values()) / max(counted, 1)}


# ---------------------------------------------------------------------------------------------------------------
# Stage 4: where the fastest configuration's step time goes

PROFILE_STEPS = 3
KERNEL_CATEGORIES = (  # first match wins; names of CUDA kernels (or CPU ops in a dry run), lower case
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "varlen", "softmax_warp")),
    ("loss", ("cross_entropy", "softmax", "nll_loss", "logsumexp")),  # cunn_SoftMax*: the loss's log-softmax
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_adam")),
    ("matmul", ("gemm", "matmul", "cutlass", "xmma", "cublas", "nvjet", "linear", "addmm", "mm")),
)


def profile_child(argv: list[str]) -> None:
    """`gpu_suite.py --profile-child OUT.json train.py ARGS...`: run the experiment as `python3 train.py ARGS` would,
    with torch.profiler over PROFILE_STEPS optimizer steps after its timing warm-up, and write a summary: kernels by
    device time per step, their categories, and the share of the step the device sat idle."""
    import runpy

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile, schedule

    out_json, script, *args = argv
    warmup = int(args[args.index("--timing-warmup-steps") + 1]) if "--timing-warmup-steps" in args else 2
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    spans = []

    def summarize(prof) -> None:
        # Kernels only: a record_function span (ProfilerStep, Optimizer.step#AdamW.step) also gets device time, that
        # of the kernels inside it, which would count them twice.
        events = [e for e in prof.key_averages()
                  if (e.device_type.name == "CUDA") == cuda and not e.key.startswith("ProfilerStep")
                  and not getattr(e, "is_user_annotation", False)]
        time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        busy = sum(time_of(e) for e in events) / 1e3 / PROFILE_STEPS  # ms per step
        step_ms = (spans[-1] - spans[0]) / PROFILE_STEPS * 1e3 if len(spans) > 1 else None
        shares: dict[str, float] = {}
        for event in events:
            name = event.key.lower()
            category = next((c for c, words in KERNEL_CATEGORIES if any(w in name for w in words)), "other")
            shares[category] = shares.get(category, 0.0) + time_of(event) / 1e3 / PROFILE_STEPS
        top = sorted(events, key=time_of, reverse=True)[:15]
        Path(out_json).write_text(json.dumps({
            "steps": PROFILE_STEPS, "device": "cuda" if cuda else "cpu", "step_ms": step_ms, "busy_ms": busy,
            "idle_share": None if not step_ms or not cuda else max(0.0, 1 - busy / step_ms),
            "categories_ms": dict(sorted(shares.items(), key=lambda kv: -kv[1])),
            "top": [{"name": e.key[:120], "ms_per_step": time_of(e) / 1e3 / PROFILE_STEPS, "calls": e.count}
                    for e in top]}, indent=1) + "\n")

    prof = profile(activities=activities, schedule=schedule(wait=warmup - 1, warmup=1, active=PROFILE_STEPS, repeat=1),
                   on_trace_ready=summarize)

    def after_optimizer_step(*_):
        if cuda:
            torch.cuda.synchronize()
        if prof.step_num >= warmup - 1 and len(spans) <= PROFILE_STEPS:  # the window's edges, steps synchronised
            spans.append(time.perf_counter())
        prof.step()

    register_optimizer_step_post_hook(after_optimizer_step)
    sys.argv = [script, *args]
    prof.start()
    runpy.run_path(script, run_name="__main__")
    prof.stop()


def command(rung: Rung, out_dir: Path, launcher: list[str]) -> list[str]:
    script = f"experiments/{rung.experiment}/train.py"
    if rung.syncs:
        return [*launcher, "-c", SYNC_CHILD, script, *rung.args, "--out-dir", str(out_dir)]
    if rung.profile:
        return [*launcher, "assets/gpu_suite.py", "--profile-child", str(out_dir / "profile.json"), script,
                *rung.args, "--out-dir", str(out_dir)]
    if rung.experiment == "peer":
        return [*launcher, "assets/peer_baseline.py", *rung.args, "--out-dir", str(out_dir)]
    if rung.nproc > 1 or rung.experiment != "single-ft":
        return [*launcher, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={rung.nproc}",
                script, *rung.args, "--out-dir", str(out_dir)]
    return [*launcher, script, *rung.args, "--out-dir", str(out_dir)]


def fastest(rung: Rung, all_rungs: list[Rung], kept: Path) -> Rung:
    """The profile rung with the arguments of the fastest kept run of its ladder (same name and prediction)."""
    best, best_rate = None, 0.0
    for candidate in all_rungs:
        summary_file = kept / candidate.name / "summary.json"
        if candidate.ladder == rung.ladder and not candidate.profile and summary_file.exists():
            rate = json.loads(summary_file.read_text())["tokens_per_s"] or 0.0
            if rate > best_rate:
                best, best_rate = candidate, rate
    if best is None:
        return rung
    args = list(best.args)  # its command, cut to the steps the profile needs
    warmup = int(args[args.index("--timing-warmup-steps") + 1])
    args[args.index("--steps") + 1] = str(warmup + PROFILE_STEPS + 1)
    return Rung(rung.name, rung.experiment, tuple(args), rung.prediction + f" (profiled: {best.name})", rung.ladder,
                profile=True, priority=rung.priority)


def peer_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("trl", "datasets"))


def wheels_instructions() -> str:
    """How to bring the peer baseline's packages to an offline GPU machine, at the versions uv.lock pins."""
    lock = (REPO_ROOT / "uv.lock").read_text()
    pins = []
    for name in PEER_WHEELS:
        match = re.search(rf'^name = "{name}"\nversion = "([^"]+)"', lock, re.MULTILINE)
        pins.append(f"{name}=={match.group(1)}" if match else name)
    return "\n".join([
        "The suite needs torch, transformers and peft only. For the TRL comparison, bring these wheels (versions from",
        "uv.lock; torch, transformers, accelerate, pyarrow and the rest are on the lent machine). On a machine with",
        "the package index, in the repository root:",
        "",
        "    echo /.whl/ >> .git/info/exclude",
        "    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\",
        "        --platform manylinux2014_x86_64 -d .whl " + " ".join(pins),
        "",
        "Carry .whl/ to the GPU machine with the checkout, and there, before the suite:",
        "",
        "    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && "
        "export PYTHONPATH=/tmp/site",
        "    python3 assets/gpu_suite.py",
        "",
        "Without them the suite runs everything else and notes the TRL comparison as skipped.",
    ])


def device_slug(dry_run: bool) -> str:
    if dry_run:
        return "cpu-dry-run"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no GPU visible to torch (torch.cuda.is_available() is False); "
                         "use --dry-run to check the suite on a CPU")
    name = torch.cuda.get_device_name(0).lower()
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def parity(run_dir: Path, baseline_dir: Path) -> float | None:
    """Largest relative difference of the first steps' losses from the baseline's; None when the run does not do the
    baseline's optimizer steps (the same test as make_posts' parity region: make_plots.Run.step_key)."""
    run, baseline = load_run(run_dir), load_run(baseline_dir)
    if run.step_key() != baseline.step_key() or not run.steps or not baseline.steps:
        return None
    pairs = list(zip(run.steps, baseline.steps))[:FIRST_STEPS]
    return max(abs(mine["loss"] - theirs["loss"]) / abs(theirs["loss"]) for mine, theirs in pairs)


def fastest_kept(members: list[Rung], kept: Path) -> Path | None:
    """The kept run of a ladder with the most tokens/s: the one its profile rung ran (`fastest`)."""
    rates = {kept / rung.name: json.loads((kept / rung.name / "summary.json").read_text())["tokens_per_s"] or 0.0
             for rung in members if not rung.profile and (kept / rung.name / "summary.json").exists()}
    return max(rates, key=rates.get) if rates else None


def profile_heading(profiled: dict, where: str, run_dir: Path | None) -> str:
    """The line above the profile's categories. The profiled steps are slower than the run's own (the profiler
    costs host time), so the idle share is also given against the unprofiled run's median step."""
    text = (f"Where the fastest rung's step goes ({where}, torch.profiler over {profiled['steps']} steps; "
            f"{profiled['device']} time per step")
    if profiled["step_ms"]:
        text += f", {profiled['step_ms']:.1f} ms wall per profiled step"
    if profiled["idle_share"] is not None:
        text += f", device idle {profiled['idle_share']:.0%} of it"
        if run_dir is not None:
            run = load_run(run_dir)
            warmup = run.summary.get("warmup_steps_excluded", 0)
            steps = sorted(step["step_ms"] for step in run.steps if step["step"] > warmup)
            if steps:
                median = steps[len(steps) // 2] if len(steps) % 2 else sum(steps[len(steps) // 2 - 1:][:2]) / 2
                idle = max(0.0, 1 - profiled["busy_ms"] / median)
                text += (f"; the profiler slows the host, and against the median unprofiled step of {run_dir.name} "
                         f"({median:.1f} ms) the same device time leaves {idle:.0%} idle")
    return text + "):"


def write_entry(root: Path, entry: Path, series: str, plan: Plan, done: dict[str, str], all_rungs: list[Rung],
                started: str, invocation: str) -> None:
    data = f"devlog/data/{series}"
    kept = {rung.name for rung in all_rungs if (root / data / rung.name / "summary.json").exists()}
    lines = [f"# {series.split('-gpu-suite-')[0]} the GPU suite on {series.split('-gpu-suite-')[1]}", ""]
    if kept:
        lines += [f"<!-- generated:hardware runs={data}/* -->", "<!-- /generated -->", ""]
    lines += [f"Made with `{invocation}` (assets/gpu_suite.py), started {started}: {plan.model}, {plan.dtype}, "
              f"{plan.steps} steps per run, the first {plan.warmup} left out of the averages. Each ladder adds one "
              f"feature per rung; every rung that does the baseline's optimizer steps is compared with its losses.", ""]
    kernels_file = root / data / "kernel-check.json"
    if kernels_file.exists():
        lines += ["## Kernels", "", f"Each variable-length kernel against SDPA with the block-diagonal mask in fp32 "
                  f"(forward and gradients, largest error relative to the largest value; {data}/kernel-check.json, "
                  f"written by the suite's first stage):", ""]
        for row in json.loads(kernels_file.read_text()):
            error = "did not run: " + row["error"] if row.get("error") else f"{row['max_rel_error']:.1e}"
            limit = "" if row["tolerance"] is None else f" (tolerance {row['tolerance']:.1e}: " \
                f"{'ok' if row['ok'] else 'FAILED'})"
            lines.append(f"- {row['kernel']}, {row['dtype']}, {'with' if row['backward'] else 'without'} "
                         f"backward: {error}{limit}")
        lines.append("")
    for ladder in dict.fromkeys(rung.ladder for rung in all_rungs):
        members = [rung for rung in all_rungs if rung.ladder == ladder]
        lines += [f"## {ladder}", ""]
        if ladder == "peer":
            sides = [f"{data}/{rung.name}-{side}" for rung in members for side in ("single-ft", "trl-sft")
                     if (root / data / f"{rung.name}-{side}" / "summary.json").exists()]
            if sides:
                lines += [f"<!-- generated:table runs={','.join(sides)} cols=run,seq,micro,t_eff,step_ms,"
                          f"step_ms_median,step_ms_max,tok_s,tok_s_median,rel:tok_s,mfu,peak_mem ref={sides[0]} -->", "<!-- /generated -->", ""]
            lines += [f"- `{rung.name}` ({done.get(rung.name, 'measured' if sides else 'not run')}): "
                      f"{rung.prediction}." for rung in members]
            lines.append("")
            continue
        if ladder == "syncs":
            syncs_file = root / data / "host-syncs.json"
            if syncs_file.exists():
                counts = json.loads(syncs_file.read_text())
                lines += [f"Host syncs per optimizer step over {counts['steps_counted']} steps after the warm-up "
                          f"({data}/host-syncs.json): {counts['total_per_step']:g} in all", ""]
                lines += [f"- `{where}`: {n:g}" for where, n in sorted(counts["per_step"].items())] + [""]
            lines += [f"Predicted before the runs: {members[0].prediction}.", ""]
            continue
        measured = [rung for rung in members if rung.name in kept]
        if measured:
            names = ",".join(f"{data}/{rung.name}" for rung in measured)
            ref = f" ref={data}/{measured[0].name}" if measured[0] is members[0] else ""
            columns = "run,seq,micro,lora,t_eff,step_ms,step_ms_median,step_ms_max,tok_s,tok_s_median" + \
                (",rel:tok_s" if ref else "") + ",mfu,peak_mem,predicted_peak"
            lines += [f"<!-- generated:table runs={names} cols={columns}{ref} -->", "<!-- /generated -->", ""]
            twins = [rung for rung in measured[1:] if ref and parity(root / data / rung.name,
                                                                      root / data / members[0].name) is not None]
            if twins:
                lines += [f"<!-- generated:parity runs={','.join(f'{data}/{r.name}' for r in twins)}{ref} -->",
                          "<!-- /generated -->", ""]
        profile_file = root / data / "profile.json"
        if profile_file.exists() and any(rung.profile for rung in members):
            profiled = json.loads(profile_file.read_text())
            lines += [profile_heading(profiled, f"{data}/profile.json", fastest_kept(members, root / data)), ""]
            lines += [f"- {name}: {ms:.2f} ms" for name, ms in profiled["categories_ms"].items()]
            lines += ["", "Top kernels:", ""]
            lines += [f"- {row['ms_per_step']:.2f} ms, {row['calls']} calls: `{row['name']}`"
                      for row in profiled["top"][:10]] + [""]
        lines += ["Predicted before the runs:", ""]
        for rung in members:
            earlier = rung.name in kept or (rung.profile and profile_file.exists())  # by an earlier call (--only)
            status = done.get(rung.name, "measured" if earlier else "not run")
            lines.append(f"- `{rung.name}` ({status}): {rung.prediction}.")
        lines.append("")
    if kept:
        lines += ["<!-- generated:provenance -->", "<!-- /generated -->", ""]
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text("\n".join(lines))
    import make_posts  # the regions are filled by the same generator as every other page

    problems = make_posts.build(root, only=str(entry.relative_to(root)), figures=False, print_fn=lambda *a: None)
    if problems:
        print(f"gpu_suite: make_posts reported {problems} problem(s) in {entry}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--profile-child"]:
        profile_child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run the stages on the CPU (tiny preset, DRY_PLAN)")
    parser.add_argument("--list", action="store_true", help="print the runs, commands and predictions; run nothing")
    parser.add_argument("--wheels", action="store_true",
                        help="print which wheels the TRL comparison needs on an offline machine, and how to bring them")
    parser.add_argument("--budget-min", type=float, default=9.0, help="stop starting runs after this many minutes")
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="where devlog/ is written (the repository by default; tests use a scratch folder); "
                             "the runs' own output goes to the repository's runs/ (ignored by git)")
    parser.add_argument("--date", default=date.today().isoformat())
    parser.add_argument("--only", default=None, help="comma-separated run names or patterns (fnmatch) to run, e.g. "
                        "'peer-*,fsdp-*': a later call adds to an entry whose earlier runs are in devlog/data")
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    all_rungs = rungs(plan)
    launcher = [sys.executable]
    if args.wheels:
        print(wheels_instructions())
        return 0
    if args.list:
        for rung in all_rungs:
            print(shlex.join(command(rung, Path("runs/gpu-suite") / rung.name, ["python3"])))
            print(f"    predicted: {rung.prediction}")
        return 0
    slug = device_slug(args.dry_run)
    series = f"{args.date}-gpu-suite-{slug}"
    root = args.root.resolve()
    # Each run's own output stays in the checkout's runs/ (ignored by git), and its --out-dir is given relative to
    # the repository root, so the command recorded in summary.json names no folder of this machine.
    scratch, kept = REPO_ROOT / "runs" / "gpu-suite" / series, root / "devlog" / "data" / series
    entry = root / "devlog" / f"{series}.md"
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    invocation = "python3 assets/gpu_suite.py" + (" --dry-run" if args.dry_run else "")
    started, clock = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    done: dict[str, str] = {}
    failures = []
    print("[kernels] varlen kernels against masked SDPA", flush=True)
    kernels = kernel_check("cpu" if args.dry_run else "cuda")
    kept.mkdir(parents=True, exist_ok=True)
    (kept / "kernel-check.json").write_text(json.dumps(kernels, indent=1) + "\n")
    for row in kernels:
        print(f"    {row['kernel']}: {row['max_rel_error']} ({'ok' if row['ok'] else row.get('error', 'FAILED')})",
              flush=True)
        if not row["ok"]:
            failures.append(f"kernel {row['kernel']}")
    taken: dict[bool, float] = {}  # the longest run so far, without / with --compile
    for index, rung in enumerate(sorted(all_rungs, key=lambda r: r.priority), start=1):
        elapsed, compiled = time.perf_counter() - clock, "--compile" in rung.args or rung.profile
        if args.only and not any(fnmatch.fnmatch(rung.name, p) for p in args.only.split(",")):
            continue
        if elapsed + taken.get(compiled, RUN_ESTIMATE_S[compiled]) > args.budget_min * 60 and not args.dry_run:
            done[rung.name] = "skipped: time budget"
            print(f"[{index}/{len(all_rungs)}] {rung.name}: skipped, {elapsed / 60:.1f} of {args.budget_min} min used",
                  flush=True)
            continue
        if rung.experiment == "peer" and not peer_installed():
            done[rung.name] = "skipped: trl or datasets not installed (python3 assets/gpu_suite.py --wheels)"
            print(f"[{index}/{len(all_rungs)}] {rung.name}: skipped, trl or datasets not installed", flush=True)
            write_entry(root, entry, series, plan, done, all_rungs, started, invocation)
            continue
        if rung.profile:
            rung = fastest(rung, all_rungs, kept)
            if not rung.args:
                done[rung.name] = "skipped: no rung of its ladder measured"
                continue
        out = scratch / rung.name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        cmd = command(rung, out.relative_to(REPO_ROOT), launcher)
        print(f"[{index}/{len(all_rungs)}] {shlex.join(cmd)}", flush=True)
        run_start = time.perf_counter()
        with open(out / "train.log", "w") as log:
            code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - run_start
        if rung.experiment != "peer":  # two trainings in one: not what the next run will take
            taken[compiled] = max(taken.get(compiled, 0.0), seconds)
        if rung.syncs and code == 0:
            counts = count_syncs((out / "train.log").read_text(), skip_steps=plan.warmup)
            (kept / "host-syncs.json").write_text(json.dumps(counts, indent=1) + "\n")
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {counts['total_per_step']:g} host syncs per step", flush=True)
        elif rung.profile and code == 0 and (out / "profile.json").exists():
            shutil.copy(out / "profile.json", kept / "profile.json")
            summary = json.loads((out / "profile.json").read_text())
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {json.dumps(summary['categories_ms'])[:300]}", flush=True)
        elif rung.experiment == "peer" and code == 0:
            for side in ("single-ft", "trl-sft"):
                keep(out / side, kept / f"{rung.name}-{side}")
            ratio_file = out / "peer_baseline.json"
            ratio = json.loads(ratio_file.read_text()) if ratio_file.exists() else {}
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {json.dumps(ratio)[:300]}", flush=True)
        elif code != 0 or not (out / "summary.json").exists():
            tail = (out / "train.log").read_text().strip().splitlines()[-1:] or [""]
            done[rung.name] = f"failed (exit {code})"
            failures.append(rung.name)
            print(f"    FAILED ({code}) in {seconds:.0f} s: {tail[0][:200]}", flush=True)
        else:
            keep(out, kept / rung.name)  # summary.json and metrics.jsonl, as run_series keeps every series
            summary = json.loads((out / "summary.json").read_text())
            done[rung.name] = "measured"
            baseline = next(r for r in all_rungs if r.ladder == rung.ladder)
            difference = parity(kept / rung.name, kept / baseline.name) if rung is not baseline else None
            check = "" if difference is None else \
                f", losses vs baseline {difference:.1e} ({'ok' if difference <= BF16_TOLERANCE else 'MISMATCH'})"
            if difference is not None and difference > BF16_TOLERANCE:
                failures.append(f"{rung.name} (loss mismatch)")
            print(f"    {seconds:.0f} s: {summary['tokens_per_s']:,.0f} tok/s, step {summary['step_ms']:.0f} ms, "
                  f"peak {summary['peak_mem_gib']:.2f} GiB{check}", flush=True)
        write_entry(root, entry, series, plan, done, all_rungs, started, invocation)
    print(f"gpu_suite: {sum(v == 'measured' for v in done.values())} of {len(all_rungs)} runs kept in "
          f"{kept.relative_to(root)}; entry {entry.relative_to(root)}" +
          (f"; problems: {', '.join(failures)}" if failures else ""), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
