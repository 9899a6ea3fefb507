"""assets/gpu_suite.py: the target plan's order, commands and budget; its dry run goes through its stages on the CPU
and keeps everything in one archive; --only merges into the same entry; nothing lands in the repository unasked."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from test_commands import parse_experiment

sys.path.insert(0, str(REPO_ROOT / "assets"))
import gpu_suite  # noqa: E402

def option(rung, flag):
    return rung.args[rung.args.index(flag) + 1] if flag in rung.args else None


def test_the_targets_run_first_and_every_rung_is_a_command_line_of_its_experiment():
    plan = gpu_suite.rungs(gpu_suite.GPU_PLAN)
    names = [rung.name for rung in plan]
    assert len(set(names)) == len(names)
    for rung in plan:
        if rung.experiment != "peer" and not rung.profile:  # the profile rung takes its args when it runs
            parse_experiment(rung.experiment, [*rung.args, "--out-dir", "runs/x"])
        if rung.ladder not in ("syncs", "peer") and not rung.profile:
            assert rung.name.startswith(rung.experiment)  # the posts' GPU slots glob on it
    # The order the targets ask for: full SFT fast at micro-batch 8 (x 2) and 16, its eager reference, LoRA r16 at
    # 2048 the same way, the profile of the fastest, then flex and the host syncs; the earlier ladder behind them.
    assert names[:8] == ["single-ft-s1024-full-fast-m8x2", "single-ft-s1024-full-fast-m16",
                         "single-ft-s1024-full-reference", "single-ft-s2048-lora16-fast-m4x2",
                         "single-ft-s2048-lora16-fast-m8", "single-ft-s2048-lora16-reference", "profile-s1024-full",
                         "single-ft-s1024-full-flex-m16"]
    assert names[8] == "syncs-s1024-full" and names.index("single-ft-s1024-full-1-baseline") > 8
    assert names[-2:] == ["fsdp-ft-s1024-full-1rank", "peer-s1024-full"]
    by_name = {rung.name: rung for rung in plan}
    for rung in plan:
        if rung.reference is None:
            continue
        reference = by_name[rung.reference]
        # The same optimizer steps (run_files.Run.step_key: rows per step, steps, LR, seed, LoRA, ...), other paths.
        for flag in ("--steps", "--seq-len", "--lora-rank", "--dtype", "--model"):
            assert option(rung, flag) == option(reference, flag), (rung.name, flag)
        rows = int(option(rung, "--micro-batch-size") or 1) * int(option(rung, "--grad-accum") or 1)
        assert rows == int(option(reference, "--micro-batch-size") or 1) * int(option(reference, "--grad-accum") or 1)
        if rung.ladder.startswith("targets"):
            assert option(reference, "--attn") == "sdpa" and "--compile" not in reference.args
            assert option(reference, "--loss-chunk-tokens") is None
            assert option(rung, "--attn") in ("varlen", "flex") and "--compile" in rung.args
            assert option(rung, "--loss-chunk-tokens") == str(gpu_suite.GPU_PLAN.chunk)
            assert 30 <= int(option(rung, "--steps")) <= 40
    assert all(rung.prediction for rung in plan)


def test_the_targets_fit_in_nine_minutes():
    """The probe, the four target rungs, their references and the profile, by the estimates written before any run
    (the budget skips what would overrun, so a slower machine loses the rungs behind them)."""
    plan = gpu_suite.rungs(gpu_suite.GPU_PLAN)
    targets = plan[:[rung.name for rung in plan].index("profile-s1024-full") + 1]
    assert gpu_suite.PROBE_ESTIMATE_S + sum(rung.estimate_s for rung in targets) <= 9 * 60


def test_list_prints_the_plan_in_order_with_a_prediction_per_rung(capsys, tmp_path):
    assert gpu_suite.main(["--list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    commands, predictions = out[0::2], out[1::2]
    plan = gpu_suite.rungs(gpu_suite.GPU_PLAN)
    assert len(commands) == len(predictions) == len(plan) + 1  # the probe first
    assert "probe" in commands[0] and "cut-cross-entropy" in predictions[0]
    assert "python3 experiments/single-ft/train.py --model qwen3-0.6b" in commands[1]
    assert commands[1].endswith("runs/gpu-suite/single-ft-s1024-full-fast-m8x2")
    assert all(line.startswith("    predicted: ") and len(line) > 40 for line in predictions)
    assert not (tmp_path / "devlog").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_dry_run_keeps_each_run_in_the_entry_and_one_archive_and_only_merges(tmp_path, capsys, monkeypatch):
    # CI's environment has no trl (the "peer" dependency group): the TRL comparison is skipped, and says how to fix it.
    monkeypatch.setattr(gpu_suite, "peer_installed", lambda: False)
    assert gpu_suite.main(["--dry-run", "--root", str(tmp_path), "--date", "2026-01-01"]) == 0
    out = capsys.readouterr().out
    series = "2026-01-01-gpu-suite-cpu-dry-run"
    data = tmp_path / "devlog" / "data" / series
    runs = ["single-ft-s64-full-fast-m2", "single-ft-s64-full-reference"]
    assert sorted(path.name for path in data.iterdir()) == sorted([*runs, "probe.json", "profile.json"])
    for name in runs:
        assert json.loads((data / name / "summary.json").read_text())["config"]["steps"] == 4
    # The fast rung does its reference's steps: compared, and equal in fp32.
    assert "single-ft-s64-full-fast-m2: losses vs single-ft-s64-full-reference" in out and "MISMATCH" not in out
    probed = json.loads((data / "probe.json").read_text())
    kernels = {row["kernel"]: row for row in probed["kernels"]}
    assert set(kernels) == {"masked SDPA", "flex", "flex rows (--attn flex)", "reference"}
    assert all(row["ok"] for row in kernels.values())
    assert kernels["reference"]["backward"] and not kernels["flex rows (--attn flex)"]["backward"]
    losses = {row["loss"]: row for row in probed["losses"]}
    assert all(row["ok"] and row["ms"] > 0 for row in losses.values())  # fp32: all within 1e-5 of the fp32 loss
    assert {"common/loss.py fused, chunk 64", "common/loss.py fused, chunk 256"} <= set(losses)
    profile = json.loads((data / "profile.json").read_text())
    assert profile["steps"] == 3 and profile["categories_ms"]["matmul"] > 0
    assert profile["profiled_run"] == "single-ft-s64-full-fast-m2" and profile["unprofiled_median_step_ms"] > 0
    entry_file = tmp_path / "devlog" / f"{series}.md"
    entry = entry_file.read_text()
    assert entry.startswith("# 2026-01-01 the GPU suite on cpu-dry-run")
    assert "| single-ft-s64-full-fast-m2 | 64 | 2 | 1 |" in entry  # the table region was filled
    assert "| single-ft-s64-full-fast-m2 | 4 |" in entry  # and the parity region
    assert "`peer-s64-full` (skipped: trl or datasets not installed (python3 assets/gpu_suite.py --wheels))" in entry
    assert "- reference, float32, with backward:" in entry and "Top kernels:" in entry
    assert "- common/loss.py fused, chunk 64:" in entry
    # One archive holds the entry, the kept runs and the logs, paths from the repository root.
    archive = tmp_path / "runs" / "gpu-suite" / f"{series}.tar.gz"
    with tarfile.open(archive) as tar:
        members = set(tar.getnames())
        assert tar.extractfile(f"devlog/{series}.md").read().decode() == entry
    assert {f"devlog/data/{series}/probe.json", f"devlog/data/{series}/single-ft-s64-full-reference/metrics.jsonl",
            f"runs/gpu-suite/{series}/single-ft-s64-full-fast-m2/train.log"} <= members
    # A later call with --only adds to the same entry: the earlier runs stay, and so does a hand-written section.
    entry_file.write_text(entry.replace("\n## Probe", "\n## What it says\n\nWritten by hand.\n\n## Probe", 1))
    assert gpu_suite.main(["--dry-run", "--root", str(tmp_path), "--date", "2026-01-01", "--only", "peer-*"]) == 0
    merged = entry_file.read_text()
    assert "## What it says\n\nWritten by hand." in merged and "| single-ft-s64-full-reference | 64 |" in merged
    with tarfile.open(archive) as tar:
        assert tar.extractfile(f"devlog/{series}.md").read().decode() == merged


def test_a_dry_run_writes_nowhere_in_the_repository_unless_asked(monkeypatch, capsys):
    before = set((REPO_ROOT / "devlog").rglob("*"))
    monkeypatch.setattr(gpu_suite, "probe", lambda plan, device: {
        "versions": {}, "kernels": [], "losses": [], "shape": {"loss_tokens": 1, "hidden": 1, "vocab": 1},
        "seconds": 0.0})
    monkeypatch.setattr(gpu_suite, "rungs", lambda plan: [])
    assert gpu_suite.main(["--dry-run", "--date", "2026-01-02"]) == 0
    out = capsys.readouterr().out
    assert set((REPO_ROOT / "devlog").rglob("*")) == before
    first = out.splitlines()[0]
    assert str(REPO_ROOT) not in first and "gpu-suite-dry-run-" in first
    scratch_root = Path(first.split("runs in ")[1].split("/runs/gpu-suite/")[0])
    assert (scratch_root / "devlog" / "2026-01-02-gpu-suite-cpu-dry-run.md").exists()
    shutil.rmtree(scratch_root)


def test_syncs_are_counted_per_step_after_the_warm_up():
    log = "\n".join([
        "common/attention.py:10: UserWarning: called a synchronizing CUDA operation",  # set-up: before step 1
        "step 1/3 | loss 1.0",
        "/x/train.py:200: UserWarning: called a synchronizing CUDA operation (warm-up step 2)",
        "step 2/3 | loss 1.0",
        "/x/train.py:200: UserWarning: called a synchronizing CUDA operation",
        "/y/masking_utils.py:772: UserWarning: called a synchronizing CUDA operation",
        "/y/masking_utils.py:772: UserWarning: called a synchronizing CUDA operation",
        "step 3/3 | loss 1.0",
        "/x/train.py:260: UserWarning: called a synchronizing CUDA operation",  # evaluation, after the last step
    ])
    counts = gpu_suite.count_syncs(log, skip_steps=2)
    assert counts == {"steps_counted": 1, "per_step": {"train.py:200": 1.0, "masking_utils.py:772": 2.0},
                      "total_per_step": 3.0}
    assert gpu_suite.count_syncs(log, skip_steps=1)["per_step"] == {"train.py:200": 1.0, "masking_utils.py:772": 1.0}


def test_wheels_are_the_pinned_versions_of_what_the_machine_lacks(capsys):
    assert gpu_suite.main(["--wheels"]) == 0
    out = capsys.readouterr().out
    lock = (REPO_ROOT / "uv.lock").read_text()
    for name in gpu_suite.PEER_WHEELS:
        version = lock.split(f'name = "{name}"\nversion = "', 1)[1].split('"', 1)[0]
        assert f"{name}=={version}" in out
    assert "cut-cross-entropy==" in out and "liger-kernel==" in out
    assert "pip install -q --no-index --no-deps" in out


def test_without_a_gpu_the_suite_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no GPU visible"):
        gpu_suite.main(["--budget-min", "1"])
