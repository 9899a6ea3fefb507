"""The GPU suite: one command that turns a GPU machine into committed numbers, the targets first.

    python3 assets/gpu_suite.py              # on a GPU machine, from the repository root; no uv or network needed
    python3 assets/gpu_suite.py --list       # the plan in run order: each run's command and its prediction
    python3 assets/gpu_suite.py --wheels     # which wheels the loss libraries and the TRL comparison need offline
    python3 assets/gpu_suite.py --dry-run    # the same stages on the CPU, tiny preset (what the tests run); it
                                             # writes into a fresh temporary folder unless --root names one

The targets (full SFT of Qwen3-0.6B at sequence 1024, and LoRA r16 at sequence 2048, each >= 100,000 tokens/s on
one H100, with per-step losses equal to the reference path within the bf16 tolerance at the same global batch)
decide the order: what decides them and loses the least when the machine is cut off runs first.
1. Probe (half a minute): the versions; every attention kernel against SDPA with the block-diagonal mask (torch's
   varlen_attn, flash-attn, FlexAttention over flattened tokens and over rows with the document block mask, the
   per-document reference), forward and gradients, on packed random q/k/v of Qwen3-0.6B's head geometry; and the
   LM-head losses on the real shapes (a step's loss tokens x 1,024 x 151,936): the plain loss, common/loss.py's
   chunked reference and fused loss at several chunk sizes, cut-cross-entropy and Liger-Kernel's fused linear
   cross-entropy where installed (`--wheels`), each timed forward + backward and held to the fp32 loss and
   gradients (probe.json).
2. Full SFT at sequence 1024 with every fast flag (varlen attention, the fused loss, compile; fused AdamW with the
   clipping folded in, pinned batches, the garbage-collection schedule and one host read per step are always on in
   single-ft) at micro-batch 8 (x 2 accumulated) and 16, the same 16 rows per optimizer step, 30 steps each: mean,
   median and slowest step, gc_ms, recompiles, the steps until the time settled; then the same-global-batch eager
   reference (SDPA with the packed rows' mask, the plain loss, no compile), whose per-step losses the fast rungs
   must equal within BF16_TOLERANCE over the first FIRST_STEPS steps.
3. The same for LoRA r16 at sequence 2048, micro-batch 4 (x 2) and 8.
4. torch.profiler over the fastest full-SFT rung: device time by kernel and category, and the idle share against
   the unprofiled run's median step (profile.json).
5. FlexAttention (--attn flex) in place of varlen on the fastest shape; the host syncs of a fast step counted by
   torch.cuda.set_sync_debug_mode (host-syncs.json).
6. What is left of the earlier ladder (eager micro-batch-1 rungs adding one feature at a time, larger micro-batches,
   sequence 4096, LoRA at 1024), fsdp-ft on one rank, and TRL's SFTTrainer beside single-ft (assets/peer_baseline.py,
   with its wheels): behind the targets, reached by a longer budget or `--only`.

Each run is the experiment's own command line (`python3 experiments/<x>/train.py ...`), launched as a user would,
with the repository on PYTHONPATH so that it needs nothing but torch, transformers and peft. Every run that
finishes is kept at once: its summary.json and metrics.jsonl go to devlog/data/<date>-gpu-suite-<device>/<run>/,
devlog/<date>-gpu-suite-<device>.md is (re)written with generated regions (assets/make_posts.py) over what is kept so
far, and one archive, <out>/<date>-gpu-suite-<device>.tar.gz, is rewritten with all of it (and each run's log): a
suite cut off by its time budget (--budget-min, default 9) or by the machine going away leaves one usable file. Runs
the budget would overrun are skipped with a note; `python3 assets/gpu_suite.py --date <the entry's date> --only
'<names or patterns>'` on a later machine of the same kind adds them to the same entry (run it in a checkout that
holds the entry's devlog/data/ folder, or with --root where the earlier archive was unpacked); a hand-written
"## What it says" section of the entry is kept. Each rung carries its prediction, written before any GPU run: the
entry prints it beside the measurement.

From a fresh GPU machine to the committed entry:
1. Bring the checkout (and .whl/ from `--wheels`) to the machine; no uv, lock or network is needed there (Python
   3.10+, torch 2.10+ for PyTorch's varlen kernel, transformers 5, peft).
2. From the repository root: `python3 assets/gpu_suite.py --out <folder whose files come back>`.
3. Unpack the archive into the repository (`tar xzf <archive>`), then on a machine with the environment: `uv run
   python assets/make_posts.py` (fills the posts' GPU slots from the kept runs; `--check` must pass), and commit
   devlog/data/<date>-gpu-suite-<device>/ and the entry.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
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

BF16_TOLERANCE = 2e-2  # largest relative per-step loss difference from the reference rung, first 5 steps, bf16
FIRST_STEPS = 5
PEER_WHEELS = ("trl", "datasets", "dill", "multiprocess")  # what the peer baseline needs beyond the lent machine's
# The loss libraries the probe compares with common/loss.py (pure-Python wheels; Triton comes with torch there).
LOSS_WHEELS = {"cut-cross-entropy": "25.1.1", "liger-kernel": "0.8.5"}


@dataclass(frozen=True)
class Rung:
    name: str  # run folder name; single-ft runs start with "single-ft" so the posts' GPU slots find them
    experiment: str
    args: tuple[str, ...]
    prediction: str  # written before any GPU run
    ladder: str  # the entry's section
    # Wall time guessed before any run, the budget's first guess (then the longest run of its kind so far): ~20 s to
    # import and build the model, ~40 s to compile the decoder layer and the loss's kernel (less when the inductor
    # cache has the same shapes: the profile), then the steps.
    estimate_s: int
    reference: str | None = None  # the run whose per-step losses this one must equal (same optimizer steps)
    nproc: int = 1
    syncs: bool = False  # run under torch.cuda.set_sync_debug_mode to count host syncs (not timed, not kept)
    profile: bool = False  # profile the fastest rung of its ladder (its args are chosen when it runs)

    @property
    def compiled(self) -> bool:
        return "--compile" in self.args or self.profile


@dataclass
class Target:
    label: str  # e.g. s1024-full
    seq: int
    lora: int
    splits: tuple[tuple[int, int], ...]  # (micro-batch, grad-accum) of the fast rungs: the same rows per step
    predictions: tuple[str, ...]  # one per split
    reference_prediction: str


@dataclass
class Plan:
    model: str
    dtype: str
    steps: int  # of the target rungs and their references (the same --steps: the same LR schedule)
    warmup: int  # --timing-warmup-steps of the target rungs (compilation and allocator growth stay out of averages)
    chunk: int  # --loss-chunk-tokens of the target rungs
    targets: list[Target]
    bench_tokens: int  # the probe's loss benchmark: loss tokens x hidden size x vocabulary
    bench_hidden: int
    bench_vocab: int
    bench_chunks: tuple[int, ...]
    compile: bool = True  # the dry run leaves torch.compile out (tests/test_loss.py checks it; on CPU it only costs)
    flex: bool = True  # the --attn flex rung (the dry run leaves it out: FlexAttention has no CPU backward)
    syncs: bool = True  # the host-sync count (no CUDA in a dry run, no sync to count)
    ladder_steps: int = 20  # the earlier ladder's runs
    ladder_warmup: int = 5
    ladders: list[tuple[str, int, int, tuple[int, ...]]] = field(default_factory=list)  # (label, seq, lora, micros)
    fsdp_seq: int | None = 1024  # fsdp-ft on one rank (None: not in the plan)
    peer_seq: int | None = 1024  # TRL beside single-ft (None: not in the plan)
    peer_micro: int = 4


# Predictions for the targets, before any run on them. What they start from (devlog/2026-11-26-gpu-suite-nvidia-h200):
# on an H200, compiled, varlen, chunked loss, micro-batch 8: 59,147 tok/s by the mean, ~79,700 by the median step; the
# profiled step (8,192 tokens, 144 ms wall) was matrix products 33.7 ms, attention 13.3 ms, optimizer 6.8 ms, "other"
# 29.4 ms (of which ~11 ms the loss's fp32 log-softmax and its casts), the device idle 39% of the wall time. An H100
# has the same bf16 peak and ~1.4x less memory bandwidth: the matrix products keep their time, the element-wise and
# memory-bound rest (~half of the busy time) takes ~1.4x longer. What changed since: the fused loss (no fp32 softmax
# kept, no recompute: ~11 ms -> ~5 ms per 8k tokens), no straggler steps (the garbage-collection schedule), one pass
# fewer over the gradients (clipping folded into fused AdamW), no device read per forward (varlen registers no mask
# function), one compiled graph whatever the document count.
FULL_PREDICTIONS = (
    "75,000-95,000 tok/s by the median step on an H100 (the H200's ~80k at 8k tokens per forward, +10-20% from the "
    "fused loss, no per-forward device read and the folded clipping, -10-15% for the H100's slower memory); the mean "
    "within 5% of the median (no straggler step: gc_ms near 0 in every step); 0 recompiles after step 1; losses "
    "equal to the reference's within the bf16 tolerance: short of 100,000",
    "80,000-100,000 tok/s by the median step on an H100, 5-10% above micro-batch 8 x 2 (the same rows per step in "
    "one forward: half the kernel launches per token, larger matrix products); peak memory ~1.6x micro-batch 8's "
    "(activations double, weights, gradients and AdamW state do not); the mean within 5% of the median; 0 "
    "recompiles; the same losses: likely still short of 100,000",
)
FULL_REFERENCE = (
    "the eager reference at the same 16 rows per step (SDPA with the packed rows' [seq x seq] mask, the plain fp32 "
    "loss, no compile): 20,000-35,000 tok/s on an H100; its per-step losses are the ones the fast rungs must match")
LORA_PREDICTIONS = (
    "90,000-115,000 tok/s by the median step on an H100: a frozen base has no weight-gradient products (4N instead of "
    "6N FLOPs per token) and AdamW updates only the adapters, while documents of ~60 tokens keep attention's share "
    "small at sequence 2048; the same losses as its reference; 0 recompiles",
    "100,000-125,000 tok/s by the median step on an H100, 5-10% above micro-batch 4 x 2 (one forward per step): the "
    "LoRA target reached here if anywhere; peak memory below the full-SFT rungs' (no fp32 gradients or AdamW state "
    "for the base)",
)
LORA_REFERENCE = (
    "the eager LoRA reference at the same 8 rows of 2,048 per step: 20,000-35,000 tok/s on an H100 (the [2048 x "
    "2048] mask per layer and the plain loss's fp32 logits over 16k positions dominate what LoRA saves)")

PROBE_ESTIMATE_S = 45  # versions, the kernel check, each loss timed (Triton and torch.compile compile first)
PROBE_PREDICTION = (
    "every kernel within 3x masked SDPA's own bf16 rounding, FlexAttention over rows included (forward and "
    "backward); on 8,192 loss tokens x 1,024 x 151,936 (three GEMMs of 2.5 TFLOP each, ~12 ms at ~650 TFLOP/s, plus "
    "passes over 1.2G logits): the plain loss 20-30 ms and ~12 GiB at its peak (bf16 logits, their fp32 copy, the "
    "fp32 log-softmax and gradients), common/loss.py's fused loss 14-20 ms with 2-3 GiB at chunk 4096 (one fp32 pass "
    "per chunk, compiled), its chunked reference ~1.3x the fused one (a fourth GEMM), Liger within 20% of ours, "
    "cut-cross-entropy the fastest and smallest (it never writes the logits); all within the tolerance")

GPU_PLAN = Plan(
    model="qwen3-0.6b", dtype="bf16", steps=30, warmup=8, chunk=4096,
    targets=[Target("s1024-full", 1024, 0, ((8, 2), (16, 1)), FULL_PREDICTIONS, FULL_REFERENCE),
             Target("s2048-lora16", 2048, 16, ((4, 2), (8, 1)), LORA_PREDICTIONS, LORA_REFERENCE)],
    bench_tokens=8192, bench_hidden=1024, bench_vocab=151_936, bench_chunks=(1024, 4096, 8192),
    ladders=[("s1024-full", 1024, 0, (4, 8)), ("s4096-full", 4096, 0, (2,)), ("s4096-lora16", 4096, 16, (2,)),
             ("s1024-lora16", 1024, 16, (4, 8))])
# The dry run: one target with one fast split and its reference, the profile, TRL (skipped without its wheels). Each
# rung is a process that spends most of its time importing; compile, flex, the host syncs, fsdp-ft and the earlier
# ladder are left to the tests that cover them (tests/test_loss.py, test_attention.py, test_gpu_suite.py's
# count_syncs, test_ddp_fsdp.py).
DRY_PLAN = Plan(
    model="qwen3-tiny", dtype="fp32", steps=4, warmup=1, chunk=32,
    targets=[Target("s64-full", 64, 0, ((2, 1),), ("fp32 on a CPU: the same losses as the reference",),
                    "the reference path on a CPU")],
    bench_tokens=256, bench_hidden=64, bench_vocab=512, bench_chunks=(64, 256),
    compile=False, flex=False, syncs=False, fsdp_seq=None, peer_seq=64, peer_micro=2)


def run_args(plan: Plan, steps: int, warmup: int) -> tuple[str, ...]:
    return ("--model", plan.model, "--dtype", plan.dtype, "--steps", str(steps), "--eval-fraction", "0",
            "--timing-warmup-steps", str(warmup), "--comm-profile-steps", "0")


def rungs(plan: Plan) -> list[Rung]:
    """The plan in run order."""
    out = []
    compile_flag = ("--compile",) if plan.compile else ()
    fast_of = {}
    for target in plan.targets:
        base = (*run_args(plan, plan.steps, plan.warmup), "--seq-len", str(target.seq),
                *(("--lora-rank", str(target.lora)) if target.lora else ()))
        reference = f"single-ft-{target.label}-reference"
        for (micro, accum), prediction in zip(target.splits, target.predictions):
            split = ("--micro-batch-size", str(micro), "--grad-accum", str(accum))
            fast = (*base, "--attn", "varlen", "--loss-chunk-tokens", str(plan.chunk), *compile_flag, *split)
            name = f"single-ft-{target.label}-fast-m{micro}" + (f"x{accum}" if accum > 1 else "")
            out.append(Rung(name, "single-ft", fast, prediction, ladder=f"targets {target.label}",
                            estimate_s=75 if plan.compile else 30, reference=reference))
            fast_of[target.label] = fast
        micro, accum = target.splits[0]
        out.append(Rung(reference, "single-ft", (*base, "--attn", "sdpa", "--micro-batch-size", str(micro),
                                                 "--grad-accum", str(accum)),
                        target.reference_prediction, ladder=f"targets {target.label}", estimate_s=40))
    first = plan.targets[0].label
    out.append(Rung(f"profile-{first}", "single-ft", (), (
        "the fastest full-SFT rung's step by kernel: matrix products ~half of the device's busy time, attention "
        "~15-20%, the fused loss below 5% (the old loss was ~8%), the optimizer ~5%; the device idle under 10% of the "
        "unprofiled median step (no per-forward read, compiled layers, one read per step)"),
        ladder=f"targets {first}", estimate_s=45, profile=True))
    if plan.flex:
        micro, accum = plan.targets[0].splits[-1]
        flex = tuple("flex" if arg == "varlen" else arg for arg in fast_of[first])
        out.append(Rung(f"single-ft-{first}-flex-m{micro}" + (f"x{accum}" if accum > 1 else ""), "single-ft", flex, (
            "within 15% of the varlen rung's tok/s at the same shape: FlexAttention skips the empty 128 x 128 blocks "
            "of the document mask but computes the partly filled ones whole (documents of ~60 tokens fill few), "
            "where the varlen kernel launches mostly empty thread blocks; the same losses; 0 recompiles (static "
            "shapes)"), ladder=f"targets {first}", estimate_s=90, reference=f"single-ft-{first}-reference"))
    if plan.syncs:
        out.append(Rung(f"syncs-{first}", "single-ft", (*fast_of[first][:], "--steps", str(plan.warmup + 3)), (
            "one synchronisation per optimizer step, train.py's (the step line's loss and gradient norm read "
            "together); none from transformers' packed-row check (varlen registers no mask function) nor from the "
            "loss"), ladder="syncs", estimate_s=75, syncs=True))
    out += ladder_rungs(plan)
    if plan.fsdp_seq:
        out.append(Rung(f"fsdp-ft-s{plan.fsdp_seq}-full-1rank", "fsdp-ft", (
            *run_args(plan, plan.ladder_steps, plan.ladder_warmup), "--seq-len", str(plan.fsdp_seq), "--attn",
            "varlen"), (
            "FSDP2 on one rank: nothing to shard or communicate, so the cost of its wrapping alone; at micro-batch 1 "
            "the step is host-bound, and the H200 run measured 0.56x single-ft's varlen rung: about the same"),
            ladder="fsdp", estimate_s=60))
    if plan.peer_seq:
        out.append(Rung(f"peer-s{plan.peer_seq}-full", "peer", (
            "--model", plan.model, "--dtype", plan.dtype, "--steps", str(plan.ladder_steps), "--seq-len",
            str(plan.peer_seq), "--micro-batch-size", str(plan.peer_micro), "--grad-accum", "1", "--attn", "sdpa",
            "--timing-warmup-steps", str(plan.ladder_warmup)), (
            "both with SDPA and eager: single-ft ~2.5x TRL's tok/s as on the H200 (TRL's steps slower and uneven; "
            "its per-micro-batch host reads); single-ft's fast rungs above are the comparison that matters"),
            ladder="peer", estimate_s=120))
    return out


def ladder_rungs(plan: Plan) -> list[Rung]:
    """The earlier ladder: from the eager micro-batch-1 baseline, one feature per rung, then larger micro-batches."""
    out = []
    compile_flag = ("--compile",) if plan.compile else ()
    for label, seq, lora, micros in plan.ladders:
        base = (*run_args(plan, plan.ladder_steps, plan.ladder_warmup), "--seq-len", str(seq),
                *(("--lora-rank", str(lora)) if lora else ()), "--attn", "sdpa")
        varlen = (*base[:-1], "varlen")
        fused = (*varlen, "--loss-chunk-tokens", "1024")
        compiled = (*fused, *compile_flag)
        baseline = f"single-ft-{label}-1-baseline"
        out += [
            Rung(baseline, "single-ft", base, (
                "the reference: SDPA over packed rows with a block-diagonal [seq x seq] mask, eager, micro-batch 1: "
                "host-bound on this GPU (a few thousand kernel launches for one row)"), ladder=label, estimate_s=45),
            Rung(f"single-ft-{label}-2-varlen", "single-ft", varlen, (
                "same losses; fewer host operations (no mask to build, no per-forward device read): ~1.8x as on "
                "the H200"), ladder=label, estimate_s=45, reference=baseline),
            Rung(f"single-ft-{label}-3-fused-loss", "single-ft", fused, (
                "same losses; the fused loss's gradients come with its forward: a few percent faster than the "
                "rung before and less memory (no logits over every position)"), ladder=label, estimate_s=45,
                reference=baseline),
        ]
        if plan.compile:
            out.append(Rung(f"single-ft-{label}-4-compile", "single-ft", compiled, (
                "same losses; ~2x from fewer, fused kernels in a host-bound step, as on the H200"),
                ladder=label, estimate_s=90, reference=baseline))
        out += [Rung(f"single-ft-{label}-5-micro{micro}", "single-ft", (*compiled, "--micro-batch-size", str(micro)), (
            f"{micro}x the tokens per step; tokens/s up roughly {micro}x while the step stays host-bound"),
            ladder=label, estimate_s=90) for micro in micros]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Stage 1, the probe: versions, attention kernels, LM-head losses on the real shapes

KERNEL_SHAPE = dict(heads=16, kv_heads=8, head_dim=128)  # Qwen3-0.6B's attention geometry
KERNEL_DOCUMENTS = (700, 300, 24, 1000, 24)  # two rows of 1,024 slots, packed as a real row is (pads included)
KERNEL_ROWS = 2


def versions() -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    for package in ("transformers", "peft", "triton", "flash-attn", *LOSS_WHEELS, "trl"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def kernel_check(device_name: str) -> list[dict]:
    """Every installed varlen kernel (common/attention.py) on packed random q/k/v, and FlexAttention over the same
    tokens laid out as rows with the document block mask (--attn flex), forward and backward, against SDPA with the
    block-diagonal mask in fp32. The same masked SDPA in the working dtype (bf16 on a GPU) sets the scale of a normal
    rounding error: a kernel passes within 3x that (1e-5 in fp32). FlexAttention has no CPU backward."""
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
    # The rows' position ids: restarting at each document, as packing lays them out.
    position_ids = torch.cat([torch.arange(n) for n in KERNEL_DOCUMENTS]).view(KERNEL_ROWS, -1)

    def masked_sdpa(q, k, v, cu_seq_lens, max_length, scale):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    def flex_rows(q, k, v, cu_seq_lens, max_length, scale):
        # [tokens, heads, d] -> [rows, heads, seq, d], what a decoder layer hands the attention function
        rows = [t.view(KERNEL_ROWS, -1, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)]
        block_mask = attention.flex_kwargs(position_ids, device)["document_block_mask"]
        out, _ = attention.flex_attention_forward(None, *rows, None, scaling=scale, document_block_mask=block_mask)
        return out.reshape(tokens, *out.shape[2:])

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
    kernels = {k: attention._VARLEN_FUNCTIONS[k] for k in attention.available_varlen_kernels()
               if device.type == "cuda" or k in ("flex", "reference")}
    kernels["flex rows (--attn flex)"] = flex_rows
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # CPU: no compile
    for name, function in kernels.items():
        backward = device.type == "cuda" or not name.startswith("flex")  # FlexAttention has no CPU backward
        row = {"kernel": name, "dtype": str(dtype).removeprefix("torch."), "backward": backward,
               "tolerance": tolerance}
        try:
            row["max_rel_error"] = error(run(function, dtype, backward), reference)
            row["ok"] = row["max_rel_error"] <= tolerance
        except Exception as exc:  # a kernel that cannot run here is a result, not a crash of the suite
            row.update(max_rel_error=None, ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
    return rows


BENCH_REPEATS = 3  # timed forward + backward passes per loss implementation, after one untimed (compilation)


def loss_implementations(plan: Plan, cuda: bool) -> dict:
    """name -> f(hidden [n, d] leaf, weight [V, d] leaf, labels [n] on the host) -> the loss's sum over the n tokens.
    What the experiments run (common/loss.py) under autocast, as in training; the libraries on their own terms (bf16
    leaves, the weight cast once, as a bf16 model would hold it)."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    from common.data import token_loss_sum
    from common.loss import chunked_token_loss_sum, fused_linear_cross_entropy

    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else \
        (lambda: torch.autocast("cpu", enabled=False))
    one = torch.ones((), device="cuda" if cuda else "cpu")

    def plain(hidden, weight, labels):
        with autocast():
            return token_loss_sum(F.linear(hidden, weight).unsqueeze(0), labels.to(hidden.device).unsqueeze(0))

    def chunked(hidden, weight, labels):
        with autocast():
            return chunked_token_loss_sum(hidden.unsqueeze(0), weight, labels.unsqueeze(0), plan.chunk)

    def fused(chunk):
        def loss(hidden, weight, labels):
            with autocast():
                return fused_linear_cross_entropy(hidden.unsqueeze(0), weight, labels.unsqueeze(0), chunk, one)
        return loss

    implementations = {"plain (logits, fp32 cross-entropy)": plain,
                       f"common/loss.py chunked reference, chunk {plan.chunk}": chunked,
                       **{f"common/loss.py fused, chunk {chunk}": fused(chunk) for chunk in plan.bench_chunks}}
    if cuda and importlib.util.find_spec("cut_cross_entropy") is not None:
        from cut_cross_entropy import linear_cross_entropy

        implementations["cut-cross-entropy"] = lambda hidden, weight, labels: linear_cross_entropy(
            hidden.bfloat16(), weight.bfloat16(), labels.to(hidden.device), reduction="sum")
    if cuda and importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger_loss(hidden, weight, labels):
            out = liger(weight.bfloat16(), hidden.bfloat16(), labels.to(hidden.device))
            return out[0] if isinstance(out, tuple) else getattr(out, "loss", out)
        implementations["liger-kernel fused linear cross-entropy"] = liger_loss
    return implementations


