"""Nothing lost, nothing silent: a damaged checkpoint is skipped for the newest sound one (an explicit one is refused in
one line naming the file), --keep-checkpoints bounds the disk, a resume continues its run in place and a finished run
is left as it is, the trainer state is read without unpickling objects, and inputs that would kill a run are refused.

One single-ft run of 6 steps, a checkpoint after each (--keep-checkpoints 3), serves every test; each test damages
its own copy.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import torch

from common.checkpoint import checkpoint_problem, find_checkpoint, prune_checkpoints
from common.cli import run as run_main
from common.memory.cli import ask
from conftest import REPO_ROOT, load_experiment

single_ft = load_experiment("single-ft")
STEPS = 6
README = REPO_ROOT / "README.md"


def train_args(data, *args) -> list[str]:
    return ["--data", str(data), "--seq-len", "128", "--dtype", "fp32", "--warmup-steps", "2", "--steps", str(STEPS),
            *map(str, args)]


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, small_data):
    run_dir = tmp_path_factory.mktemp("base") / "single-ft-base"
    single_ft.main(train_args(small_data, "--checkpoint-every", 1, "--keep-checkpoints", 3, "--out-dir", run_dir,
                              "--report-to", "tensorboard", "--save-hf", run_dir / "hf"))
    return run_dir


def copy_of(base_run, tmp_path, name="single-ft-copy"):
    copy = tmp_path / "runs" / name
    shutil.copytree(base_run, copy)
    return copy


def test_keep_checkpoints_keeps_the_newest_and_nothing_else(base_run, tmp_path):
    assert sorted(p.name for p in (base_run / "checkpoints").iterdir()) == ["step-4", "step-5", "step-6"]
    copy = copy_of(base_run, tmp_path)
    assert prune_checkpoints(copy, 0) == []  # 0 keeps all
    assert [p.name for p in prune_checkpoints(copy, 1)] == ["step-5", "step-4"]
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step-6"]


def truncate(file):
    file.write_bytes(file.read_bytes()[:1000])


DAMAGES = {  # what is done to step-6, and the file the one line names
    "a truncated shard": (lambda step: truncate(step / "__0_0.distcp"),
                          r"__0_0\.distcp is cut short: 1,000 bytes of the [\d,]+ written"),
    "a deleted .metadata": (lambda step: (step / ".metadata").unlink(), r"\.metadata is missing"),
    "an empty run.json": (lambda step: (step / "run.json").write_text(""),
                          r"run\.json is not readable JSON \(0 bytes\)"),
    "a missing trainer state": (lambda step: (step / "trainer_state_rank0.pt").unlink(),
                                r"trainer_state_rank0\.pt is missing"),
    "a truncated trainer state": (lambda step: truncate(step / "trainer_state_rank0.pt"),
                                  r"trainer_state_rank0\.pt is damaged \(not a whole torch\.save archive"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_skipped_for_the_newest_sound_one(damage, base_run, tmp_path, monkeypatch):
    copy = copy_of(base_run, tmp_path)
    damaged = copy / "checkpoints" / "step-6"
    do, named = DAMAGES[damage]
    do(damaged)
    said = []
    assert find_checkpoint(copy, "single-ft", print_fn=said.append) == copy / "checkpoints" / "step-5"
    (line,) = said
    assert line.startswith(f"--resume: skipping {damaged}: {damaged}/")
    assert re.search(named, line), line
    monkeypatch.chdir(tmp_path)  # latest: the newest sound checkpoint of ./runs/single-ft-*
    said.clear()
    assert find_checkpoint("latest", "single-ft", print_fn=said.append) == pathlib.Path("runs/single-ft-copy/"
                                                                                         "checkpoints/step-5")
    assert len(said) == 1 and said[0].startswith("--resume: skipping runs/single-ft-copy/checkpoints/step-6: ")
    with pytest.raises(SystemExit) as stop:  # named explicitly: one line naming the file
        find_checkpoint(damaged, "single-ft")
    assert str(stop.value.code).startswith(f"--resume {damaged}: {damaged}/") and "\n" not in str(stop.value.code)


def test_every_checkpoint_damaged_is_one_line(base_run, tmp_path):
    copy = copy_of(base_run, tmp_path)
    for step in (copy / "checkpoints").iterdir():
        (step / ".metadata").unlink()
    with pytest.raises(SystemExit, match=r"every checkpoint in it is damaged \(the newest: .*step-6/\.metadata is "
                                         r"missing\)$"):
        find_checkpoint(copy, "single-ft", print_fn=lambda line: None)


def test_the_trainer_state_holds_tensors_and_plain_types_and_nothing_else_is_unpickled(base_run, tmp_path):
    state = torch.load(base_run / "checkpoints" / "step-6" / "trainer_state_rank0.pt", weights_only=True)
    assert state["step"] == 6 and state["rng"]["python"].dtype == torch.int64 and state["rng"]["python"].numel() == 625
    copy = copy_of(base_run, tmp_path)
    step = copy / "checkpoints" / "step-6"
    # A file that needs the full unpickler (an arbitrary object) is refused, never executed.
    torch.save({**state, "note": pathlib.PurePosixPath("anything")}, step / "trainer_state_rank0.pt")
    with pytest.raises(SystemExit) as stop:
        find_checkpoint(step, "single-ft")
    message = str(stop.value.code)
    assert message.startswith(f"--resume {step}: {step}/trainer_state_rank0.pt: not readable as tensors and plain "
                              f"types (torch.load weights_only=True: ")
    assert message.endswith("refusing to unpickle it") and "\n" not in message
    assert checkpoint_problem(copy / "checkpoints" / "step-5") is None


@pytest.mark.slow  # two more training steps
def test_a_resume_continues_its_run_in_place_and_a_finished_run_is_left_alone(base_run, small_data, tmp_path,
                                                                            monkeypatch, capsys):
    # The process was killed after step 5: no summary, metrics.jsonl of 5 steps, step-6 never written, step-5 damaged
    # (a disk that filled up): the resume falls back to step-4 and runs steps 5 and 6 in the run's own folder.
    copy = copy_of(base_run, tmp_path)
    (copy / "summary.json").unlink()
    shutil.rmtree(copy / "checkpoints" / "step-6")
    truncate(copy / "checkpoints" / "step-5" / "__0_0.distcp")
    (copy / "metrics.jsonl").write_text("".join((copy / "metrics.jsonl").read_text().splitlines(keepends=True)[:5]))
    monkeypatch.chdir(tmp_path)
    summary = single_ft.main(train_args(small_data, "--checkpoint-every", 1, "--keep-checkpoints", 1,
                                        "--report-to", "tensorboard", "--resume", "runs/single-ft-copy"))
    out = capsys.readouterr().out
    assert "--resume: skipping runs/single-ft-copy/checkpoints/step-5: " in out
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["single-ft-copy"]  # no new run folder
    assert losses(copy) == pytest.approx(losses(base_run), rel=1e-5)  # steps 1-4 kept, 5 and 6 run again
    # TensorBoard goes on in the same folder: what the killed process logged after step 4 is purged, not doubled.
    scalars = tensorboard_scalars(copy / "tensorboard")["train/loss"]
    assert [step for step, _ in scalars] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in scalars] == pytest.approx(losses(base_run), rel=1e-5)
    written = json.loads((copy / "summary.json").read_text())
    assert written["final_loss"] == pytest.approx(losses(base_run)[-1], rel=1e-5)
    assert summary["warmup_steps_excluded"] == 4  # 2 in each process; steps 3 and 4 are measured
    assert summary["measured_steps"] == 2
    # --keep-checkpoints 1 deleted the damaged step-5 but kept step-4, which this run resumed from.
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step-4", "step-6"]

    before = (copy / "summary.json").read_bytes()
    with pytest.raises(SystemExit) as stop:
        single_ft.main(train_args(small_data, "--resume", "runs/single-ft-copy"))
    assert stop.value.code == 0
    assert (copy / "summary.json").read_bytes() == before
    assert ("--resume runs/single-ft-copy/checkpoints/step-6: the run is complete (6 steps, summary.json written); "
            "nothing to train, runs/single-ft-copy left as it is") in capsys.readouterr().out

    # Killed after its last checkpoint, before the summary: the resume trains nothing and writes the whole run's summary.
    (copy / "summary.json").unlink()
    summary = single_ft.main(train_args(small_data, "--resume", "runs/single-ft-copy"))
    assert "the checkpoint is of the run's last step: no step to train" in capsys.readouterr().out
    assert summary["final_loss"] == written["final_loss"] and losses(copy) == pytest.approx(losses(base_run), rel=1e-5)
    with pytest.raises(SystemExit, match=r"the checkpoint is past the run's end \(step 6 of --steps 5\)"):
        single_ft.main([*train_args(small_data, "--resume", "runs/single-ft-copy"), "--steps", "5"])


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder)).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_the_exported_weights_have_the_permissions_of_the_rest_of_the_export(base_run):
    modes = {file.name: file.stat().st_mode & 0o777 for file in (base_run / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {modes["config.json"]}, modes  # was 0600 vs 0644


def test_every_count_beside_the_averages_is_explained_in_the_readme(base_run):
    results = README.read_text().split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    summary = json.loads((base_run / "summary.json").read_text())
    counts = [key for key in summary if re.search(r"_steps?(_|$)|^predicted_|^profiled_", key)]
    assert {"measured_steps", "timed_steps", "warmup_steps_observed", "state_bytes_step"} <= set(counts)
    assert [key for key in counts if f"`{key}`" not in results] == []


def test_a_sequence_longer_than_the_model_positions_stops_before_training(small_data, tmp_path):
    with pytest.raises(SystemExit) as stop:
        single_ft.main(["--data", str(small_data), "--seq-len", "100000", "--out-dir", str(tmp_path / "long")])
    assert stop.value.code == ("--seq-len 100,000: longer than qwen3-tiny's 40,960 positions "
                               "(max_position_embeddings); use --seq-len 40,960 or less")
    assert not (tmp_path / "long").exists()


def test_out_of_memory_is_one_line_with_the_step_and_the_command_that_prices_the_run(capsys, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)

    def main():
        config = single_ft.Config(model="qwen3-4b", seq_len=4096, micro_batch_size=2, activation_checkpointing=True)
        for step in range(10):
            if step == 7:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return config

    with pytest.raises(SystemExit) as stop:
        run_main(main)
    assert stop.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    command = ("python -m common.memory --model qwen3-4b --seq-len 4096 --micro-batch-size 2 "
               "--activation-checkpointing --gpus 1")
    assert line.startswith("out of GPU memory at step 8") and f"`{command}" in line
    assert ask(command.split()[3:]).advice is not None  # the command it prints is one common.memory answers

