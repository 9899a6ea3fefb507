"""Run folders into a devlog entry skeleton, or one run's summary as a markdown table:

    uv run python assets/devlog_skeleton.py runs/a [runs/b ...]     # hardware, software, commands, a results table
    uv run python assets/devlog_skeleton.py --table runs/a          # one run's headline numbers
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timezone
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # common, for `python assets/devlog_skeleton.py` without an install
    sys.path.insert(0, str(REPO_ROOT))

from common.metrics import summary_table  # noqa: E402  (after the path set-up above)


def runs_table(summaries: list[dict]) -> str:
    """One row per run, for comparing runs side by side (micro-batch, GA, checkpointing, dtype, times, memory)."""
    header = ("| run | micro | GA | ckpt | dtype | step_ms | comm_ms | tok/s | tok/s/device | peak_mem_gib | mfu "
              "| final_loss | eval_loss |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]

    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    for summary in summaries:
        config = summary.get("config", {})
        lines.append(
            f"| {summary.get('experiment')} | {config.get('micro_batch_size')} | {config.get('grad_accum')} | "
            f"{'T' if config.get('activation_checkpointing') else 'F'} | {config.get('dtype')} | "
            f"{number(summary.get('step_ms'), ',.0f')} | {number(summary.get('comm_ms'), ',.0f')} | "
            f"{number(summary.get('tokens_per_s'), ',.0f')} | "
            f"{number(summary.get('tokens_per_s_per_device'), ',.0f')} | "
            f"{number(summary.get('peak_mem_gib'), '.2f')} | {number(summary.get('mfu'), '.3f')} | "
            f"{number(summary.get('final_loss'), '.4f')} | {number(summary.get('eval_loss'), '.4f')} |")
    return "\n".join(lines)


def devlog_skeleton(summaries: list[dict]) -> str:
    """A devlog entry with everything a run recorded; the "what it shows" part is left to be written by hand."""
    first = summaries[0]
    hardware, packages = first.get("hardware", {}), first.get("hardware", {}).get("packages", {})
    device = hardware.get("device_name")
    if hardware.get("device_kind") == "cpu":
        device = f"CPU only: {hardware.get('cpu')}, {hardware.get('cpu_cores')} cores"
    software = [f"torch {hardware.get('torch')}"] + [f"{name} {v}" for name, v in packages.items() if v]
    if hardware.get("device_kind") == "cuda":
        software.append(f"CUDA {hardware.get('cuda')}")
    if hardware.get("hip"):
        software.append(f"HIP {hardware.get('hip')}")
    software.append(f"Python {hardware.get('python')}")
    experiments = sorted({s.get("experiment") for s in summaries})
    commands = "\n".join(s.get("command", "?") for s in summaries)
    return (f"# {datetime.now(timezone.utc):%Y-%m-%d} {', '.join(experiments)}\n\n"
            f"- hardware: {device}; world size {hardware.get('world_size')}\n"
            f"- software: {', '.join(software)}\n"
            f"- commit: {first.get('commit')}\n"
            f"- model: {first.get('model', {}).get('name')}, {first.get('model', {}).get('parameters'):,} parameters; "
            f"seq_len {first.get('config', {}).get('seq_len')}; warm-up steps excluded from averages: "
            f"{first.get('warmup_steps_excluded')}; memory: {first.get('memory_measure')}\n\n"
            f"## Commands\n\n```bash\n{commands}\n```\n\n## Results\n\n{runs_table(summaries)}\n\n"
            f"## What it shows\n\n(written by hand)\n")


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    as_table = arguments[:1] == ["--table"]
    paths = [Path(p) / "summary.json" if Path(p).is_dir() else Path(p) for p in arguments[as_table:]]
    if not paths:
        print(__doc__.strip())
        return 2
    loaded = [json.loads(p.read_text()) for p in paths]
    if as_table:
        for path, summary in zip(paths, loaded):
            print(f"### {summary.get('experiment')} ({path})\n\n{summary_table(summary)}\n")
    else:
        print(devlog_skeleton(loaded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
