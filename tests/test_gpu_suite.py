"""assets/gpu_suite.py: its dry run goes through every stage on the CPU, and its GPU plan's commands parse."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO_ROOT
from test_commands import parse_experiment

sys.path.insert(0, str(REPO_ROOT / "assets"))
import gpu_suite  # noqa: E402


def test_every_gpu_rung_is_a_valid_command_line_of_its_experiment():
    plan = gpu_suite.rungs(gpu_suite.GPU_PLAN)
    assert {rung.experiment for rung in plan} == {"single-ft", "fsdp-ft"}
    for rung in plan:
        parse_experiment(rung.experiment, [*rung.args, "--out-dir", "runs/x"])
    # Each ladder starts with its baseline and adds one feature per rung (the suite compares rungs with it).
    for ladder in {rung.ladder for rung in plan} - {"fsdp"}:
        names = [rung.name for rung in plan if rung.ladder == ladder]
        assert names[0].endswith("-1-baseline") and names[1].endswith("-2-chunked-loss")
        assert names[2].endswith("-3-compile")
    assert all(rung.name.startswith(rung.experiment) for rung in plan)  # the posts' GPU slots glob on it


def test_dry_run_keeps_each_run_and_writes_the_entry_with_parity(tmp_path, capsys):
    assert gpu_suite.main(["--dry-run", "--root", str(tmp_path), "--date", "2026-01-01"]) == 0
    out = capsys.readouterr().out
    series = "2026-01-01-gpu-suite-cpu-dry-run"
    kept = sorted(path.name for path in (tmp_path / "devlog" / "data" / series).iterdir())
    assert kept == ["fsdp-ft-s64-full-1rank", "single-ft-s64-full-1-baseline", "single-ft-s64-full-2-chunked-loss",
                    "single-ft-s64-full-3-compile"]
    for name in kept:
        summary = json.loads((tmp_path / "devlog" / "data" / series / name / "summary.json").read_text())
        assert summary["config"]["model"] == "qwen3-tiny" and summary["config"]["steps"] == 4
    # Chunked loss and compile do the baseline's steps: compared, and equal in fp32.
    assert out.count("losses vs baseline") == 2 and "MISMATCH" not in out
    entry = (tmp_path / "devlog" / f"{series}.md").read_text()
    assert entry.startswith(f"# 2026-01-01 the GPU suite on cpu-dry-run")
    assert "| single-ft-s64-full-3-compile | 64 | 1 |" in entry  # the table region was filled
    assert "| single-ft-s64-full-2-chunked-loss | 4 |" in entry  # and the parity region
    assert "`fsdp-ft-s64-full-1rank` (measured)" in entry


def test_list_runs_nothing(capsys, tmp_path):
    assert gpu_suite.main(["--list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "python3 experiments/single-ft/train.py --model qwen3-0.6b" in out and "predicted:" in out
    assert not (tmp_path / "devlog").exists()


def test_without_a_gpu_the_suite_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no GPU visible"):
        gpu_suite.main(["--budget-min", "1"])
