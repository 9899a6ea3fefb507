"""The GPU suite: one command that turns a GPU machine into committed numbers.

    python3 assets/gpu_suite.py              # on a GPU machine, from the repository root; no uv or network needed
    python3 assets/gpu_suite.py --list       # the runs it would make, their commands and predictions; runs nothing
    python3 assets/gpu_suite.py --dry-run    # every stage on the CPU with the tiny preset (what the tests run)

It runs single-ft on the `qwen3-0.6b` preset (Qwen3-0.6B's geometry, random weights, bf16) as a ladder of rungs, each
adding one speed feature to the one before (baseline -> + chunked loss -> + compile -> larger micro-batches), at
sequence 1024 and 4096, full-parameter and LoRA r16, then fsdp-ft on one rank. Each run is the experiment's own
command line (`python3 experiments/<x>/train.py ...`), launched as a user would, with the repository on PYTHONPATH so
that it needs nothing but torch, transformers and peft (the lent GPU machines have no uv, no deepspeed, no datasets).

Every run that finishes is kept at once, as the devlog keeps runs: its summary.json and metrics.jsonl go to
devlog/data/<date>-gpu-suite-<device>/<run>/, and devlog/<date>-gpu-suite-<device>.md is (re)written with generated
regions (assets/make_posts.py) over what is kept so far. A suite cut off by its time budget or by the machine going
away therefore leaves a usable partial entry. Runs are ordered by what matters most (seq 1024 full, then LoRA, then
4096) and skipped, with a note, when the budget (--budget-min, default 20) would be overrun.

Correctness comes first in each ladder: every rung that does the baseline's optimizer steps (same tokens per step) is
compared step by step with the baseline's losses (bf16, so within BF16_TOLERANCE, not fp32's 1e-5), printed, and shown
in the entry as a parity table.

Each rung carries its prediction, written here before any GPU run: the entry prints it beside the measurement.

Not built yet (the fast-path work that remains): varlen attention for packed rows, fused AdamW and a step free of host
syncs; their rungs join the ladder when they exist. Until then the baseline attention is SDPA with the block-diagonal
mask of packed rows (common/attention.py).

Wheels: the suite needs only what the lent machine has (torch, transformers, peft). To run the peer baseline (TRL)
there too, bring its wheels (`pip download trl datasets --no-deps -d wheels/`, install with
`pip install --no-index --find-links wheels/ trl datasets`); the suite does not run it.

On a machine whose results come back only from one folder, write there (`--root <folder>`: devlog/ and runs/ go under
it) and copy its devlog/ into the repository afterwards. After the suite: commit devlog/data/<date>-gpu-suite-<device>/
and the entry, then run
`uv run python assets/make_posts.py` on a machine with the environment, which fills every post's GPU slots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT / "assets") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "assets"))

from make_plots import load_run  # noqa: E402  (after the path set-up above)
from run_series import keep  # noqa: E402

BF16_TOLERANCE = 2e-2  # largest relative per-step loss difference from the baseline rung, first 5 steps, bf16
FIRST_STEPS = 5
RUN_ESTIMATE_S = 120  # what one run is assumed to take when deciding whether the budget allows it


@dataclass(frozen=True)
class Rung:
    name: str  # run folder name; starts with the experiment's name so the posts' GPU slots find it
    experiment: str
    args: tuple[str, ...]
    prediction: str  # written before any GPU run
    ladder: str  # the rungs of one ladder share it; the first rung of a ladder is its baseline
    nproc: int = 1


@dataclass
class Plan:
    model: str
    dtype: str
    steps: int
    warmup: int  # --timing-warmup-steps (compilation and allocator growth stay out of the averages)
    chunk: int  # --loss-chunk-tokens
    ladders: list[tuple[str, int, int, tuple[int, ...]]] = field(default_factory=list)  # (label, seq, lora, micros)
    fsdp_seq: int = 1024


GPU_PLAN = Plan(model="qwen3-0.6b", dtype="bf16", steps=30, warmup=5, chunk=1024,
                ladders=[("s1024-full", 1024, 0, (4, 8)), ("s1024-lora16", 1024, 16, (4, 8)),
                         ("s4096-full", 4096, 0, (2,)), ("s4096-lora16", 4096, 16, (2,))],
                fsdp_seq=1024)
# The dry run leaves out the larger micro-batch rungs (the same code path as the compile rung, with other flags).
DRY_PLAN = Plan(model="qwen3-tiny", dtype="fp32", steps=4, warmup=1, chunk=32,
                ladders=[("s64-full", 64, 0, ())], fsdp_seq=64)


def rungs(plan: Plan) -> list[Rung]:
    common = ("--model", plan.model, "--dtype", plan.dtype, "--steps", str(plan.steps), "--eval-fraction", "0",
              "--timing-warmup-steps", str(plan.warmup), "--comm-profile-steps", "0")
    out = []
    for label, seq, lora, micros in plan.ladders:
        base = (*common, "--seq-len", str(seq), *(("--lora-rank", str(lora)) if lora else ()))
        chunked = (*base, "--loss-chunk-tokens", str(plan.chunk))
        compiled = (*chunked, "--compile")
        out += [
            Rung(f"single-ft-{label}-1-baseline", "single-ft", base, ladder=label, prediction=(
                "the reference: SDPA over packed rows with a block-diagonal mask, eager, micro-batch 1")),
            Rung(f"single-ft-{label}-2-chunked-loss", "single-ft", chunked, ladder=label, prediction=(
                "same losses; peak memory lower by about the logits and their gradient (tokens x 151,936 vocab in "
                "bf16 and fp32), which matters most at seq 4096; step time within +-10% (the same FLOPs, fewer "
                "bytes)")),
            Rung(f"single-ft-{label}-3-compile", "single-ft", compiled, ladder=label, prediction=(
                "same losses; 10-30% more tokens/s from fused norms, activations and rotary embeddings in each "
                "compiled decoder layer; the first steps slower (compilation, left out of the averages)")),
        ]
        out += [Rung(f"single-ft-{label}-4-micro{micro}", "single-ft", (*compiled, "--micro-batch-size", str(micro)),
                     ladder=label, prediction=(
                         f"{micro}x the tokens per step; more tokens/s while micro-batch 1 leaves the GPU "
                         f"under-occupied (most at seq 1024), until memory runs out"))
                for micro in micros]
    out.append(Rung(f"fsdp-ft-s{plan.fsdp_seq}-full-1rank", "fsdp-ft",
                    (*common, "--seq-len", str(plan.fsdp_seq)), ladder="fsdp", prediction=(
                        "FSDP2 on one rank: nothing to shard or communicate, so the cost of its wrapping alone; "
                        "within 5% of single-ft's baseline at the same sequence length")))
    return out


def command(rung: Rung, out_dir: Path, launcher: list[str]) -> list[str]:
    script = f"experiments/{rung.experiment}/train.py"
    if rung.nproc > 1 or rung.experiment != "single-ft":
        return [*launcher, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={rung.nproc}",
                script, *rung.args, "--out-dir", str(out_dir)]
    return [*launcher, script, *rung.args, "--out-dir", str(out_dir)]


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
    for ladder in dict.fromkeys(rung.ladder for rung in all_rungs):
        members = [rung for rung in all_rungs if rung.ladder == ladder]
        lines += [f"## {ladder}", ""]
        measured = [rung for rung in members if rung.name in kept]
        if measured:
            names = ",".join(f"{data}/{rung.name}" for rung in measured)
            ref = f" ref={data}/{measured[0].name}" if measured[0] is members[0] else ""
            columns = "run,seq,micro,lora,t_eff,step_ms,tok_s" + (",rel:tok_s" if ref else "") + \
                ",mfu,peak_mem,predicted_peak"
            lines += [f"<!-- generated:table runs={names} cols={columns}{ref} -->", "<!-- /generated -->", ""]
            twins = [rung for rung in measured[1:] if ref and parity(root / data / rung.name,
                                                                      root / data / members[0].name) is not None]
            if twins:
                lines += [f"<!-- generated:parity runs={','.join(f'{data}/{r.name}' for r in twins)}{ref} -->",
                          "<!-- /generated -->", ""]
        lines += ["Predicted before the runs:", ""]
        for rung in members:
            status = done.get(rung.name, "not run")
            lines.append(f"- `{rung.name}` ({status}): {rung.prediction}.")
        lines.append("")
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text("\n".join(lines))
    import make_posts  # the regions are filled by the same generator as every other page

    problems = make_posts.build(root, only=str(entry.relative_to(root)), figures=False, print_fn=lambda *a: None)
    if problems:
        print(f"gpu_suite: make_posts reported {problems} problem(s) in {entry}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run every stage on the CPU with the tiny preset")
    parser.add_argument("--list", action="store_true", help="print the runs, commands and predictions; run nothing")
    parser.add_argument("--budget-min", type=float, default=20.0, help="stop starting runs after this many minutes")
    parser.add_argument("--root", type=Path, default=REPO_ROOT,
                        help="where devlog/ and runs/ are written (the repository by default; tests use a scratch "
                             "folder)")
    parser.add_argument("--date", default=date.today().isoformat())
    args = parser.parse_args(argv)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    all_rungs = rungs(plan)
    launcher = [sys.executable]
    if args.list:
        for rung in all_rungs:
            print(shlex.join(command(rung, Path("runs/gpu-suite") / rung.name, ["python3"])))
            print(f"    predicted: {rung.prediction}")
        return 0
    slug = device_slug(args.dry_run)
    series = f"{args.date}-gpu-suite-{slug}"
    root = args.root.resolve()
    scratch, kept = root / "runs" / "gpu-suite" / series, root / "devlog" / "data" / series
    entry = root / "devlog" / f"{series}.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    invocation = "python3 assets/gpu_suite.py" + (" --dry-run" if args.dry_run else "")
    started, clock = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    done: dict[str, str] = {}
    failures = []
    for index, rung in enumerate(all_rungs, start=1):
        elapsed = time.perf_counter() - clock
        if elapsed + RUN_ESTIMATE_S > args.budget_min * 60 and not args.dry_run:
            done[rung.name] = "skipped: time budget"
            print(f"[{index}/{len(all_rungs)}] {rung.name}: skipped, {elapsed / 60:.1f} of {args.budget_min} min used",
                  flush=True)
            continue
        out = scratch / rung.name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        cmd = command(rung, out, launcher)
        print(f"[{index}/{len(all_rungs)}] {shlex.join(cmd)}", flush=True)
        run_start = time.perf_counter()
        with open(out / "train.log", "w") as log:
            code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = time.perf_counter() - run_start
        if code != 0 or not (out / "summary.json").exists():
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