def loss_bench(plan: Plan, device_name: str) -> list[dict]:
    """Each LM-head loss on `bench_tokens` loss tokens of hidden size `bench_hidden` over `bench_vocab` classes:
    forward + backward time (median of BENCH_REPEATS), the memory it adds at its peak, and its errors against the
    loss and gradients computed in fp32 (relative to the largest value). A loss passes within 3x the plain bf16
    loss's own error (1e-5 in fp32): the rule of the kernel check."""
    import torch

    device = torch.device(device_name)
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(plan.bench_tokens, plan.bench_hidden, generator=generator).to(device)
    weight = (torch.randn(plan.bench_vocab, plan.bench_hidden, generator=generator) * 0.02).to(device)
    labels = torch.randint(0, plan.bench_vocab, (plan.bench_tokens,), generator=generator)  # on the host

    def run(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = loss_fn(h, w, labels)
        loss.float().backward()
        return {"loss": loss.detach().float().reshape(1), "dhidden": h.grad.float(), "dweight": w.grad.float()}

    def error(result, reference):
        return max(float((result[key] - reference[key]).abs().max() / reference[key].abs().max())
                   for key in reference)

    with torch.autocast(device.type, enabled=False):
        def fp32(h, w, lab):
            return torch.nn.functional.cross_entropy(h @ w.t(), lab.to(h.device), reduction="sum")
        reference = run(fp32)
    rows, tolerance = [], None
    for name, loss_fn in loss_implementations(plan, cuda).items():
        row = {"loss": name}
        try:
            result = run(loss_fn)  # compiles what compiles
            row["max_rel_error"] = error(result, reference)
            if tolerance is None:  # the plain loss comes first: its error in the working dtype sets the scale
                tolerance = max(3 * row["max_rel_error"], 1e-5)
            del result
            times = []
            for _ in range(BENCH_REPEATS):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start_bytes = torch.cuda.memory_allocated() if cuda else 0
                start = time.perf_counter()
                run(loss_fn)
                if cuda:
                    torch.cuda.synchronize()
                times.append((time.perf_counter() - start) * 1000)
            row["ms"] = statistics.median(times)
            row["peak_added_gib"] = (torch.cuda.max_memory_allocated() - start_bytes) / 2**30 if cuda else None
            row["tolerance"], row["ok"] = tolerance, row["max_rel_error"] <= tolerance
        except Exception as exc:  # an implementation that cannot run here is a result, not a crash of the suite
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        rows.append(row)
    if cuda:
        import importlib.util

        rows += [{"loss": package, "ok": None, "error": "not installed (python3 assets/gpu_suite.py --wheels)"}
                 for package in LOSS_WHEELS if importlib.util.find_spec(package.replace("-", "_")) is None]
    return rows


def probe(plan: Plan, device_name: str) -> dict:
    import torch

    from common import loss

    started = time.perf_counter()
    result = {"versions": versions(), "kernels": kernel_check(device_name), "losses": loss_bench(plan, device_name),
              "shape": {"loss_tokens": plan.bench_tokens, "hidden": plan.bench_hidden, "vocab": plan.bench_vocab},
              # whether the fused loss adds each chunk's bf16 weight-gradient product into fp32 inside the GEMM
              "fused_loss_fp32_gemm_accumulation": loss._addmm_accumulates_in_fp32(torch.device(device_name))}
    result["seconds"] = time.perf_counter() - started
    return result


# ---------------------------------------------------------------------------------------------------------------
# The host syncs of a step, counted by torch.cuda.set_sync_debug_mode

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
# Where the fastest configuration's step time goes

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


def fastest(rung: Rung, all_rungs: list[Rung], kept: Path) -> tuple[Rung, Rung | None]:
    """The profile rung with the arguments of the fastest kept run of its ladder, references left out (cut to the
    steps the profile needs), and that run; (rung, None) when none of its ladder is kept yet."""
    best, best_rate = None, 0.0
    references = {other.reference for other in all_rungs}
    for candidate in all_rungs:
        summary_file = kept / candidate.name / "summary.json"
        if candidate.ladder == rung.ladder and not candidate.profile and candidate.name not in references \
                and summary_file.exists():
            rate = json.loads(summary_file.read_text())["tokens_per_s"] or 0.0
            if rate > best_rate:
                best, best_rate = candidate, rate
    if best is None:
        return rung, None
    args = list(best.args)
    warmup = int(args[args.index("--timing-warmup-steps") + 1])
    args[args.index("--steps") + 1] = str(warmup + PROFILE_STEPS + 1)
    return Rung(rung.name, rung.experiment, tuple(args), rung.prediction + f" (profiled: {best.name})", rung.ladder,
                rung.estimate_s, profile=True), best


def median_step_ms(run_dir: Path) -> float | None:
    """The median step time of a kept run's measured steps (after its timing warm-up)."""
    run = load_run(run_dir)
    warmup = run.config.get("timing_warmup_steps", 0)
    times = [step["step_ms"] for step in run.steps if step["step"] > warmup]
    return statistics.median(times) if times else None


def peer_installed() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("trl", "datasets"))


