"""A run as its committed files: summary.json and metrics.jsonl (devlog/data/<series>/<run>/), read back for the
figures (make_plots.py), the posts (make_posts.py) and the GPU suite."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Config fields that, with the model and T_eff, fix every step's rows and update (`steps` too: the learning rate
# decays to 0 at the last step, so a 20-step run is not the first half of a 40-step one). A run whose config lacks
# one (TRL's in the peer baseline, which packs its own way) is never taken for a twin of one that has it.
STEP_SETTINGS = ("data", "seq_len", "seed", "eval_fraction", "packing", "dtype", "lr", "warmup_steps", "steps",
                 "weight_decay", "max_grad_norm", "lora_rank")


@dataclass
class Run:
    folder: Path
    summary: dict
    steps: list[dict]  # metrics.jsonl records
    label: str = ""

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def config(self) -> dict:
        return self.summary.get("config", {})

    def step_key(self) -> tuple:
        """Runs with the same key did the same optimizer steps (the parity the tests check): the same model and
        tokens per step, and the same value for every setting that fixes the rows and the update."""
        return (self.summary.get("model", {}).get("name"), self.summary.get("t_eff"),
                *(self.config.get(key) for key in STEP_SETTINGS))


def load_run(folder: Path) -> Run:
    metrics_path = folder / "metrics.jsonl"
    steps = ([json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
             if metrics_path.exists() else [])
    return Run(folder, json.loads((folder / "summary.json").read_text()), steps, label=folder.name)


def run_folders(root: Path, pattern: str) -> list[Path]:
    """The run folders (holding summary.json) that a glob relative to `root` matches, sorted by path."""
    return sorted(path for path in root.glob(pattern) if (path / "summary.json").is_file())


def find_runs(paths: list[Path]) -> list[Run]:
    """Every run folder at or below the given paths, in the order given (then sorted within a folder)."""
    runs = []
    for path in paths:
        if not path.exists():
            raise SystemExit(f"{path}: no such folder")
        summaries = [path / "summary.json"] if (path / "summary.json").exists() else sorted(path.rglob("summary.json"))
        runs += [load_run(summary.parent) for summary in summaries]
    if not runs:
        raise SystemExit(f"no summary.json under {', '.join(map(str, paths))}")
    # The experiment's name where it is unique, else the folder name (sweep cells' names say what differs).
    names = [run.summary.get("experiment", run.name) for run in runs]
    for run, name in zip(runs, names):
        run.label = name if names.count(name) == 1 else run.name
    return runs
