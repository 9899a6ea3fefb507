"""The GPU suite: one command that turns a GPU machine into committed numbers, the targets first.

    python3 assets/gpu_suite.py              # on a GPU machine, from the repository root; no uv or network needed
    python3 assets/gpu_suite.py --list       # the plan in run order: each run's command and its prediction
    python3 assets/gpu_suite.py --wheels     # which wheels the loss libraries, QLoRA and TRL need offline
    python3 assets/gpu_suite.py --dry-run    # the same stages on the CPU, tiny preset (what the tests run); it
                                             # writes into a fresh temporary folder unless --root names one

The targets (full SFT of Qwen3-0.6B at sequence 1024, and LoRA r16 at sequence 2048, each >= 100,000 tokens/s on
one H100, with per-step losses equal to the reference path within the bf16 tolerance at the same global batch)
decide the order: what decides them and loses the least when the machine is cut off runs first.
1. Full SFT at sequence 1024 with every fast flag (varlen attention, the fused loss, compile; the rest is always on
   in single-ft) at micro-batch 16, 30 steps: mean, median and slowest step, gc_ms, recompiles, the steps until the
   time settled. Inside its timing warm-up the same process profiles three steps (torch.profiler: device time by
   kernel and category, the idle share) and counts the host syncs of three more: no second start-up. Then the
   same-global-batch eager reference (8 x 2: SDPA with the packed rows' mask, the plain loss, no compile), whose
   per-step losses the fast rungs must equal within BF16_TOLERANCE over the first FIRST_STEPS steps.
2. The same for LoRA r16 at sequence 2048, micro-batch 8, and its reference at 4 x 2.
3. FlexAttention (--attn flex) in place of varlen at both targets; then LoRA's fast rung with --lora-fused.
4. The probe, a process of its own (assets/gpu_probe.py: versions, every attention kernel against masked SDPA,
   the LM-head losses on the real shapes, the loss libraries where installed), after the targets: nothing it does
   can end the call before them.
5. Beyond the targets, reached by a longer budget or `--only`: QLoRA on Qwen3-4B as `python -m common.memory`
   recommends it for one 24 GB card (bitsandbytes from `--wheels`), the mixture-of-experts preset, ddp-ft on one rank
   with the full-SFT fast flags (its bf16 masters' comm hook on CUDA), the earlier one-feature-per-rung ladder,
   fsdp-ft on one rank, and TRL's SFTTrainer beside single-ft (assets/peer_baseline.py, with its wheels).

Each run is the experiment's own command line (`python3 experiments/<x>/train.py ...`), launched as a user would,
with the repository on PYTHONPATH so that it needs nothing but torch, transformers and peft. Every run that
finishes is kept at once: its summary.json and metrics.jsonl go to devlog/data/<date>-gpu-suite-<device>/<run>/,
devlog/<date>-gpu-suite-<device>.md is (re)written with generated regions (assets/make_posts.py) over what is kept so
far, and one archive, <out>/<date>-gpu-suite-<device>.tar.gz, is rewritten with all of it (and each run's log): a
suite cut off by its time budget (--budget-min, default 9) or by the machine going away leaves one usable file. Each
run's time is guessed from the start-up, compilation and time per token of the runs before it, and runs the budget
would overrun are skipped with a note; `python3 assets/gpu_suite.py --date <the entry's date> --only
'<names or patterns>'` on a later machine of the same kind adds them to the same entry (run it in a checkout that
holds the entry's devlog/data/ folder, or with --root where the earlier archive was unpacked); the entry's
hand-written sections, up to the first section the suite writes, are kept. Each rung carries its prediction,
written before any GPU run: the entry prints it beside the measurement.

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
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # common, on a lent machine where nothing is installed
    sys.path.insert(0, str(REPO_ROOT))

from gpu_instrument import (PROFILE_STEPS, SYNC_STEPS, SyncCounter, instrument_child,  # noqa: E402,F401
                            profile_lines, syncs_lines)
from gpu_probe import LOSS_WHEELS, probe_lines  # noqa: E402  (after the path set-up above)
from make_plots import load_run  # noqa: E402
from run_series import keep  # noqa: E402

BF16_TOLERANCE = 2e-2  # largest relative per-step loss difference from the reference rung, first 5 steps, bf16
FIRST_STEPS = 5
PEER_WHEELS = ("trl", "datasets", "dill", "multiprocess")  # what the peer baseline needs beyond the lent machine's
QLORA_WHEELS = ("bitsandbytes",)  # the QLoRA rung's (about 43 MB)


@dataclass(frozen=True)
class Rung:
    name: str  # run folder name; single-ft runs start with "single-ft" so the posts' GPU slots find them
    experiment: str  # an experiment's folder name, "probe" (assets/gpu_probe.py) or "peer" (assets/peer_baseline.py)
    args: tuple[str, ...]
    prediction: str  # written before any GPU run
    ladder: str  # the entry's section
    # Wall time guessed before any run, the budget's first guess (then Budget.guess from the runs before it): ~20 s to
    # import and build the model, ~40 s to compile the decoder layer and the loss's kernel, then the steps.
    estimate_s: int
    reference: str | None = None  # the run whose per-step losses this one must equal (same optimizer steps)
    nproc: int = 1
    instrument: bool = False  # profile, then count host syncs, inside its timing warm-up (instrument_child)
    instruments_as: str = ""  # their files' label, profile-<label>.json (default: the target's, e.g. s1024-full)

    @property
    def compiled(self) -> bool:
        return "--compile" in self.args

    def option(self, flag: str, default: str | None = None) -> str | None:
        return self.args[self.args.index(flag) + 1] if flag in self.args else default

    @property
    def tokens_per_step(self) -> int:
        return int(self.option("--seq-len", "1024")) * int(self.option("--micro-batch-size", "1")) * int(
            self.option("--grad-accum", "1"))


@dataclass
class Target:
    label: str  # e.g. s1024-full
    seq: int
    lora: int
    micro: int  # rows per forward of the fast rungs (one forward per step: the most tokens per kernel launch)
    prediction: str
    reference_split: tuple[int, int]  # (micro-batch, grad-accum) of the eager reference: the same rows per step
    reference_prediction: str
    flex_prediction: str
    fused_prediction: str = ""  # LoRA targets: the fast rung with --lora-fused (common/lora.py); "" = no such rung


@dataclass
class Plan:
    model: str
    dtype: str
    steps: int  # of the target rungs and their references (the same --steps: the same LR schedule)
    warmup: int  # --timing-warmup-steps of the target rungs (compilation, the profile, the sync count stay out)
    chunk: int  # --loss-chunk-tokens of the target rungs
    targets: list[Target]
    bench_tokens: int  # the probe's loss benchmark: loss tokens x hidden size x vocabulary
    bench_hidden: int
    bench_vocab: int
    bench_chunks: tuple[int, ...]
    compile: bool = True  # the dry run leaves torch.compile out (tests/test_loss.py checks it; on CPU it only costs)
    flex: bool = True  # the --attn flex rungs (the dry run leaves them out: FlexAttention has no CPU backward)
    extras: bool = True  # QLoRA on Qwen3-4B as common.memory recommends it for a 24 GB card, and a mixture of experts
    ladder_steps: int = 20  # the earlier ladder's runs
    ladder_warmup: int = 5
    ladders: list[tuple[str, int, int, tuple[int, ...]]] = field(default_factory=list)  # (label, seq, lora, micros)
    fsdp_seq: int | None = 1024  # fsdp-ft on one rank (None: not in the plan)
    peer_seq: int | None = 1024  # TRL beside single-ft (None: not in the plan)
    peer_micro: int = 4


# Predictions for the targets, before any run of this plan, from devlog/2026-11-27-gpu-suite-nvidia-h100-80gb-hbm3.md
# (five H100s, up to ~5% apart on the same code: compare rungs within one machine). The fifth ran single-ft's bf16
# weights with fp32 masters (common/precision.py: full SFT's fast rung, LoRA's fused + flex), the others autocast.
# On an H200 (1.4x the memory bandwidth, the same bf16 peak) the memory-bound half of the step runs ~1.3x faster.
FULL_PREDICTION = (
    "102,000-112,000 tok/s by the median step on an H100 (107,377 measured under bf16 weights with fp32 masters), "
    "115,000-130,000 on an H200; the mean within 5% of the median; 0 recompiles after step 1; its profile (steps "
    "2-4): matrix products under half of the busy time, the device idle under 5% of the median step; one host sync "
    "per step; losses equal to the reference's within the bf16 tolerance; peak within 5% of common.memory's")
FULL_REFERENCE = (
    "the eager reference at the same 16 rows per step (8 x 2: SDPA with the packed rows' [seq x seq] mask, the plain "
    "fp32 loss, no compile): 30,000-36,000 tok/s on an H100 (33,223 measured under autocast); its per-step losses are "
    "the ones the fast rungs must match")
FULL_FLEX = (
    "FlexAttention with the document block mask in place of varlen at the same shape: 2-6% faster by median (grouped "
    "K/V heads, which this torch's varlen_attn expands to all 16 query heads; 3.3% measured under autocast) and ~1.8 "
    "GiB less memory; the same losses; 0 recompiles")
LORA_PREDICTION = (
    "93,000-102,000 tok/s by the median step on an H100 (96,239 and 96,389 measured under autocast on two machines; "
    "the masters' bf16 residual stream gave LoRA no gain visible across machines); one host sync per step; the same "
    "losses as its reference")
LORA_REFERENCE = (
    "the eager LoRA reference at the same 8 rows of 2,048 per step (4 x 2): 27,000-32,000 tok/s on an H100 (29,319 "
    "measured)")
LORA_FLEX = (
    "FlexAttention at LoRA's shape: 4-7% shorter median step than the varlen rung's on the same machine (4.1% and "
    "6.2% measured on two), 100,000-106,000 tok/s by median on an H100")
LORA_FUSED = (
    "--lora-fused at LoRA's target shape (q/k/v and gate/up share one adapter down product, each up product added by "
    "addmm): 5-8% shorter median step than the varlen rung's on the same machine (6.2% measured, in the element-wise "
    "passes), 100,000-105,000 tok/s by median on an H100; the same losses as the reference within the bf16 "
    "tolerance; 0 recompiles; ~2.8 GiB less reserved than the varlen rung (peft's second bf16 cast of o_proj's input)")
LORA_FUSED_FLEX = (
    "--lora-fused with --attn flex at LoRA's target shape: 108,000-114,000 tok/s by median on an H100 (112,683 "
    "measured under autocast, 109,886 under bf16 masters on another machine), past the 100,000 target; the same "
    "losses as the reference within the bf16 tolerance; peak within 2% of common.memory's")
QLORA_PREDICTION = (
    "the command common.memory recommends for Qwen3-4B with QLoRA on one 24 GB card (random init): peak within 15% of "
    "its 11.25 GiB (max_memory_reserved); bitsandbytes' 4-bit matrix products under compile and activation "
    "checkpointing at 8 rows of 1,024: 8,000-16,000 tok/s on an H100")
MOE_PREDICTION = (
    "the mixture-of-experts preset trains on one GPU (transformers' per-expert loop in bf16 weights with fp32 "
    "masters): a few thousand tok/s, host-bound at this size; aux_loss and the per-expert token counts logged")

DDP_PREDICTION = (
    "ddp-ft on one rank with the full-SFT fast rung's flags: bf16 weights with fp32 masters whose gradients DDP's comm "
    "hook flattens, all-reduces (NCCL, a group of one) and copies back, ~10 GB of extra memory traffic per step: "
    "2-5% longer median step than single-ft's fast rung on the same machine; peak ~1.1 GiB above it (DDP's bf16 "
    "buckets); the same losses as single-ft's reference within the bf16 tolerance")

PROBE_ESTIMATE_S = 60  # a process of its own: imports, the kernel check, each loss timed (Triton and compile first)
PROBE_PREDICTION = (
    "every kernel within 3x masked SDPA's own bf16 rounding, FlexAttention over rows included (forward and "
    "backward); on 8,192 loss tokens x 1,024 x 151,936: common/loss.py's fused loss 14-20 ms with 2-6 GiB at chunk "
    "1,024-8,192, about half the plain loss's time; its chunked reference ~3x the fused loss (measured 2.9x on the "
    "H100: a fourth GEMM and an fp32 pass); Liger-Kernel's fused linear cross-entropy 3-6x ours (chunks of ~64 tokens "
    "at this vocabulary, the weight read per chunk); cut-cross-entropy as fast and the smallest, but outside the "
    "tolerance on this random-init benchmark: its gradient filter skips softmax entries below bf16's resolution, "
    "almost all of a near-uniform softmax over 151,936 classes (a library's row, not the suite's failure)")

GPU_PLAN = Plan(
    model="qwen3-0.6b", dtype="bf16", steps=30, warmup=8, chunk=4096,
    targets=[Target("s1024-full", 1024, 0, 16, FULL_PREDICTION, (8, 2), FULL_REFERENCE, FULL_FLEX),
             Target("s2048-lora16", 2048, 16, 8, LORA_PREDICTION, (4, 2), LORA_REFERENCE, LORA_FLEX, LORA_FUSED)],
    bench_tokens=8192, bench_hidden=1024, bench_vocab=151_936, bench_chunks=(1024, 4096, 8192),
    ladders=[("s1024-full", 1024, 0, (4, 8)), ("s4096-full", 4096, 0, (2,)), ("s4096-lora16", 4096, 16, (2,)),
             ("s1024-lora16", 1024, 16, (4, 8))])
# The dry run: one target's instrumented fast rung and its reference, the probe, TRL (skipped without its wheels);
# compile, flex, the extras and the ladder are left to the tests that cover them (test_loss, test_attention, ...).
DRY_PLAN = Plan(
    model="qwen3-tiny", dtype="fp32", steps=6, warmup=1 + PROFILE_STEPS, chunk=32,
    targets=[Target("s64-full", 64, 0, 2, "fp32 on a CPU: the same losses as the reference", (1, 2),
                    "the reference path on a CPU", "")],
    bench_tokens=256, bench_hidden=64, bench_vocab=512, bench_chunks=(64, 256),
    compile=False, flex=False, extras=False, fsdp_seq=None, peer_seq=64, peer_micro=2)


def run_args(plan: Plan, steps: int, warmup: int) -> tuple[str, ...]:
    return ("--model", plan.model, "--dtype", plan.dtype, "--steps", str(steps), "--eval-fraction", "0",
            "--timing-warmup-steps", str(warmup), "--comm-profile-steps", "0")


def rungs(plan: Plan) -> list[Rung]:
    """The plan in run order: each target's instrumented fast rung and its reference, FlexAttention at each target,
    the probe, then what is behind the targets."""
    out = []
    compile_flag = ("--compile",) if plan.compile else ()
    fast_of = {}
    for target in plan.targets:
        base = (*run_args(plan, plan.steps, plan.warmup), "--seq-len", str(target.seq),
                *(("--lora-rank", str(target.lora)) if target.lora else ()))
        reference = f"single-ft-{target.label}-reference"
        fast_of[target.label] = (*base, "--attn", "varlen", "--loss-chunk-tokens", str(plan.chunk), *compile_flag,
                                 "--micro-batch-size", str(target.micro), "--grad-accum", "1")
        out.append(Rung(f"single-ft-{target.label}-fast-m{target.micro}", "single-ft", fast_of[target.label],
                        target.prediction, ladder=f"targets {target.label}",
                        estimate_s=(55 if target.seq <= 1024 else 75) if plan.compile else 30, reference=reference,
                        instrument=True))
        micro, accum = target.reference_split
        out.append(Rung(reference, "single-ft", (*base, "--attn", "sdpa", "--micro-batch-size", str(micro),
                                                 "--grad-accum", str(accum)),
                        target.reference_prediction, ladder=f"targets {target.label}",
                        estimate_s=45 if target.seq <= 1024 else 65))
    if plan.flex:
        for target in plan.targets:
            flex = with_flex(fast_of[target.label])
            out.append(Rung(f"single-ft-{target.label}-flex-m{target.micro}", "single-ft", flex, target.flex_prediction,
                            ladder=f"targets {target.label}", estimate_s=55 if target.seq <= 1024 else 75,
                            reference=f"single-ft-{target.label}-reference"))
    for target in plan.targets:
        if target.lora and target.fused_prediction:  # the varlen rung's command with the adapters fused
            out.append(Rung(f"single-ft-{target.label}-fused-m{target.micro}", "single-ft",
                            (*fast_of[target.label], "--lora-fused"), target.fused_prediction,
                            ladder=f"targets {target.label}", estimate_s=75,
                            reference=f"single-ft-{target.label}-reference", instrument=True,
                            instruments_as=f"{target.label}-fused"))
    out.append(Rung("probe", "probe", (
        "--tokens", str(plan.bench_tokens), "--hidden", str(plan.bench_hidden), "--vocab", str(plan.bench_vocab),
        "--chunk", str(plan.chunk), "--chunks", ",".join(map(str, plan.bench_chunks))), PROBE_PREDICTION,
        ladder="probe", estimate_s=PROBE_ESTIMATE_S))
    for target in plan.targets if plan.flex else ():  # both changes that each shortened LoRA's step, after the probe:
        if target.lora and target.fused_prediction:  # the 9-minute budget holds the targets' own rungs
            out.append(Rung(f"single-ft-{target.label}-fused-flex-m{target.micro}", "single-ft",
                            with_flex((*fast_of[target.label], "--lora-fused")), LORA_FUSED_FLEX,
                            ladder=f"targets {target.label}", estimate_s=75,
                            reference=f"single-ft-{target.label}-reference"))
    if plan.extras:
        out.append(Rung("single-ft-s1024-qlora16-4b", "single-ft", (
            *run_args(plan, 12, 4)[:1], "qwen3-4b", *run_args(plan, 12, 4)[2:], "--seq-len", "1024",
            "--micro-batch-size", "8", "--grad-accum", "1", "--attn", "varlen", "--loss-chunk-tokens", "1024",
            *compile_flag, "--activation-checkpointing", "--qlora", "--lora-rank", "16"), QLORA_PREDICTION,
            ladder="beyond the targets", estimate_s=150))
        out.append(Rung("single-ft-moe-tiny", "single-ft", (
            *run_args(plan, 20, 5)[:1], "qwen3-moe-tiny", *run_args(plan, 20, 5)[2:]), MOE_PREDICTION,
            ladder="beyond the targets", estimate_s=45))
        full = plan.targets[0]  # ddp-ft's bf16 layout on CUDA: its comm hook over NCCL, in a group of one
        out.append(Rung(f"ddp-ft-{full.label}-fast-m{full.micro}-1rank", "ddp-ft", fast_of[full.label], DDP_PREDICTION,
                        ladder="beyond the targets", estimate_s=75, reference=f"single-ft-{full.label}-reference"))
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


def with_flex(args: tuple[str, ...]) -> tuple[str, ...]:
    """The same command with FlexAttention in place of the varlen kernel."""
    return tuple("flex" if arg == "varlen" else arg for arg in args)


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


def command(rung: Rung, out_dir: Path, launcher: list[str], device: str = "cuda") -> list[str]:
    script = f"experiments/{rung.experiment}/train.py"
    if rung.experiment == "probe":
        return [*launcher, "assets/gpu_probe.py", str(out_dir / "probe.json"), "--device", device, *rung.args]
    if rung.instrument:
        return [*launcher, "assets/gpu_suite.py", "--instrument-child", str(out_dir), script, *rung.args,
                "--out-dir", str(out_dir)]
    if rung.experiment == "peer":
        return [*launcher, "assets/peer_baseline.py", *rung.args, "--out-dir", str(out_dir)]
    if rung.nproc > 1 or rung.experiment != "single-ft":
        return [*launcher, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={rung.nproc}",
                script, *rung.args, "--out-dir", str(out_dir)]
    return [*launcher, script, *rung.args, "--out-dir", str(out_dir)]


def predict_before_launch(rung: Rung) -> float | None:
    """common.memory's peak (GiB) for a rung, computed by the suite before it launches the run: the out-of-sample
    record the scripts no longer write (they predict nothing; posts compute predictions from summary.json after the
    run). The rung's flags over its script's Config defaults, its attention as requested (varlen's K/V repeat as this
    torch needs it), one process per rank. None for the probe, the peer baseline, or settings the model does not
    price."""
    if rung.experiment in ("probe", "peer"):
        return None
    from common.attention import torch_varlen_takes_gqa
    from common.cli import config_flags, parse_flags
    from common.memory import predict_run
    from common.models import TINY_PRESETS

    script = REPO_ROOT / "experiments" / rung.experiment / "train.py"
    config = {flag.name: flag.default for flag in config_flags(script)[1]}
    config.update(parse_flags(script, list(rung.args)))
    if config.get("seq_len") is None:  # as the scripts resolve it
        config["seq_len"] = 256 if config["model"] in TINY_PRESETS else 1024
    impl = config.get("attn", "auto")
    attention = {"impl": impl, "expands_kv": impl == "varlen" and not torch_varlen_takes_gqa(), "reason": ""}
    pre_run = {"experiment": rung.experiment, "config": config, "hardware": {"world_size": rung.nproc},
               "attention": attention, "model": {},  # bf16 weights and fp32 masters where the strategy keeps them
               "master_weights": config["dtype"] == "bf16" and not config.get("qlora")}
    try:
        return predict_run(pre_run).total_gib
    except (ValueError, KeyError, TypeError, OSError):  # a model or setting the memory model cannot price
        return None


def record_prediction(kept_run: Path, predicted_gib: float | None) -> None:
    """The suite's pre-launch prediction into the kept copy of the run's summary.json, named as the suite's
    (predicted_peak_mem_gib is what tables and post 01 read as the prediction written before the run)."""
    if predicted_gib is None or not (kept_run / "summary.json").exists():
        return
    summary = json.loads((kept_run / "summary.json").read_text())
    summary["predicted_peak_mem_gib"] = predicted_gib
    summary["predicted_peak_mem_gib_by"] = "assets/gpu_suite.py, before the run was launched"
    (kept_run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


class Budget:
    """Each run's wall time guessed from the runs before it: their start-up and compilation (wall time less the
    steps after the first) by kind (compiled or eager, the probe), plus this run's steps at the slowest time per
    token measured so far; before any run of its kind, the rung's own estimate."""

    def __init__(self) -> None:
        self.overhead_s: dict[str, float] = {}
        self.seconds_per_token: dict[str, float] = {}

    @staticmethod
    def kind(rung: Rung) -> str:
        return "probe" if rung.experiment == "probe" else "compiled" if rung.compiled else "eager"

    def guess(self, rung: Rung) -> float:
        kind = self.kind(rung)
        if kind not in self.overhead_s:
            return rung.estimate_s
        steps = int(rung.option("--steps", "0"))
        return self.overhead_s[kind] + steps * rung.tokens_per_step * self.seconds_per_token.get(kind, 0.0)

    def measured(self, rung: Rung, wall_s: float, kept_run: Path | None) -> None:
        kind = self.kind(rung)
        steps = load_run(kept_run).steps if kept_run and (kept_run / "metrics.jsonl").exists() else []
        stepping_s = sum(step["step_ms"] for step in steps[1:]) / 1e3
        self.overhead_s[kind] = max(self.overhead_s.get(kind, 0.0), wall_s - stepping_s)
        if len(steps) > 1:
            per_token = stepping_s / (len(steps) - 1) / rung.tokens_per_step
            self.seconds_per_token[kind] = max(self.seconds_per_token.get(kind, 0.0), per_token)


