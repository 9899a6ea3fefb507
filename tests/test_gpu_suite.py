"""assets/gpu_suite.py: its dry run goes through its stages on the CPU, and its GPU plan's commands parse."""

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
    assert {rung.experiment for rung in plan} == {"single-ft", "fsdp-ft", "peer"}
    for rung in plan:
        if rung.experiment != "peer" and not rung.profile:  # the profile rung takes its args when it runs
            parse_experiment(rung.experiment, [*rung.args, "--out-dir", "runs/x"])
    # Each ladder starts with its baseline and adds one feature per rung (the suite compares rungs with it).
    for ladder in {rung.ladder for rung in plan} - {"fsdp", "syncs", "peer"}:
        members = [rung for rung in plan if rung.ladder == ladder and not rung.profile]
        assert [rung.name.split("-", 4)[-1] for rung in members[:4]] == \
            ["1-baseline", "2-varlen", "3-chunked-loss", "4-compile"]
        assert members[0].args[-2:] == ("--attn", "sdpa") and members[1].args[-2:] == ("--attn", "varlen")
        for before, after in zip(members, members[1:4]):
            assert after.args[:len(before.args) - 2] == before.args[:-2]  # one feature added, nothing else changed
    assert all(rung.name.startswith(rung.experiment) for rung in plan
               if rung.ladder not in ("syncs", "peer") and not rung.profile)  # the posts' GPU slots glob on it
    # The host-sync count, the profile and the TRL comparison come right after the first ladder.
    first_ladder = gpu_suite.GPU_PLAN.ladders[0][0]
    after = [rung.name for rung in plan][len([r for r in plan if r.ladder == first_ladder and not r.profile]):][:3]
    assert after == [f"syncs-{first_ladder}", f"profile-{first_ladder}", f"peer-{first_ladder}"]
    # They run by priority: the first ladder whole, then the profile, TRL and FSDP, then the other ladders' ends
    # (baseline and last rung) before anything between them, the host-sync count last.
    order = [rung.name for rung in sorted(plan, key=lambda r: r.priority)]
    whole = [rung.name for rung in plan if rung.ladder == first_ladder and not rung.profile]
    assert order[:len(whole) + 3] == [*whole, f"profile-{first_ladder}", f"peer-{first_ladder}",
                                      "fsdp-ft-s1024-full-1rank"]
    ends = [[r.name for r in plan if r.ladder == label][i] for label, *_ in gpu_suite.GPU_PLAN.ladders[1:] for i in (0, -1)]
    assert sorted(order[len(whole) + 3:][:len(ends)]) == sorted(ends) and order[-1] == f"syncs-{first_ladder}"


@pytest.mark.slow
def test_dry_run_keeps_each_run_and_writes_the_entry_with_parity(tmp_path, capsys, monkeypatch):
    # CI's environment has no trl (the "peer" dependency group): the TRL comparison is skipped, and says how to fix it.
    monkeypatch.setattr(gpu_suite, "peer_installed", lambda: False)
    assert gpu_suite.main(["--dry-run", "--root", str(tmp_path), "--date", "2026-01-01"]) == 0
    out = capsys.readouterr().out
    series = "2026-01-01-gpu-suite-cpu-dry-run"
    data = tmp_path / "devlog" / "data" / series
    kept = sorted(path.name for path in data.iterdir())
    # No compile rung (the dry run leaves torch.compile to test_loss), no host-sync count nor fsdp-ft rung (DRY_PLAN).
    runs = ["single-ft-s64-full-1-baseline", "single-ft-s64-full-2-varlen", "single-ft-s64-full-3-chunked-loss"]
    assert kept == sorted([*runs, "kernel-check.json", "profile.json"])
    for name in runs:
        summary = json.loads((data / name / "summary.json").read_text())
        assert summary["config"]["steps"] == 4
    # varlen and the chunked loss do the baseline's steps: compared, and equal in fp32.
    assert out.count("losses vs baseline") == 2 and "MISMATCH" not in out
    # Stage 1 checked the CPU's kernels (FlexAttention forward only: it has no CPU backward).
    kernels = {row["kernel"]: row for row in json.loads((data / "kernel-check.json").read_text())}
    assert set(kernels) == {"masked SDPA", "flex", "reference"} and all(row["ok"] for row in kernels.values())
    assert kernels["reference"]["backward"] and not kernels["flex"]["backward"]
    profile = json.loads((data / "profile.json").read_text())
    assert profile["steps"] == 3 and profile["categories_ms"]["matmul"] > 0
    entry = (tmp_path / "devlog" / f"{series}.md").read_text()
    assert entry.startswith("# 2026-01-01 the GPU suite on cpu-dry-run")
    assert "| single-ft-s64-full-3-chunked-loss | 64 | 1 |" in entry  # the table region was filled
    assert "| single-ft-s64-full-3-chunked-loss | 4 |" in entry  # and the parity region
    assert "`peer-s64-full` (skipped: trl or datasets not installed (python3 assets/gpu_suite.py --wheels))" in entry
    assert "- reference, float32, with backward:" in entry and "Top kernels:" in entry


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


def test_wheels_are_the_locked_versions_of_what_the_machine_lacks(capsys):
    assert gpu_suite.main(["--wheels"]) == 0
    out = capsys.readouterr().out
    lock = (REPO_ROOT / "uv.lock").read_text()
    for name in gpu_suite.PEER_WHEELS:
        version = lock.split(f'name = "{name}"\nversion = "', 1)[1].split('"', 1)[0]
        assert f"{name}=={version}" in out
    assert "pip install -q --no-index --no-deps" in out


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
