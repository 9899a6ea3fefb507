"""assets/gpu_suite.py: the target plan's order, commands and budget; its dry run goes through its stages on the CPU
and keeps everything in one archive; --only merges into the same entry; nothing lands in the repository unasked."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import warnings
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from test_commands import parse_experiment

sys.path.insert(0, str(REPO_ROOT / "assets"))
import gpu_suite  # noqa: E402


def test_the_targets_run_first_and_every_rung_is_a_command_line_of_its_experiment():
    plan = gpu_suite.rungs(gpu_suite.GPU_PLAN)
    names = [rung.name for rung in plan]
    assert len(set(names)) == len(names)
    for rung in plan:
        if rung.experiment not in ("peer", "probe"):
            parse_experiment(rung.experiment, [*rung.args, "--out-dir", "runs/x"])
            assert rung.name.startswith(rung.experiment)  # the posts' GPU slots glob on it
    # The order the targets ask for: each target's fast rung (profiled and sync-counted in its own warm-up) and its
    # eager reference, FlexAttention at both, LoRA's fused adapters, the probe in a process of its own; the rest
    # behind them.
    assert names[:8] == ["single-ft-s1024-full-fast-m16", "single-ft-s1024-full-reference",
                         "single-ft-s2048-lora16-fast-m8", "single-ft-s2048-lora16-reference",
                         "single-ft-s1024-full-flex-m16", "single-ft-s2048-lora16-flex-m8",
                         "single-ft-s2048-lora16-fused-m8", "probe"]
    assert names.index("single-ft-s1024-qlora16-4b") > 7 and names.index("single-ft-s1024-full-1-baseline") > 7
    assert names[-2:] == ["fsdp-ft-s1024-full-1rank", "peer-s1024-full"]
    instrumented = [rung for rung in plan if rung.instrument]
    assert [rung.name for rung in instrumented] == [*names[0:3:2], "single-ft-s2048-lora16-fused-m8"]
    for rung in instrumented:  # step 1 (compilation), the profiled and the sync-counted steps: all in the warm-up
        assert int(rung.option("--timing-warmup-steps")) >= 1 + gpu_suite.PROFILE_STEPS + gpu_suite.SYNC_STEPS
        assert int(rung.option("--steps")) - int(rung.option("--timing-warmup-steps")) >= 20  # measured steps
    by_name = {rung.name: rung for rung in plan}
    for rung in plan:
        if rung.reference is None:
            continue
        reference = by_name[rung.reference]
        # The same optimizer steps (run_files.Run.step_key: rows per step, steps, LR, seed, LoRA, ...), other paths.
        for flag in ("--steps", "--seq-len", "--lora-rank", "--dtype", "--model"):
            assert rung.option(flag) == reference.option(flag), (rung.name, flag)
        assert rung.tokens_per_step == reference.tokens_per_step
        if rung.ladder.startswith("targets"):
            assert reference.option("--attn") == "sdpa" and "--compile" not in reference.args
            assert reference.option("--loss-chunk-tokens") is None
            assert rung.option("--attn") in ("varlen", "flex") and "--compile" in rung.args
            assert rung.option("--loss-chunk-tokens") == str(gpu_suite.GPU_PLAN.chunk)
            assert 30 <= int(rung.option("--steps")) <= 40
    assert all(rung.prediction for rung in plan)
    # The fused rung is the varlen LoRA rung with one flag more (the same shape, compile and loss): the difference
    # between their step times is the fusion's.
    fused, varlen = by_name["single-ft-s2048-lora16-fused-m8"], by_name["single-ft-s2048-lora16-fast-m8"]
    assert fused.args == (*varlen.args, "--lora-fused") and fused.reference == varlen.reference
    both = by_name["single-ft-s2048-lora16-fused-flex-m8"]  # and flex in place of varlen, after the probe
    assert both.args == (*by_name["single-ft-s2048-lora16-flex-m8"].args, "--lora-fused")  # flex's, fused
    assert [rung.name for rung in plan if "--lora-fused" in rung.args] == [fused.name, both.name]
    assert names.index(both.name) == names.index("probe") + 1 and fused.instruments_as == "s2048-lora16-fused"


def test_the_targets_fit_in_nine_minutes_with_the_start_up_and_the_probe_follows():
    """The target rungs, flex and LoRA's fused rung, by the estimates written before any run, after a minute of
    start-up (the budget skips what would overrun, so a slower machine loses the rungs behind them). The probe comes
    next: its H100 numbers are committed (2026-11-27), and where the fused rung leaves it too little of a 9-minute
    budget it is skipped with a note (`--only probe` runs it)."""
    plan = gpu_suite.rungs(gpu_suite.GPU_PLAN)
    probe = [rung.name for rung in plan].index("probe")
    assert all(rung.ladder.startswith("targets") for rung in plan[:probe])
    assert 60 + sum(rung.estimate_s for rung in plan[:probe]) <= 9 * 60


def test_the_budget_guesses_from_the_runs_before(tmp_path):
    plan = {rung.name: rung for rung in gpu_suite.rungs(gpu_suite.GPU_PLAN)}
    budget = gpu_suite.Budget()
    fast, lora, reference = (plan["single-ft-s1024-full-fast-m16"], plan["single-ft-s2048-lora16-flex-m8"],
                             plan["single-ft-s1024-full-reference"])
    assert budget.guess(fast) == fast.estimate_s  # nothing measured yet
    run = tmp_path / "run"
    run.mkdir()
    # 30 steps: the first 10 s (compilation), then 0.2 s each for 16,384 tokens; 40 s of wall time in all
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "step_ms": 10_000 if i == 1 else 200}) + "\n" for i in range(1, 31)))
    (run / "summary.json").write_text("{}")
    budget.measured(fast, 40.0, run)
    overhead = 40.0 - 29 * 0.2
    assert budget.guess(lora) == pytest.approx(overhead + 30 * 0.2)  # the same tokens per step, the same kind
    assert budget.guess(reference) == reference.estimate_s  # eager: another kind, not measured yet


def test_host_syncs_are_counted_by_line_between_start_and_stop():
    counter = gpu_suite.SyncCounter()
    with pytest.warns(UserWarning, match="synchronizing"):  # before start(): shown, not counted
        warnings.warn("called a synchronizing CUDA operation")
    counter.start()
    try:
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")
        with pytest.warns(UserWarning, match="something else"):  # other warnings pass through
            warnings.warn("something else")
    finally:
        counts = counter.stop(steps=2)
    assert counts["steps_counted"] == 2 and counts["total_per_step"] == 1.0
    [(where, per_step)] = counts["per_step"].items()
    assert where.startswith("test_gpu_suite.py:") and per_step == 1.0


def test_list_prints_the_plan_in_order_with_a_prediction_per_rung(capsys, tmp_path):
    assert gpu_suite.main(["--list", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    commands, predictions = out[0::2], out[1::2]
    plan = gpu_suite.rungs(gpu_suite.GPU_PLAN)
    assert len(commands) == len(predictions) == len(plan)
    assert "--instrument-child runs/gpu-suite/single-ft-s1024-full-fast-m16 experiments/single-ft/train.py" \
        in commands[0] and commands[0].endswith("--out-dir runs/gpu-suite/single-ft-s1024-full-fast-m16")
    assert "assets/gpu_probe.py runs/gpu-suite/probe/probe.json --device cuda" in commands[7]
    assert "cut-cross-entropy" in predictions[7]
    assert all(line.startswith("    predicted: ") and len(line) > 40 for line in predictions)
    assert not (tmp_path / "devlog").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_dry_run_keeps_each_run_in_the_entry_and_one_archive_and_only_merges(tmp_path, capsys, monkeypatch):
    # CI's environment has no trl (the "peer" dependency group): the TRL comparison is skipped, and says how to fix it.
    monkeypatch.setattr(gpu_suite, "installed", lambda *packages: False)
    assert gpu_suite.main(["--dry-run", "--root", str(tmp_path), "--date", "2026-01-01"]) == 0
    out = capsys.readouterr().out
    series = "2026-01-01-gpu-suite-cpu-dry-run"
    data = tmp_path / "devlog" / "data" / series
    runs = ["single-ft-s64-full-fast-m2", "single-ft-s64-full-reference"]
    assert sorted(path.name for path in data.iterdir()) == sorted([*runs, "probe.json", "profile-s64-full.json"])
    for name in runs:
        summary = json.loads((data / name / "summary.json").read_text())
        assert summary["config"]["steps"] == 6
        # The suite's prediction, made before the launch (the scripts predict nothing), is the kept summary's.
        rung = next(rung for rung in gpu_suite.rungs(gpu_suite.DRY_PLAN) if rung.name == name)
        assert summary["predicted_peak_mem_gib"] == gpu_suite.predict_before_launch(rung) > 0
        assert summary["predicted_peak_mem_gib_by"].startswith("assets/gpu_suite.py")
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
    profile = json.loads((data / "profile-s64-full.json").read_text())
    assert profile["steps"] == 3 and profile["categories_ms"]["matmul"] > 0
    assert profile["profiled_run"] == "single-ft-s64-full-fast-m2" and profile["unprofiled_median_step_ms"] > 0
    entry_file = tmp_path / "devlog" / f"{series}.md"
    entry = entry_file.read_text()
    assert entry.startswith("# 2026-01-01 the GPU suite on cpu-dry-run")
    assert "| single-ft-s64-full-fast-m2 | 64 | 2 | 1 |" in entry  # the table region was filled
    # The peak predicted for each run's summary.json now, beside the one the suite wrote before launching it.
    assert "peak_mem,predicted_now,predicted_peak" in entry
    assert "| single-ft-s64-full-fast-m2 | 6 |" in entry  # and the parity region
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
    # Its own sections (a later machine's) too, up to the first the suite writes.
    handwritten = "## What it says\n\nWritten by hand.\n\n## A second machine\n\nAlso by hand.\n"
    entry_file.write_text(entry.replace("\n## Probe", f"\n{handwritten}\n## Probe", 1))
    assert gpu_suite.main(["--dry-run", "--root", str(tmp_path), "--date", "2026-01-01", "--only", "peer-*"]) == 0
    merged = entry_file.read_text()
    assert handwritten in merged and "| single-ft-s64-full-reference | 64 |" in merged
    assert merged.count("## A second machine") == 1 and merged.count("## Probe") == 1
    with tarfile.open(archive) as tar:
        assert tar.extractfile(f"devlog/{series}.md").read().decode() == merged


def test_a_dry_run_writes_nowhere_in_the_repository_unless_asked(monkeypatch, capsys):
    before = set((REPO_ROOT / "devlog").rglob("*"))
    monkeypatch.setattr(gpu_suite, "rungs", lambda plan: [])
    assert gpu_suite.main(["--dry-run", "--date", "2026-01-02"]) == 0
    out = capsys.readouterr().out
    assert set((REPO_ROOT / "devlog").rglob("*")) == before
    first = out.splitlines()[0]
    assert str(REPO_ROOT) not in first and "gpu-suite-dry-run-" in first
    scratch_root = Path(first.split("runs in ")[1].split("/runs/gpu-suite/")[0])
    assert (scratch_root / "devlog" / "2026-01-02-gpu-suite-cpu-dry-run.md").exists()
    shutil.rmtree(scratch_root)


def test_wheels_are_the_pinned_versions_of_what_the_machine_lacks(capsys):
    assert gpu_suite.main(["--wheels"]) == 0
    out = capsys.readouterr().out
    lock = (REPO_ROOT / "uv.lock").read_text()
    for name in (*gpu_suite.PEER_WHEELS, *gpu_suite.QLORA_WHEELS):
        version = lock.split(f'name = "{name}"\nversion = "', 1)[1].split('"', 1)[0]
        assert f"{name}=={version}" in out
    assert "cut-cross-entropy==" in out and "liger-kernel==" in out
    assert "pip install -q --no-index --no-deps" in out


def test_without_a_gpu_the_suite_says_so(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no GPU visible"):
        gpu_suite.main(["--budget-min", "1"])