def median_step_ms(run_dir: Path) -> float | None:
    """The median step time of a kept run's measured steps (after its timing warm-up)."""
    run = load_run(run_dir)
    warmup = run.config.get("timing_warmup_steps", 0)
    times = [step["step_ms"] for step in run.steps if step["step"] > warmup]
    return statistics.median(times) if times else None


def installed(*packages: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in packages)


def wheels_instructions() -> str:
    """How to bring the loss libraries and the peer baseline's packages to an offline GPU machine: the peer
    baseline's at the versions uv.lock pins, the loss libraries at LOSS_WHEELS' (pure Python; Triton comes with
    torch on the machine)."""
    lock = (REPO_ROOT / "uv.lock").read_text()
    pins = []
    for name in (*PEER_WHEELS, *QLORA_WHEELS):
        match = re.search(rf'^name = "{name}"\nversion = "([^"]+)"', lock, re.MULTILINE)
        pins.append(f"{name}=={match.group(1)}" if match else name)
    pins += [f"{name}=={version}" for name, version in LOSS_WHEELS.items()]
    return "\n".join([
        "The suite needs torch, transformers and peft only. The probe also times cut-cross-entropy and Liger-Kernel's",
        "fused linear cross-entropy, the QLoRA rung needs bitsandbytes (about 43 MB) and the TRL comparison trl and",
        "datasets: bring these wheels (torch, triton, transformers, accelerate, pyarrow and the rest are on the lent",
        "machine). On a machine with the package index, in the repository root:",
        "",
        "    echo /.whl/ >> .git/info/exclude",
        "    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\",
        "        --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 -d .whl " + " ".join(pins),
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

# peak_mem beside predicted_now: common.memory's peak for each run's settings, computed from its summary.json
# (tests/test_memory.py holds every committed GPU run to it); predicted_peak, the one a run recorded when it started,
# only where runs recorded one (they no longer do: predictions are made outside the run)
TARGET_COLUMNS = ("run,seq,micro,ga,lora,t_eff,step_ms,step_ms_median,step_ms_max,tok_s,tok_s_median,mfu,peak_mem,"
                  "predicted_now,predicted_peak,field:gc_ms_max:.1f,field:recompiles:d,field:warmup_steps_observed:d")
LADDER_COLUMNS = ("run,seq,micro,lora,t_eff,step_ms,step_ms_median,step_ms_max,tok_s,tok_s_median,mfu,peak_mem,"
                  "predicted_now")
HANDWRITTEN = "## What it says"


def handwritten_section(entry: Path, suite_headings: set[str]) -> str | None:
    """The entry's hand-written part, kept when the suite rewrites the entry: from "## What it says" to the first
    section the suite writes itself (the probe's, a ladder's), with every hand-written section between (a later
    machine's notes)."""
    if not entry.exists():
        return None
    text = entry.read_text()
    if HANDWRITTEN not in text:
        return None
    section = text[text.index(HANDWRITTEN):]
    for heading in re.finditer(r"^## .*$", section, re.MULTILINE):
        if heading.group(0).strip() in suite_headings:
            return section[:heading.start()].rstrip()
    return section.rstrip()


def write_entry(root: Path, entry: Path, series: str, plan: Plan, done: dict[str, str], all_rungs: list[Rung],
                started: str, invocation: str) -> None:
    data = f"devlog/data/{series}"
    kept = {rung.name for rung in all_rungs if (root / data / rung.name / "summary.json").exists()}
    handwritten = handwritten_section(entry, {"## Probe", *(f"## {rung.ladder}" for rung in all_rungs)})
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
        if ladder == "probe":
            status = done.get("probe", "measured" if probe_file.exists() else "not run")
            lines += [f"Predicted before the run ({status}; its results are the Probe section above): "
                      f"{members[0].prediction}.", ""]
            continue
        measured = [rung for rung in members if rung.name in kept]
        references = [rung for rung in measured if any(other.reference == rung.name for other in members)]
        if measured:
            names = ",".join(f"{data}/{rung.name}" for rung in measured)
            ref = f" ref={data}/{references[0].name}" if references else ""
            columns = (TARGET_COLUMNS if ladder.startswith("targets") else LADDER_COLUMNS)
            columns = columns.replace("mfu,", "rel:tok_s,mfu,") if ref else columns
            if not any("predicted_peak_mem_gib" in load_run(root / data / rung.name).summary for rung in measured):
                columns = columns.replace(",predicted_peak,", ",")
            lines += [f"<!-- generated:table runs={names} cols={columns}{ref} -->", "<!-- /generated -->", ""]
            twins = [rung for rung in measured if references and rung.reference == references[0].name
                     and parity(root / data / rung.name, root / data / references[0].name) is not None]
            if twins:
                lines += [f"<!-- generated:parity runs={','.join(f'{data}/{r.name}' for r in twins)}{ref} -->",
                          "<!-- /generated -->", "",
                          f"The suite's own check (bf16): each of these within {BF16_TOLERANCE:g} of the reference's "
                          f"loss, relatively, over the first {FIRST_STEPS} steps; the table's 1e-5 column is the "
                          "fp32 tests' criterion." if plan.dtype == "bf16" else "", ""]
        for label in sorted({rung.instruments_as or ladder.removeprefix("targets ") for rung in members
                             if rung.instrument}):
            for name, writer in ((f"profile-{label}.json", profile_lines), (f"host-syncs-{label}.json", syncs_lines)):
                if ladder.startswith("targets") and (root / data / name).exists():
                    lines += writer(json.loads((root / data / name).read_text()), f"{data}/{name}")
        lines += ["Predicted before the runs:", ""]
        for rung in members:
            status = done.get(rung.name, "measured" if rung.name in kept else "not run")  # kept by an earlier call
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
    if argv[:1] == ["--instrument-child"]:
        instrument_child(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run the stages on the CPU (tiny preset, DRY_PLAN)")
    parser.add_argument("--list", action="store_true", help="print the plan in run order with each prediction")
    parser.add_argument("--wheels", action="store_true",
                        help="print which wheels the loss libraries, QLoRA and TRL need on an offline machine, and how")
    parser.add_argument("--budget-min", type=float, default=9.0, help="start no run that would end after this many "
                        "minutes (each run's time guessed from the runs before it)")
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
        elapsed = 0
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
    invocation = "python3 assets/gpu_suite.py" + (" --dry-run" if args.dry_run else "") + \
        (f" --only {shlex.quote(args.only)}" if args.only else "")
    started, clock = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    done: dict[str, str] = {}
    failures = []
    budget = Budget()

    def selected(name: str) -> bool:
        return not args.only or any(fnmatch.fnmatch(name, pattern) for pattern in args.only.split(","))

    def save() -> None:
        write_entry(root, entry, series, plan, done, all_rungs, started, invocation)
        write_archive(root, out, series, scratch)

    kept.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    save()  # an entry and an archive from the start: a call cut off in its first run still leaves both
    for index, rung in enumerate(all_rungs, start=1):
        if not selected(rung.name):
            continue
        elapsed = time.perf_counter() - clock
        guess = budget.guess(rung)
        if elapsed + guess > args.budget_min * 60 and not args.dry_run:
            done[rung.name] = "skipped: time budget"
            print(f"[{index}/{len(all_rungs)}] {rung.name}: skipped, {elapsed / 60:.1f} of {args.budget_min} min used "
                  f"and ~{guess:.0f} s to go", flush=True)
            continue
        missing = ("trl or datasets", ("trl", "datasets")) if rung.experiment == "peer" else \
            ("bitsandbytes", QLORA_WHEELS) if "--qlora" in rung.args else None
        if missing and not installed(*missing[1]):
            done[rung.name] = f"skipped: {missing[0]} not installed (python3 assets/gpu_suite.py --wheels)"
            print(f"[{index}/{len(all_rungs)}] {rung.name}: skipped, {missing[0]} not installed", flush=True)
            save()
            continue
        run_dir = scratch / rung.name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        cmd = command(rung, run_dir, [sys.executable], "cpu" if args.dry_run else "cuda")
        predicted_gib = predict_before_launch(rung)
        print(f"[{index}/{len(all_rungs)}] {shlex.join(cmd)}", flush=True)
        run_start = time.perf_counter()
        with open(run_dir / "train.log", "w") as log:
            code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - run_start
        if rung.experiment == "probe" and code == 0 and (run_dir / "probe.json").exists():
            probed = json.loads((run_dir / "probe.json").read_text())
            shutil.copy(run_dir / "probe.json", kept / "probe.json")
            budget.measured(rung, seconds, None)
            done[rung.name] = "measured"
            for row in probed["kernels"] + probed["losses"]:
                name = row.get("kernel") or row.get("loss")
                print(f"    {name}: " + (f"{row['max_rel_error']:.1e}" if row.get("max_rel_error") is not None
                                       else "-") + (f", {row['ms']:.1f} ms" if row.get("ms") is not None else "")
                      + f" ({'ok' if row['ok'] else row.get('error', 'FAILED')})", flush=True)
                if row["ok"] is False and not row.get("library"):  # a library outside its tolerance is its row
                    failures.append(name)
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
            record_prediction(kept / rung.name, predicted_gib)
            budget.measured(rung, seconds, kept / rung.name)
            summary = json.loads((run_dir / "summary.json").read_text())
            done[rung.name] = "measured"
            print(f"    {seconds:.0f} s: {summary['tokens_per_s']:,.0f} tok/s, median step "
                  f"{median_step_ms(kept / rung.name) or 0:.0f} ms, slowest "
                  f"{max(r['step_ms'] for r in load_run(kept / rung.name).steps):.0f} ms, "
                  f"peak {summary['peak_mem_gib']:.2f} GiB, recompiles {summary.get('recompiles')}, "
                  f"settled after {summary.get('warmup_steps_observed')} steps", flush=True)
            if rung.instrument:
                keep_instruments(rung, run_dir, kept)
            failures += check_parity(rung, all_rungs, kept)
        save()
    print(f"gpu_suite: {sum(v == 'measured' for v in done.values())} of {len(all_rungs)} runs kept in {kept}; "
          f"entry {entry}; archive {out / (series + '.tar.gz')}"
          + (f"; problems: {', '.join(failures)}" if failures else ""), flush=True)
    return 1 if failures else 0


def keep_instruments(rung: Rung, run_dir: Path, kept: Path) -> None:
    """An instrumented rung's profile and sync count, kept beside its run as profile-<target>.json and
    host-syncs-<target>.json; the profile with the run's own median step (the unprofiled steps after the warm-up)."""
    label = rung.instruments_as or rung.ladder.removeprefix("targets ")
    profile_file, syncs_file = run_dir / "profile.json", run_dir / "host-syncs.json"
    if profile_file.exists():
        summary = json.loads(profile_file.read_text())
        median = median_step_ms(kept / rung.name)
        summary["profiled_run"], summary["unprofiled_median_step_ms"] = rung.name, median
        summary["idle_share_vs_median"] = None if not median or summary["device"] != "cuda" else \
            max(0.0, 1 - summary["busy_ms"] / median)
        (kept / f"profile-{label}.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"    profile: {json.dumps(summary['categories_ms'])[:300]}", flush=True)
    if syncs_file.exists():
        shutil.copy(syncs_file, kept / f"host-syncs-{label}.json")
        print(f"    {json.loads(syncs_file.read_text())['total_per_step']:g} host syncs per step", flush=True)


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
