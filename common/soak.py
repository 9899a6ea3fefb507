"""Soak: start every multi-rank experiment's default run several times in a row under background CPU load, and count
what must never happen: hangs, aborts, non-zero exits and unclean ends.

    uv run python -m common.soak                                     # 3 runs of each, 2 cores kept busy beside them
    uv run python -m common.soak --experiments fsdp-ft tp-sp-ft --runs 5 --steps 30
    uv run python -m common.soak --load 0 --runs 1 --out runs/soak   # no background load

Each run is what a user starts: `python -m torch.distributed.run --standalone --nproc_per_node=2
experiments/<name>/train.py` with the experiment's defaults (plus --steps when given, an --out-dir of its own, and
what NEEDS names for an experiment whose defaults do not run on 2 ranks).
Its outcome is one of:
- hang: still running after --timeout-s; its processes (torchrun's workers run in sessions of their own) are killed;
- abort: ended by a signal (SIGABRT after "terminate called ...", SIGSEGV), or "terminate called" in its output;
- exit N: ended with a non-zero status;
- unclean: exit 0, but PyTorch listed collectives that were never waited on when the process ended;
- ok: exit 0, a summary.json, none of the above.
The background load is --load processes that each spin one core at normal priority for the whole soak, so that the
ranks lose the CPU at random points, as on a shared machine or a CI runner. The report (a table by experiment and a
totals line) is printed and written to <out>/soak.md; the exit status is 1 if any run was not ok.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.sweep import format_duration, last_error_line

REPO_ROOT = Path(__file__).resolve().parent.parent
# Every experiment that runs more than one rank (single-ft is the one-process reference).
MULTI_RANK = ("ddp-ft", "fsdp-ft", "zero-ft", "tp-ft", "tp-sp-ft", "pp-ft", "pp-ds-ft", "fsdp-tp-ft", "ep-ft")
OUTCOMES = ("ok", "hang", "abort", "exit", "unclean")
# What an experiment needs beyond its defaults to run on 2 ranks at all: pp-ft's default is one micro-batch per step,
# which 1F1B over 2 stages refuses (in one line, before anything starts); its docstring's runs all pass --grad-accum.
NEEDS = {"pp-ft": ("--grad-accum", "4")}


def command(experiment: str, nproc: int, out_dir: Path, steps: int | None) -> list[str]:
    script = str(REPO_ROOT / "experiments" / experiment / "train.py")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script,
            *NEEDS.get(experiment, ()), "--out-dir", str(out_dir)]
    return argv + (["--steps", str(steps)] if steps is not None else [])


def classify(returncode: int | None, output: str, has_summary: bool) -> str:
    """The outcome of one run: None as returncode means it was still running at the timeout."""
    if returncode is None:
        return "hang"
    if returncode < 0 or "terminate called" in output:
        return "abort"
    if returncode > 0:
        return "exit"
    if "unwaited collective calls" in output or not has_summary:
        return "unclean"
    return "ok"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc): torchrun starts its workers in new sessions, so a process group or
    session kill of the launcher would leave them running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def kill_tree(process: subprocess.Popen) -> None:
    for pid in [*descendants(process.pid), process.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def run_once(experiment: str, nproc: int, out_dir: Path, steps: int | None, timeout_s: float) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "train.log"
    start = time.perf_counter()
    with open(log, "w") as handle:
        handle.write(" ".join(command(experiment, nproc, out_dir, steps)) + "\n")
        handle.flush()
        process = subprocess.Popen(command(experiment, nproc, out_dir, steps), cwd=REPO_ROOT, stdout=handle,
                                   stderr=subprocess.STDOUT)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(process)
            returncode = None
    output = log.read_text(errors="replace")
    outcome = classify(returncode, output, (out_dir / "summary.json").exists())
    detail = "" if outcome == "ok" else (f"still running after {timeout_s:g} s" if outcome == "hang" else
                                         f"status {returncode}: {last_error_line(log)}")
    return dict(experiment=experiment, outcome=outcome, seconds=time.perf_counter() - start, detail=detail,
                log=str(log))


def start_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def report(results: list[dict], args: argparse.Namespace) -> str:
    steps = f" with --steps {args.steps}" if args.steps else ""
    lines = [f"soak: {args.runs} run(s) of each experiment's default{steps}"
             f" on {args.nproc} ranks, {args.load} core(s) kept busy beside them, timeout {args.timeout_s:g} s",
             "", "| experiment | runs | " + " | ".join(OUTCOMES) + " | median wall |",
             "|---|---:|" + "---:|" * len(OUTCOMES) + "---:|"]
    for experiment in args.experiments:
        runs = [r for r in results if r["experiment"] == experiment]
        if not runs:
            continue
        seconds = sorted(r["seconds"] for r in runs)
        counts = [sum(r["outcome"] == outcome for r in runs) for outcome in OUTCOMES]
        lines.append(f"| {experiment} | {len(runs)} | " + " | ".join(map(str, counts)) +
                     f" | {format_duration(seconds[len(seconds) // 2])} |")
    totals = {outcome: sum(r["outcome"] == outcome for r in results) for outcome in OUTCOMES}
    lines += ["", f"total: {len(results)} runs, " + ", ".join(f"{n} {outcome}" for outcome, n in totals.items())]
    lines += [f"- {r['experiment']}: {r['outcome']}, {r['detail']} ({r['log']})"
              for r in results if r["outcome"] != "ok"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiments", nargs="+", default=list(MULTI_RANK), choices=MULTI_RANK, metavar="NAME",
                        help=f"which experiments (default: all of {', '.join(MULTI_RANK)})")
    parser.add_argument("--runs", type=int, default=3, help="runs of each experiment, one after another (default 3)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per run (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="--steps for every run (default: each experiment's)")
    parser.add_argument("--load", type=int, default=2, help="background processes spinning a core each (default 2)")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="a run still going after this long counts as a hang (default 1800)")
    parser.add_argument("--out", default=None, help="folder for the runs and soak.md (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.nproc < 1 or args.load < 0 or args.timeout_s <= 0:
        parser.error("--runs and --nproc must be >= 1, --load >= 0 and --timeout-s > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="soak-"))
    load = start_load(args.load)
    results = []
    try:
        for experiment in args.experiments:
            for index in range(args.runs):
                result = run_once(experiment, args.nproc, out / f"{experiment}-{index + 1}", args.steps,
                                  args.timeout_s)
                print(f"{experiment} run {index + 1}/{args.runs}: {result['outcome']} "
                      f"({format_duration(result['seconds'])}) {result['detail']}", flush=True)
                results.append(result)
    finally:
        for process in load:
            process.kill()
            process.wait()
    text = report(results, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.md").write_text(text + "\n")
    print(f"\n{text}\n\n-> {out / 'soak.md'}")
    return 0 if all(r["outcome"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