def wheels_instructions() -> str:
    """How to bring the loss libraries and the peer baseline's packages to an offline GPU machine: the peer
    baseline's at the versions uv.lock pins, the loss libraries at LOSS_WHEELS' (pure Python; Triton comes with
    torch on the machine)."""
    lock = (REPO_ROOT / "uv.lock").read_text()
    pins = []
    for name in PEER_WHEELS:
        match = re.search(rf'^name = "{name}"\nversion = "([^"]+)"', lock, re.MULTILINE)
        pins.append(f"{name}=={match.group(1)}" if match else name)
    pins += [f"{name}=={version}" for name, version in LOSS_WHEELS.items()]
    return "\n".join([
        "The suite needs torch, transformers and peft only. The probe also times cut-cross-entropy and Liger-Kernel's",
        "fused linear cross-entropy, and the TRL comparison needs trl and datasets: bring these wheels (torch,",
        "triton, transformers, accelerate, pyarrow and the rest are on the lent machine). On a machine with the package",
        "index, in the repository root:",
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
        "Without them the suite runs everything else and notes what it skipped.",
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


def parity(run_dir: Path, reference_dir: Path) -> float | None:
    """Largest relative difference of the first steps' losses from the reference's; None when the run does not do
    the reference's optimizer steps (the same test as make_posts' parity region: make_plots.Run.step_key)."""
    run, reference = load_run(run_dir), load_run(reference_dir)
    if run.step_key() != reference.step_key() or not run.steps or not reference.steps:
        return None
    pairs = list(zip(run.steps, reference.steps))[:FIRST_STEPS]
    return max(abs(mine["loss"] - theirs["loss"]) / abs(theirs["loss"]) for mine, theirs in pairs)


# ---------------------------------------------------------------------------------------------------------------
# The entry and the archive

# peak_mem beside predicted_now: common.memory's peak for each run's settings (tests/test_memory.py holds every
# committed GPU run to it)
TARGET_COLUMNS = ("run,seq,micro,ga,lora,t_eff,step_ms,step_ms_median,step_ms_max,tok_s,tok_s_median,mfu,peak_mem,"
                  "predicted_now,predicted_peak,field:gc_ms_max:.1f,field:recompiles:d,field:warmup_steps_observed:d")
LADDER_COLUMNS = ("run,seq,micro,lora,t_eff,step_ms,step_ms_median,step_ms_max,tok_s,tok_s_median,mfu,peak_mem,"
                  "predicted_now")
HANDWRITTEN = "## What it says"


def handwritten_section(entry: Path) -> str | None:
    """The entry's hand-written "## What it says" section, kept when the suite rewrites the entry."""
    if not entry.exists():
        return None
    text = entry.read_text()
    if HANDWRITTEN not in text:
        return None
    section = text[text.index(HANDWRITTEN):]
    following = re.search(r"^## ", section[len(HANDWRITTEN):], re.MULTILINE)
    return section[:len(HANDWRITTEN) + following.start()].rstrip() if following else section.rstrip()


def write_entry(root: Path, entry: Path, series: str, plan: Plan, done: dict[str, str], all_rungs: list[Rung],
                started: str, invocation: str) -> None:
    data = f"devlog/data/{series}"
    kept = {rung.name for rung in all_rungs if (root / data / rung.name / "summary.json").exists()}
    handwritten = handwritten_section(entry)
    lines = [f"# {series.split('-gpu-suite-')[0]} the GPU suite on {series.split('-gpu-suite-')[1]}", ""]
    if kept:
        lines += [f"<!-- generated:hardware runs={data}/* -->", "<!-- /generated -->", ""]
    lines += [f"Made with `{invocation}` (assets/gpu_suite.py), started {started}: {plan.model}, {plan.dtype}. The "
              f"target rungs run {plan.steps} steps, the first {plan.warmup} left out of the averages, and are "
              f"compared step by step with their same-global-batch reference; the earlier ladder runs "
              f"{plan.ladder_steps} steps ({plan.ladder_warmup} left out).", ""]
    if handwritten:
        lines += [handwritten, ""]
    probe_file = root / data / "probe.json"
    if probe_file.exists():
        lines += probe_lines(json.loads(probe_file.read_text()), data)
    profile_file = root / data / "profile.json"
    for ladder in dict.fromkeys(rung.ladder for rung in all_rungs):
        members = [rung for rung in all_rungs if rung.ladder == ladder]
        lines += [f"## {ladder}", ""]
        if ladder == "peer":
            sides = [f"{data}/{rung.name}-{side}" for rung in members for side in ("single-ft", "trl-sft")
                     if (root / data / f"{rung.name}-{side}" / "summary.json").exists()]
            if sides:
                lines += [f"<!-- generated:table runs={','.join(sides)} cols=run,seq,micro,t_eff,step_ms,"
                          f"step_ms_median,step_ms_max,tok_s,tok_s_median,rel:tok_s,mfu,peak_mem ref={sides[0]} -->",
                          "<!-- /generated -->", ""]
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
        references = [rung for rung in measured if any(other.reference == rung.name for other in members)]
        if measured:
            names = ",".join(f"{data}/{rung.name}" for rung in measured)
            ref = f" ref={data}/{references[0].name}" if references else ""
            columns = (TARGET_COLUMNS if ladder.startswith("targets") else LADDER_COLUMNS)
            columns = columns.replace("mfu,", "rel:tok_s,mfu,") if ref else columns
            lines += [f"<!-- generated:table runs={names} cols={columns}{ref} -->", "<!-- /generated -->", ""]
            twins = [rung for rung in measured if references and rung.reference == references[0].name
                     and parity(root / data / rung.name, root / data / references[0].name) is not None]
            if twins:
                lines += [f"<!-- generated:parity runs={','.join(f'{data}/{r.name}' for r in twins)}{ref} -->",
                          "<!-- /generated -->", "",
                          f"The suite's own check (bf16): each of these within {BF16_TOLERANCE:g} of the reference's "
                          f"loss, relatively, over the first {FIRST_STEPS} steps; the table's 1e-5 column is the "
                          "fp32 tests' criterion." if plan.dtype == "bf16" else "", ""]
        if profile_file.exists() and any(rung.profile for rung in members):
            lines += profile_lines(json.loads(profile_file.read_text()), data)
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


def probe_lines(probed: dict, data: str) -> list[str]:
    found = probed["versions"]
    lines = ["## Probe", "", f"{data}/probe.json, written by the suite's first stage in {probed['seconds']:.0f} s: "
             + ", ".join(f"{name} {value}" for name, value in found.items() if value) + ".", "",
             "Attention kernels against SDPA with the block-diagonal mask in fp32 (forward and gradients, largest "
             "error relative to the largest value):", ""]
    for row in probed["kernels"]:
        error = "did not run: " + row["error"] if row.get("error") else f"{row['max_rel_error']:.1e}"
        limit = "" if row["tolerance"] is None else \
            f" (tolerance {row['tolerance']:.1e}: {'ok' if row['ok'] else 'FAILED'})"
        lines.append(f"- {row['kernel']}, {row['dtype']}, {'with' if row['backward'] else 'without'} "
                     f"backward: {error}{limit}")
    shape = probed["shape"]
    fp32_run = probed["kernels"] and probed["kernels"][0]["dtype"] == "float32"
    accumulation = "in fp32 GEMMs (an fp32 run)" if fp32_run else \
        "in the GEMM (addmm with an fp32 output)" if probed.get("fused_loss_fp32_gemm_accumulation") else \
        "through a 16-bit product cast up (this torch has no fp32-output addmm here)"
    lines += ["", f"LM-head losses on {shape['loss_tokens']:,} loss tokens x {shape['hidden']:,} x "
              f"{shape['vocab']:,} (forward + backward, median of {BENCH_REPEATS}; errors of the loss and both "
              f"gradients against fp32; the fused loss accumulates the weight gradient {accumulation}):", ""]
    for row in probed["losses"]:
        if row.get("error"):
            lines.append(f"- {row['loss']}: did not run: {row['error']}")
            continue
        memory = "" if row.get("peak_added_gib") is None else f", {row['peak_added_gib']:.2f} GiB at its peak"
        lines.append(f"- {row['loss']}: {row['ms']:.1f} ms{memory}, error {row['max_rel_error']:.1e} (tolerance "
                     f"{row['tolerance']:.1e}: {'ok' if row['ok'] else 'FAILED'})")
    return lines + [""]


def profile_lines(profiled: dict, data: str) -> list[str]:
    idle = profiled.get("idle_share_vs_median")
    lines = [f"Where the fastest rung's step goes ({data}/profile.json, torch.profiler over {profiled['steps']} "
             f"steps; {profiled['device']} time per step {profiled['busy_ms']:.1f} ms"
             + (f", the unprofiled run's median step {profiled['unprofiled_median_step_ms']:.1f} ms"
                if profiled.get("unprofiled_median_step_ms") else "")
             + (f": the device idle {idle:.0%} of it" if idle is not None else "") + "):", ""]
    lines += [f"- {name}: {ms:.2f} ms" for name, ms in profiled["categories_ms"].items()]
    lines += ["", "Top kernels:", ""]
    lines += [f"- {row['ms_per_step']:.2f} ms, {row['calls']} calls: `{row['name']}`"
              for row in profiled["top"][:10]] + [""]
    return lines


ARCHIVE_LOG_BYTES = 200_000  # the end of each run's log goes into the archive, for what went wrong


def write_archive(root: Path, out: Path, series: str, scratch: Path) -> Path:
    """One .tar.gz of the entry, its kept data and the runs' logs, paths relative to the repository root (unpack it
    there), rewritten whole after every run: a suite cut off at any point leaves one complete file."""
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{series}.tar.gz"
    partial = out / f".{series}.tar.gz.partial"
    with tarfile.open(partial, "w:gz") as tar:
        for path in (root / "devlog" / f"{series}.md", root / "devlog" / "data" / series):
            if path.exists():
                tar.add(path, arcname=str(path.relative_to(root)))
        for log in sorted(scratch.glob("*/train.log")):
            tail = log.read_bytes()[-ARCHIVE_LOG_BYTES:]
            info = tarfile.TarInfo(str(log.relative_to(root)))
            info.size, info.mtime = len(tail), int(time.time())
            with tempfile.TemporaryFile() as handle:
                handle.write(tail)
                handle.seek(0)
                tar.addfile(info, handle)
    os.replace(partial, archive)
    return archive


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--profile-child"]:
        profile_child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run the stages on the CPU (tiny preset, DRY_PLAN)")
    parser.add_argument("--list", action="store_true", help="print the plan in run order with each prediction")
    parser.add_argument("--wheels", action="store_true",
                        help="print which wheels the loss libraries and TRL need on an offline machine, and how")
    parser.add_argument("--budget-min", type=float, default=9.0, help="start no run that would end after this many "
                        "minutes (each run's time guessed from the longest of its kind so far)")
    parser.add_argument("--root", type=Path, default=None,
                        help="where devlog/ and runs/ are written: the repository by default, a fresh temporary "
                             "folder for --dry-run")
    parser.add_argument("--out", type=Path, default=None,
                        help="the folder of the results archive <series>.tar.gz (default: <root>/runs/gpu-suite)")
    parser.add_argument("--date", default=date.today().isoformat())
    parser.add_argument("--only", default=None, help="comma-separated run names or patterns (fnmatch), 'probe' for "
                        "the probe: a later call adds them to an entry whose earlier runs are in <root>/devlog/data")
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    all_rungs = rungs(plan)
    if args.wheels:
        print(wheels_instructions())
        return 0
    if args.list:
        elapsed = PROBE_ESTIMATE_S
        print(f"[{elapsed / 60:4.1f} min] probe (in this process): versions, attention kernels, LM-head losses")
        print(f"    predicted: {PROBE_PREDICTION}")
        for rung in all_rungs:
            elapsed += rung.estimate_s
            print(f"[{elapsed / 60:4.1f} min] " + shlex.join(command(rung, Path("runs/gpu-suite") / rung.name,
                                                                       ["python3"])))
            print(f"    predicted: {rung.prediction}")
        return 0
    slug = device_slug(args.dry_run)
    series = f"{args.date}-gpu-suite-{slug}"
    root = (args.root or (Path(tempfile.mkdtemp(prefix="gpu-suite-dry-run-")) if args.dry_run else REPO_ROOT)).resolve()
    out = (args.out or root / "runs" / "gpu-suite").resolve()
    scratch, kept = root / "runs" / "gpu-suite" / series, root / "devlog" / "data" / series
    entry = root / "devlog" / f"{series}.md"
    print(f"gpu_suite: {series}: runs in {scratch}, kept in {kept}, archive in {out}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    invocation = "python3 assets/gpu_suite.py" + (" --dry-run" if args.dry_run else "")
    started, clock = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    done: dict[str, str] = {}
    failures = []

    def selected(name: str) -> bool:
        return not args.only or any(fnmatch.fnmatch(name, pattern) for pattern in args.only.split(","))

    def save() -> None:
        write_entry(root, entry, series, plan, done, all_rungs, started, invocation)
        write_archive(root, out, series, scratch)

    kept.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    if selected("probe"):
        print("[probe] versions, attention kernels against masked SDPA, LM-head losses on the real shapes",
              flush=True)
        probed = probe(plan, "cpu" if args.dry_run else "cuda")
        (kept / "probe.json").write_text(json.dumps(probed, indent=1) + "\n")
        for row in probed["kernels"] + probed["losses"]:
            name = row.get("kernel") or row.get("loss")
            print(f"    {name}: " + (f"{row['max_rel_error']:.1e}" if row.get("max_rel_error") is not None else "-")
                  + (f", {row['ms']:.1f} ms" if row.get("ms") is not None else "")
                  + f" ({'ok' if row['ok'] else row.get('error', 'FAILED')})", flush=True)
            if row["ok"] is False:
                failures.append(name)
        save()
    taken: dict[bool, float] = {}  # the longest run so far, without / with --compile
    for index, rung in enumerate(all_rungs, start=1):
        if not selected(rung.name):
            continue
        elapsed = time.perf_counter() - clock
        guess = taken.get(rung.compiled, rung.estimate_s)
        if elapsed + guess > args.budget_min * 60 and not args.dry_run:
            done[rung.name] = "skipped: time budget"
            print(f"[{index}/{len(all_rungs)}] {rung.name}: skipped, {elapsed / 60:.1f} of {args.budget_min} min used "
                  f"and ~{guess:.0f} s to go", flush=True)
            continue
        if rung.experiment == "peer" and not peer_installed():
            done[rung.name] = "skipped: trl or datasets not installed (python3 assets/gpu_suite.py --wheels)"
            print(f"[{index}/{len(all_rungs)}] {rung.name}: skipped, trl or datasets not installed", flush=True)
            save()
            continue
        profiled = None
        if rung.profile:
            rung, profiled = fastest(rung, all_rungs, kept)
            if profiled is None:
                done[rung.name] = "skipped: no rung of its ladder measured"
                continue
        run_dir = scratch / rung.name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        cmd = command(rung, run_dir, [sys.executable])
        print(f"[{index}/{len(all_rungs)}] {shlex.join(cmd)}", flush=True)
        run_start = time.perf_counter()
        with open(run_dir / "train.log", "w") as log:
            code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - run_start
        if rung.experiment != "peer":  # two trainings in one: not what the next run will take
            taken[rung.compiled] = max(taken.get(rung.compiled, 0.0), seconds)
        if rung.syncs and code == 0:
            counts = count_syncs((run_dir / "train.log").read_text(), skip_steps=plan.warmup)
            (kept / "host-syncs.json").write_text(json.dumps(counts, indent=1) + "\n")
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {counts['total_per_step']:g} host syncs per step", flush=True)
        elif rung.profile and code == 0 and (run_dir / "profile.json").exists():
            summary = json.loads((run_dir / "profile.json").read_text())
            median = median_step_ms(kept / profiled.name)
            summary["profiled_run"], summary["unprofiled_median_step_ms"] = profiled.name, median
            summary["idle_share_vs_median"] = None if not median or summary["device"] != "cuda" else \
                max(0.0, 1 - summary["busy_ms"] / median)
            (kept / "profile.json").write_text(json.dumps(summary, indent=1) + "\n")
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {json.dumps(summary['categories_ms'])[:300]}", flush=True)
        elif rung.experiment == "peer" and code == 0:
            for side in ("single-ft", "trl-sft"):
                keep(run_dir / side, kept / f"{rung.name}-{side}")
            ratio_file = run_dir / "peer_baseline.json"
            ratio = json.loads(ratio_file.read_text()) if ratio_file.exists() else {}
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {json.dumps(ratio)[:300]}", flush=True)
        elif code != 0 or not (run_dir / "summary.json").exists():
            tail = (run_dir / "train.log").read_text().strip().splitlines()[-1:] or [""]
            done[rung.name] = f"failed (exit {code})"
            failures.append(rung.name)
            print(f"    FAILED ({code}) in {seconds:.0f} s: {tail[0][:200]}", flush=True)
        else:
            keep(run_dir, kept / rung.name)  # summary.json and metrics.jsonl, as run_series keeps every series
            summary = json.loads((run_dir / "summary.json").read_text())
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {summary['tokens_per_s']:,.0f} tok/s, median step "
                  f"{median_step_ms(kept / rung.name) or 0:.0f} ms, slowest {summary['step_ms'] and max(r['step_ms'] for r in load_run(kept / rung.name).steps):.0f} ms, "
                  f"peak {summary['peak_mem_gib']:.2f} GiB, recompiles {summary.get('recompiles')}, "
                  f"settled after {summary.get('warmup_steps_observed')} steps", flush=True)
            failures += check_parity(rung, all_rungs, kept)
        save()
    print(f"gpu_suite: {sum(v == 'measured' for v in done.values())} of {len(all_rungs)} runs kept in {kept}; "
          f"entry {entry}; archive {out / (series + '.tar.gz')}"
          + (f"; problems: {', '.join(failures)}" if failures else ""), flush=True)
    return 1 if failures else 0


def check_parity(rung: Rung, all_rungs: list[Rung], kept: Path) -> list[str]:
    """Compare every pair (run, its reference) that this run completes: printed, and a mismatch is a problem."""
    pairs = [(rung, rung.reference)] if rung.reference else []
    pairs += [(other, rung.name) for other in all_rungs if other.reference == rung.name]
    problems = []
    for run, reference in pairs:
        if not (kept / run.name / "summary.json").exists() or not (kept / reference / "summary.json").exists():
            continue
        difference = parity(kept / run.name, kept / reference)
        if difference is None:
            print(f"    {run.name} does not do the optimizer steps of {reference}: not compared", flush=True)
            problems.append(f"{run.name} (not the reference's steps)")
            continue
        verdict = "ok" if difference <= BF16_TOLERANCE else "MISMATCH"
        print(f"    {run.name}: losses vs {reference} {difference:.1e} ({verdict})", flush=True)
        if difference > BF16_TOLERANCE:
            problems.append(f"{run.name} (loss mismatch)")
    return problems


if __name__ == "__main__":
    sys.exit(main())
