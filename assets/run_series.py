"""Run the series of runs that the devlog and the posts quote, and keep their results in devlog/data/.

    uv run python assets/run_series.py --list                  # every series, its runs and their commands
    uv run python assets/run_series.py workload pp             # run these series (runs already kept are skipped)
    uv run python assets/run_series.py workload --dry-run      # print the commands only
    uv run python assets/run_series.py all --date 2026-11-23   # every series, into devlog/data/2026-11-23-<series>/

Each run is launched exactly as a user would launch it (`uv run python ...`, `uv run torchrun ...`) and writes into
runs/series/<date>-<series>/<run>/ (ignored by git: checkpoints, exports and logs stay there). Its summary.json and
metrics.jsonl, and nothing else, are then copied to devlog/data/<date>-<series>/<run>/: small files, committed, the
only source of every number in blogs/ and devlog/ (assets/make_posts.py). A series that runs a sweep or the peer
baseline also keeps their tables (sweep.csv, sweep.md, peer_baseline.json, peer_baseline.md).

Run the series on an idle machine from a clean checkout: each summary.json records the commit (with "-dirty" when
tracked files had uncommitted changes, and the hash of those changes), and the timings of runs that shared the machine
with other work say nothing. A checkout with uncommitted changes or untracked files (devlog/data/ aside) is refused,
so that a committed run is reproducible from its commit; --allow-dirty runs anyway (for a try, not for devlog/data).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KEPT_FILES = ("summary.json", "metrics.jsonl")


@dataclass(frozen=True)
class Run:
    name: str  # the run's folder in the series
    experiment: str  # experiments/<experiment>/train.py
    nproc: int  # 1: `uv run python`, else `uv run torchrun --nproc_per_node=N`
    args: tuple[str, ...] = ()

    def command(self, out_dir: Path) -> list[str]:
        script = f"experiments/{self.experiment}/train.py"
        launcher = ["python"] if self.nproc == 1 else ["torchrun", f"--nproc_per_node={self.nproc}"]
        return ["uv", "run", *launcher, script, *self.args, "--out-dir", str(out_dir)]


@dataclass(frozen=True)
class Tool:
    """A series produced by a tool that runs several trainings itself (common.sweep, the peer baseline)."""
    command: tuple[str, ...]  # {out} is replaced by the tool's output folder
    kept: tuple[str, ...] = ()  # files of the output folder to keep beside the runs


def runs(*specs: Run) -> list[Run]:
    return list(specs)


# ---------------------------------------------------------------------------------------------------------------
# The series. "The workload": qwen3-tiny, seq 256, fp32, B = 4 packed rows per optimizer step, 40 steps, seed 0,
# the bundled data: every strategy does the same optimizer steps, split its own way.
TINY = ("--model", "qwen3-tiny", "--seq-len", "256", "--dtype", "fp32")
WORKLOAD = (*TINY, "--steps", "40")


def workload_runs(base: tuple[str, ...] = WORKLOAD, extra: tuple[str, ...] = (), pp_ds: bool = True,
                  zero_stages=(1, 2, 3)) -> list[Run]:
    """Every strategy on the workload's B = 4 rows: data-parallel ranks take 1 x GA 2 each, the model-parallel
    ones (tp, tp-sp, pp) see all 4 rows as 1 x GA 4 (pp: m = 4 micro-batches)."""
    specs = [Run("single-ft", "single-ft", 1, (*base, "--grad-accum", "4", *extra)),
             Run("ddp-ft", "ddp-ft", 2, (*base, "--grad-accum", "2", *extra)),
             Run("fsdp-ft", "fsdp-ft", 2, (*base, "--grad-accum", "2", *extra))]
    specs += [Run(f"zero-ft-{stage}", "zero-ft", 2, (*base, "--grad-accum", "2", "--zero-stage", str(stage),
                                                     *extra)) for stage in zero_stages]
    specs += [Run("tp-ft", "tp-ft", 2, (*base, "--grad-accum", "4", *extra)),
              Run("tp-sp-ft", "tp-sp-ft", 2, (*base, "--grad-accum", "4", *extra)),
              Run("pp-ft", "pp-ft", 2, (*base, "--grad-accum", "4", "--schedule", "1f1b", *extra))]
    if pp_ds:
        specs.append(Run("pp-ds-ft", "pp-ds-ft", 2, (*base, "--grad-accum", "4", *extra)))
    return specs


def lora_runs() -> list[Run]:
    return workload_runs(base=(*TINY, "--steps", "20"), extra=("--lora-rank", "8"), pp_ds=False, zero_stages=(3,))


# Qwen3-0.6B's published geometry (596M parameters, random init), so that model state dominates each process and
# sharding shows in measured memory; bf16 mixed precision, as the experiments run on a GPU (each keeps its own dtype
# layout: fp32 master weights and autocast, FSDP2's bf16 gathers, DeepSpeed's bf16 mode). 3 steps: the first is
# warm-up, the second is measured (state bytes), the last two are timed. No held-out evaluation: a forward over it
# takes minutes here. No profiled step: torch.profiler's event records of a 596M-parameter step add about 2 GiB to
# each process's peak RSS (fsdp-ft measured 11.2 GiB per rank with a profiled step, 9.4 GiB without), which would
# hide the sharding this series measures; the workload series counts the same collectives at tiny scale.
MEMORY = ("--model", "qwen3-0.6b", "--seq-len", "256", "--dtype", "bf16", "--steps", "3", "--eval-fraction", "0",
          "--timing-warmup-steps", "1", "--comm-profile-steps", "0")


def memory_runs() -> list[Run]:
    # Left out, because two ranks of them do not fit in this machine's 24 GiB beside two Python runtimes, as
    # common.memory predicts (`python -m common.memory --model qwen3-0.6b --gpus 2 --seq-len 256 --dtype bf16`):
    # ddp-ft (a full replica per rank, 11.1 GiB predicted) and zero-ft stage 3 (11.1 GiB predicted: with DeepSpeed's
    # default stage3_max_live_parameters of 1e9 the whole 596M-parameter model stays gathered, beside the 2 GB
    # reduce bucket). zero-ft stage 3 was tried: a rank was killed for memory before the first step ended.
    specs = [Run("single-ft", "single-ft", 1, (*MEMORY, "--grad-accum", "2")),
             Run("fsdp-ft", "fsdp-ft", 2, MEMORY)]
    specs += [Run(f"zero-ft-{stage}", "zero-ft", 2, (*MEMORY, "--zero-stage", str(stage))) for stage in (1, 2)]
    specs += [Run("tp-ft", "tp-ft", 2, (*MEMORY, "--grad-accum", "2")),
              Run("tp-sp-ft", "tp-sp-ft", 2, (*MEMORY, "--grad-accum", "2")),
              Run("pp-ft", "pp-ft", 2, (*MEMORY, "--grad-accum", "2", "--schedule", "1f1b")),
              Run("single-ft-ac", "single-ft", 1, (*MEMORY, "--grad-accum", "2", "--activation-checkpointing")),
              Run("single-ft-chunked", "single-ft", 1, (*MEMORY, "--grad-accum", "2", "--loss-chunk-tokens", "256")),
              Run("single-ft-ac-chunked", "single-ft", 1, (*MEMORY, "--grad-accum", "2", "--activation-checkpointing",
                                                          "--loss-chunk-tokens", "256"))]
    return specs


# The bytes each data-parallel strategy hands its collectives in bf16 (what the GPU runs use), on two gloo ranks, which
# count them exactly: each strategy's own precision layout (DDP reduces fp32 gradients, FSDP2 gathers bf16 weights and
# reduces fp32, DeepSpeed's bf16 mode gathers bf16 weights and all-reduces fp32 gradients), at m = 1 and 4
# micro-batches. 5 steps: 2 of warm-up, then 2 under the profiler that counts the collectives, then 1.
BF16_BYTES = ("--model", "qwen3-tiny", "--seq-len", "256", "--dtype", "bf16", "--steps", "5", "--eval-fraction", "0",
              "--timing-warmup-steps", "2", "--comm-profile-steps", "2")


def bf16_bytes_runs() -> list[Run]:
    specs = []
    for m in (1, 4):
        ga = (*BF16_BYTES, "--grad-accum", str(m))
        specs += [Run(f"ddp-ft-ga{m}", "ddp-ft", 2, ga), Run(f"fsdp-ft-ga{m}", "fsdp-ft", 2, ga),
                  Run(f"zero-ft-1-ga{m}", "zero-ft", 2, (*ga, "--zero-stage", "1")),
                  Run(f"zero-ft-2-ga{m}", "zero-ft", 2, (*ga, "--zero-stage", "2"))]
    gather_once = ("--no-reshard-after-forward", "--no-reshard-after-backward")
    specs.append(Run("fsdp-ft-ga4-gather-once", "fsdp-ft", 2, (*BF16_BYTES, "--grad-accum", "4", *gather_once)))
    return specs


# The workload under --dtype bf16, the setting a GPU user runs: every strategy with its own bf16 layout (bf16 weights
# and fp32 masters, FSDP2's bf16 gathers, DeepSpeed's bf16 mode) against single-ft's bf16 steps.
BF16_WORKLOAD = ("--model", "qwen3-tiny", "--seq-len", "256", "--dtype", "bf16", "--steps", "40")
SHORT = (*TINY, "--steps", "12")
MOE = ("--model", "qwen3-moe-tiny", "--seq-len", "256", "--dtype", "fp32", "--steps", "40")
SERIES: dict[str, list[Run] | Tool] = {
    "workload": workload_runs(),
    "lora": lora_runs(),
    "memory-0.6b": memory_runs(),
    "bf16-bytes": bf16_bytes_runs(),
    "bf16-workload": workload_runs(base=BF16_WORKLOAD),
    "ddp": [Run(f"ddp-ft-bucket{mb}", "ddp-ft", 2, (*TINY, "--steps", "20", "--grad-accum", "2", "--bucket-cap-mb",
                                                     str(mb))) for mb in (1, 5, 25)]
           + [Run(f"ddp-ft-ga{ga}{suffix}", "ddp-ft", 2, (*TINY, "--steps", "20", "--grad-accum", str(ga), *flag))
              for ga in (2, 4) for suffix, flag in (("", ()), ("-every-micro-batch", ("--reduce-every-micro-batch",)))],
    "fsdp": [Run(f"fsdp-ft-ga{ga}{suffix}", "fsdp-ft", 2, (*SHORT, "--grad-accum", str(ga), *flag))
             for ga in (1, 2, 4, 8)
             for suffix, flag in (("", ()), ("-no-reshard", ("--no-reshard-after-forward",)),
                                  ("-gather-once", ("--no-reshard-after-forward", "--no-reshard-after-backward")))]
            + [Run("fsdp-ft-ga4-every-micro-batch", "fsdp-ft", 2, (*SHORT, "--grad-accum", "4",
                                                                   "--reduce-every-micro-batch"))],
    "tp": [Run(f"{experiment}-seq{seq}", experiment, 2, (*TINY, "--steps", "12", "--seq-len", str(seq)))
           for experiment in ("tp-ft", "tp-sp-ft") for seq in (256, 512)]
          # The workload's tp-ft without the q_norm/k_norm gradient all-reduce: compare with workload/tp-ft.
          + [Run("tp-ft-no-sync-qk-norm-grads", "tp-ft", 2, (*WORKLOAD, "--grad-accum", "4",
                                                              "--no-sync-qk-norm-grads"))],
    "pp": [Run(f"pp-ft-{schedule}-m{m}", "pp-ft", 2, (*SHORT, "--grad-accum", str(m), "--schedule", schedule))
           for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zbv") for m in (2, 4, 8)]
          + [Run(f"pp-ds-ft-m{m}", "pp-ds-ft", 2, (*SHORT, "--grad-accum", str(m))) for m in (2, 4, 8)]
          + [Run("pp-ft-1f1b-m8-split3", "pp-ft", 2, (*SHORT, "--grad-accum", "8", "--schedule", "1f1b",
                                                     "--split", "3"))],
    # The layouts for more than one node, on 4 ranks (2 "nodes" x 2), doing the workload's B = 4 rows per step: the
    # same optimizer steps as workload/single-ft. Data parallel 4 x 1 row; HSDP 2 replicas x 2 shards x 1 row; FSDP x TP
    # 2 dp rows x 2 tp ranks, GA 2; pipelines 2 stages x 2 replicas, GA 2 (m = 2 micro-batches each).
    "four-ranks": [Run("ddp-ft-4", "ddp-ft", 4, WORKLOAD), Run("fsdp-ft-4", "fsdp-ft", 4, WORKLOAD),
                   Run("fsdp-ft-hsdp-2x2", "fsdp-ft", 4, (*WORKLOAD, "--replicate-degree", "2")),
                   Run("fsdp-tp-ft-2x2", "fsdp-tp-ft", 4, (*WORKLOAD, "--tp-degree", "2", "--grad-accum", "2")),
                   Run("pp-ft-2x2", "pp-ft", 4, (*WORKLOAD, "--stages", "2", "--grad-accum", "2", "--schedule",
                                                 "1f1b")),
                   Run("pp-ds-ft-2x2", "pp-ds-ft", 4, (*WORKLOAD, "--stages", "2", "--grad-accum", "2"))],
    # A mixture of experts: qwen3-moe-tiny (4 layers of 8 experts, 2 per token) on the workload's data and B = 4 rows.
    # lr 1e-4, at which no token changes experts between single-ft and ep-ft (tests/test_ep_ft.py), and the
    # preset's lr 1e-3, at which some do; ep-ft on 4 ranks (2 experts each, 3/4 of the rows leave their rank).
    "moe": [Run("single-ft", "single-ft", 1, (*MOE, "--grad-accum", "4", "--lr", "1e-4")),
            Run("ep-ft", "ep-ft", 2, (*MOE, "--grad-accum", "2", "--lr", "1e-4")),
            Run("ep-ft-4", "ep-ft", 4, (*MOE, "--lr", "1e-4")),
            Run("single-ft-lr1e-3", "single-ft", 1, (*MOE, "--grad-accum", "4")),
            Run("ep-ft-lr1e-3", "ep-ft", 2, (*MOE, "--grad-accum", "2"))],
    "sweep": Tool(("uv", "run", "python", "-m", "common.sweep", "--strategies", "fsdp-ft", "pp-ds-ft",
                   "--micro-batch-sizes", "1", "2", "--grad-accums", "2", "4", "--checkpointing", "off", "on",
                   "--dtypes", "fp32", "--model", "qwen3-tiny", "--seq-len", "256", "--steps", "12", "--out", "{out}"),
                  kept=("sweep.csv", "sweep.md")),
    "single": [Run("single-ft-default", "single-ft", 1, ()),
               Run("single-ft-eval-packed", "single-ft", 1, (*TINY, "--steps", "0")),
               Run("single-ft-eval-unpacked", "single-ft", 1, (*TINY, "--steps", "0", "--no-packing"))],
    "peer": Tool(("uv", "run", "--group", "peer", "python", "assets/peer_baseline.py", "--steps", "40", "--seq-len",
                  "256", "--micro-batch-size", "1", "--grad-accum", "4", "--out-dir", "{out}"),
                 kept=("peer_baseline.json", "peer_baseline.md")),
}


# ---------------------------------------------------------------------------------------------------------------
def keep(source: Path, target: Path, extra: tuple[str, ...] = ()) -> int:
    """Copy the small result files of every run folder under `source` to the same place under `target`."""
    copied = 0
    for summary in sorted(source.rglob("summary.json")):
        run_dir = target / summary.parent.relative_to(source)
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in KEPT_FILES:
            if (summary.parent / name).exists():
                shutil.copy2(summary.parent / name, run_dir / name)
        copied += 1
    for name in extra:
        if (source / name).exists():
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, target / name)
    return copied


def run_series(name: str, day: str, dry_run: bool, force: bool) -> list[str]:
    folder = f"{day}-{name}"
    scratch, kept = REPO_ROOT / "runs" / "series" / folder, REPO_ROOT / "devlog" / "data" / folder
    failures = []
    spec = SERIES[name]
    if isinstance(spec, Tool):
        command = [part.replace("{out}", str(scratch.relative_to(REPO_ROOT))) for part in spec.command]
        print(f"[{folder}] {shlex.join(command)}", flush=True)
        if dry_run:
            return failures
        if kept.exists() and not force:
            print(f"[{folder}] kept already: {kept.relative_to(REPO_ROOT)} (--force to rerun)")
            return failures
        if subprocess.run(command, cwd=REPO_ROOT).returncode != 0:
            failures.append(folder)
        print(f"[{folder}] kept {keep(scratch, kept, spec.kept)} runs in {kept.relative_to(REPO_ROOT)}")
        return failures
    for index, run in enumerate(spec, start=1):
        out = scratch / run.name
        command = run.command(out.relative_to(REPO_ROOT))
        print(f"[{folder} {index}/{len(spec)}] {shlex.join(command)}", flush=True)
        if dry_run:
            continue
        if (kept / run.name / "summary.json").exists() and not force:
            print("    kept already (--force to rerun)")
            continue
        if out.exists():
            shutil.rmtree(out)
        started = time.perf_counter()
        out.mkdir(parents=True)
        with open(out / "train.log", "w") as log:
            code = subprocess.run(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"    {'ok' if code == 0 else f'FAILED ({code}), see {out}/train.log'} in "
              f"{time.perf_counter() - started:.0f} s", flush=True)
        if code != 0:
            failures.append(f"{folder}/{run.name}")
            continue
        keep(out, kept / run.name)
    return failures


def uncommitted_changes() -> list[str]:
    """The paths git reports changed or untracked (not ignored) in this checkout, devlog/data/ aside (where the
    series keep their runs); [] outside a git checkout."""
    status = subprocess.run(["git", "status", "--porcelain", "--", ".", ":(exclude)devlog/data"], cwd=REPO_ROOT,
                            capture_output=True, text=True)
    return [line[3:] for line in status.stdout.splitlines()] if status.returncode == 0 else []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("series", nargs="*", help=f"series to run: {', '.join(SERIES)}, or all")
    parser.add_argument("--date", default=date.today().isoformat(), help="the date in the series' folder names")
    parser.add_argument("--list", action="store_true", help="list the series and their commands")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--force", action="store_true", help="rerun runs that devlog/data already holds")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run from a checkout with uncommitted changes (its runs record <sha>-dirty)")
    args = parser.parse_args(argv)
    names = list(SERIES) if args.series == ["all"] or args.list else args.series
    unknown = [name for name in names if name not in SERIES]
    if unknown or not names:
        parser.error(f"unknown series {', '.join(unknown)}; choose from {', '.join(SERIES)} or all" if unknown
                     else "name a series (or all), or --list")
    if not (args.dry_run or args.list or args.allow_dirty) and (changes := uncommitted_changes()):
        sys.exit(f"uncommitted changes ({', '.join(changes[:3])}{', ...' if len(changes) > 3 else ''}): the runs "
                 f"would record a commit that does not hold what they ran; commit first, or --allow-dirty for a try")
    failures = []
    for name in names:
        failures += run_series(name, args.date, args.dry_run or args.list, args.force)
    if failures:
        sys.exit(f"failed: {', '.join(failures)}")


if __name__ == "__main__":
    main()
