"""The command line a user meets, run as a user runs it: each mistake is one line and an exit status, --help lists
every flag's meaning and default without loading torch, torchrun's output ends with the reason, offline hub ids fail
fast with the fix, adapters load from anywhere, resume is forgiving and safe, --epochs, quiet explained output, and a
train.py copied out of the repository runs from an empty folder.

Commands run as subprocesses where the process is the point (the exit status and stderr are what a user sees):
the ones that only parse flags do not import torch and take a fraction of a second; the four that import torch
(torchrun twice, the Hub unreachable, a copied script) start together, a thread each, so their imports overlap. The
other rows call main(argv) in this process: its SystemExit carries the line the script prints (common.cli.run).
The file costs about 140 s of CPU on a 2-core machine (subprocesses included).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common.cli import build_parser, config_flags, parse_flags, plan_run
from conftest import REPO_ROOT, load_experiment, load_infer

EXPERIMENTS = sorted(path.parent.name for path in REPO_ROOT.glob("experiments/*/train.py"))
SINGLE = REPO_ROOT / "experiments" / "single-ft" / "train.py"
HELP_HINT = "(single-ft/train.py --help lists every flag)"
# The Hub as this test machine sees it: nothing listens on port 9 (connection refused at once), and an empty cache.
OFFLINE = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "", "HF_DATASETS_OFFLINE": ""}


def command(*args, cwd: Path = REPO_ROOT, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------------------------
# Flag mistakes: one line, exit status 2, before torch loads


FLAG_MISTAKES = {
    "a typo": (["--stpes", 3], f"--stpes: no such flag; did you mean --steps? {HELP_HINT}"),
    "a negative LoRA rank": (["--lora-rank", -1], "--lora-rank -1: must be >= 0"),
    "a negative sequence length": (["--seq-len", -5], "--seq-len -5: must be >= 1"),
    "a zero sequence length": (["--seq_len", 0], "--seq-len 0: must be >= 1"),
    "not a number": (["--seq-len", "abc"], f"--seq-len: expected an integer, got 'abc' {HELP_HINT}"),
    "an unknown choice": (["--attn", "fast"], f"--attn: 'fast' is not one of auto, sdpa, eager, flash, varlen, flex {HELP_HINT}"),
    "a missing value": (["--warmup-steps"], f"--warmup-steps: needs a value {HELP_HINT}"),
    "a stray value": (["--steps", 3, "4"], "unexpected argument '4': every value follows its flag, e.g. --steps 3 "
                                           f"{HELP_HINT}"),
    "steps and epochs": (["--steps", 3, "--epochs", 2], "--steps and --epochs both given: the run's length is one or "
                                                        "the other"),
    "merge without LoRA": (["--merge-lora", "--save-hf", "out"], "--merge-lora merges LoRA adapters into the model: "
                                                                 "it needs --lora-rank N"),
    "fused without LoRA": (["--lora-fused"], "--lora-fused computes LoRA adapters in fewer kernels: it needs "
                                             "--lora-rank N (or --qlora)"),
    "a share of one": (["--eval-fraction", 1], "--eval-fraction 1.0: must be in [0, 1) (a share of the conversations)"),
    "override without resume": (["--resume-anyway"], "--resume-anyway only changes what --resume accepts: add "
                                                     "--resume RUN_DIR"),
    "an alpha without a rank": (["--lora-alpha", 32], "--lora-alpha 32 scales LoRA adapters: it needs --lora-rank N "
                                                       "(without it every parameter trains)"),
    "keep a negative number": (["--keep-checkpoints", -1], "--keep-checkpoints -1: must be >= 0"),
}


@pytest.mark.parametrize("case", sorted(FLAG_MISTAKES))
def test_a_flag_mistake_is_one_line_before_torch_loads(case):
    args, expected = FLAG_MISTAKES[case]
    result = command("-X", "importtime", SINGLE, *args)
    lines = [line for line in stderr_lines(result) if not line.startswith("import time:")]
    assert (result.returncode, lines, result.stdout) == (2, [expected], "")
    imported = {line.rsplit("|", 1)[-1].strip() for line in stderr_lines(result) if line.startswith("import time:")}
    assert "torch" not in imported and "transformers" not in imported


def test_help_lists_every_flag_with_its_meaning_and_default_without_torch():
    result = command("-X", "importtime", SINGLE, "--help")
    assert result.returncode == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    assert "torch" not in imported and "transformers" not in imported
    text = " ".join(result.stdout.split())
    assert text.startswith("usage: single-ft/train.py [--flag VALUE ...] single-ft: fine-tune a Qwen3 decoder")
    assert "--steps INT optimizer steps (0 = only evaluate / export);" in text and "(default: 300)" in text
    assert "--packing [BOOL] pack conversations into rows" in text and "--no-packing turn --packing off" in text
    assert "--dtype {bf16,fp32} bf16: bf16 compute, fp32 master weights" in text


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_flag_of_every_experiment_has_a_meaning_and_a_shown_default(experiment):
    path = REPO_ROOT / "experiments" / experiment / "train.py"
    _, flags = config_flags(path)
    parser, _ = build_parser(path)
    text = "".join(parser.format_help().split())  # argparse wraps lines (at hyphens too): compare without spaces
    metavars = {}
    for action in parser._actions:  # a bool that defaults to on also has --no-<flag>, under the same dest
        metavars.setdefault(action.dest, action.metavar)
    for flag in flags:
        assert flag.comment, f"{experiment}: {flag.name} has no comment"
        metavar = f"[{metavars[flag.name]}]" if flag.base_type == "bool" else metavars[flag.name]
        shown = flag.option + metavar + "".join(flag.comment.split())[:40]
        assert shown in text, f"{experiment}: {flag.option} {flag.comment[:40]!r} not in its --help"
        if flag.default is not None and not isinstance(flag.default, bool):
            assert f"(default:{flag.default})" in text
    assert parse_flags(path, ["--seq_len", "64", "--no-packing", "--compile", "--activation-checkpointing=false"]) \
        == {"seq_len": 64, "packing": False, "compile": True, "activation_checkpointing": False}


def test_every_experiment_waits_on_a_collective_as_long_as_common_dist_says():
    """The flags are read from each Config's source as literals, so --collective-timeout-s's default is written in
    every script: it is common.dist's, the value init_distributed uses when called without one."""
    from common.dist import DEFAULT_COLLECTIVE_TIMEOUT_S

    for experiment in EXPERIMENTS:
        flags = {flag.name: flag for flag in config_flags(REPO_ROOT / "experiments" / experiment / "train.py")[1]}
        assert flags["collective_timeout_s"].default == DEFAULT_COLLECTIVE_TIMEOUT_S, experiment


def test_plan_run_turns_epochs_into_steps_and_says_when_data_repeats_or_warm_up_outlasts_the_run():
    class Config:
        model, seq_len, packing, seed, lora_rank, resume = "qwen3-tiny", 128, True, 0, 0, None
        steps, epochs, warmup_steps = 300, None, 10

    stats = dict(n_conversations=200, n_train_rows=87, train_tokens=10_330, train_loss_tokens=3_478)
    printed = []
    plan = plan_run("single-ft", Config, stats, 4, print_fn=printed.append)
    assert plan.steps == 300 and plan.steps_per_epoch == 87 / 4
    assert printed == ["note: 300 steps of 4 rows go over the 87 training rows 13.8 times (epochs); --epochs N sets "
                       "the length in passes over the data"]
    Config.epochs, Config.warmup_steps, printed[:] = 0.5, 20, []
    plan = plan_run("single-ft", Config, stats, 4, print_fn=printed.append)
    assert plan.steps == Config.steps == 11  # ceil(0.5 x 87 / 4)
    assert printed == ["--epochs 0.5: 0.5 x 87 training rows / 4 rows per step -> 11 steps",
                       "note: --warmup-steps 20 is longer than the run (11 steps): the learning rate climbs to 55% "
                       "of --lr and never decays"]


# ---------------------------------------------------------------------------------------------------------------
# Commands that load torch, started together (each subprocess costs its imports: only those whose point is the
# process itself run as one: torchrun's output, the Hub unreachable, a copy of a script outside the repository)


# What the README's "Start your own project from a script" says a copy of one script can leave out of common/.
NOT_RUNTIME = ("memory", "comm.py", "sweep.py", "soak.py", "preflight.py", "loss_reference.py")


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    elsewhere = root / "my-project"
    elsewhere.mkdir()
    shutil.copy(REPO_ROOT / "experiments" / "fsdp-ft" / "train.py", elsewhere / "train.py")
    # An installed copy of the package, as pyproject.toml's wheel builds it (common/ and the files force-included),
    # less what the README's copy-out leaves behind: the predictions and the commands no train.py imports.
    site = root / "site"
    shutil.copytree(REPO_ROOT / "common", site / "common",
                    ignore=shutil.ignore_patterns("__pycache__", *NOT_RUNTIME))
    wheel = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    for source, target in wheel["force-include"].items():
        copy = shutil.copytree if (REPO_ROOT / source).is_dir() else shutil.copy
        (site / target).parent.mkdir(parents=True, exist_ok=True)
        copy(REPO_ROOT / source, site / target)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    bad_data = root / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    bad = {"messages": [{"role": "usr", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    bad_data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    commands = {
        "offline hub id": dict(args=[SINGLE, "--model", "Qwen/Qwen3-0.6B-Base"],
                               env={**OFFLINE, "HF_HOME": str(root / "hf-home")}),
        "torchrun flag": dict(args=[*torchrun, SINGLE, "--stpes", 3]),
        "torchrun stop": dict(args=[*torchrun, SINGLE, "--model", "/no/such/dir"]),
        "torchrun bad data": dict(args=[*torchrun, REPO_ROOT / "experiments" / "ddp-ft" / "train.py",
                                        "--data", bad_data, "--out-dir", root / "bad-data-run"]),
        "copied script": dict(args=["train.py", "--steps", 2, "--seq-len", 64, "--micro-batch-size", 2,
                                    "--eval-fraction", 0.01, "--log-every", 5],
                              cwd=elsewhere, env={"PYTHONPATH": str(site)}),
    }
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        futures = {name: pool.submit(command, *c["args"], cwd=c.get("cwd", root), env=c.get("env"))
                   for name, c in commands.items()}
        results = {name: future.result() for name, future in futures.items()}
    return dict(root=root, results=results, elsewhere=elsewhere, site=site)


def test_an_offline_hub_id_fails_in_seconds_with_the_fix(launched):
    result = launched["results"]["offline hub id"]
    assert result.returncode == 1 and "Retrying" not in result.stderr
    line = stderr_lines(result)[-1]
    assert line.startswith("Qwen/Qwen3-0.6B-Base: the Hugging Face Hub cannot be reached from here and this model is "
                           "not in this machine's cache: on a machine that is online run `hf download "
                           "Qwen/Qwen3-0.6B-Base`, copy ~/.cache/huggingface here and set HF_HUB_OFFLINE=1; or pass a "
                           "local folder")
    assert result.stderr.count("hf download") == 1


def test_under_torchrun_the_reason_is_said_once_and_ends_the_output(launched):
    flag = launched["results"]["torchrun flag"]
    expected = f"--stpes: no such flag; did you mean --steps? {HELP_HINT}"
    assert flag.returncode != 0
    # Rank 0 prints it; rank 1 leaves quietly (no second failure in the summary); the summary's record carries it.
    assert [line for line in flag.stderr.splitlines() if line == expected] == [expected]
    assert "<NO_OTHER_FAILURES>" in flag.stderr
    assert stderr_lines(flag)[-2].strip() == f"traceback : {expected}"
    stop = launched["results"]["torchrun stop"]
    expected = ("--model /no/such/dir: no such folder (--model takes a preset, a hub id such as Qwen/Qwen3-0.6B-Base, "
                "or a folder written by save_pretrained)")
    assert stop.returncode != 0
    assert [line for line in stop.stderr.splitlines() if line == expected] == [expected]  # rank 0 only
    assert stderr_lines(stop)[-2].strip() == f"traceback : {expected}"
    assert "<NO_OTHER_FAILURES>" in stop.stderr  # a flag mistake: rank 1 left quietly
    assert "To enable traceback" not in stop.stderr


def test_under_torchrun_bad_training_data_is_reported_once_by_rank_0(launched):
    """Both ranks of ddp-ft read the same file and refuse it at the same line; rank 0 alone says so, exit status 2
    (an input refusal, as a flag mistake), and the launcher's summary lists one failure, not one per rank."""
    result = launched["results"]["torchrun bad data"]
    bad_data = launched["root"] / "bad.jsonl"
    expected = (f"bad training data: {bad_data}:2: message 0: unknown role 'usr' (expected one of system, user, "
                f"assistant)")
    assert result.returncode != 0
    assert [line for line in result.stderr.splitlines() if line == expected] == [expected]  # rank 0's line
    summary = result.stderr.split("Failures:", 1)[1]
    assert summary.count(expected) == 1 and "<NO_OTHER_FAILURES>" in summary
    assert re.search(r"rank\s*: 0 \(local_rank: 0\)\s+exitcode\s*: 2 ", summary)
    assert stderr_lines(result)[-2].strip() == f"traceback : {expected}"
    assert not (launched["root"] / "bad-data-run").exists()  # refused before anything was written


def test_a_copied_script_runs_from_an_empty_folder_with_an_installed_common(launched):
    result = launched["results"]["copied script"]
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((launched["elsewhere"] / "runs").glob("fsdp-ft-*/summary.json"))
    assert len(runs) == 1  # under the working directory, not the filesystem root
    summary = json.loads(runs[0].read_text())
    # The default data and the presets' tokenizer came from the installed package, not from a repository.
    assert summary["config"]["data"] == str(launched["site"] / "common" / "assets" / "data" / "sft_en.jsonl")
    assert summary["commit"] is None and summary["commit_diff"] is None and summary["n_conversations"] == 4000
    # Quiet output: no progress bars; the first step line explains its dashes; the end says where the files went.
    assert "Loading weights" not in result.stderr and "Writing model shards" not in result.stderr
    lines = result.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("step 1/2 | epoch 0.00"))
    assert lines[first + 1].startswith("  (mem: peak RSS of the process (CPU); comm_ms -: not measured on this step")
    assert any(line.startswith(f"results: runs/{runs[0].parent.name}/metrics.jsonl") for line in lines)


# ---------------------------------------------------------------------------------------------------------------
# The other rows, in this process: main(argv) raises the SystemExit whose message the script prints as its one line
# (run() in common/cli.py, exercised by the subprocesses above)


# What a train.py reaches of common/ is what a reader of it may have to open, and what a copy of it needs: the runtime
# stays thin. The predictions and the commands (NOT_RUNTIME) read runs afterwards and are reached by no train.py.
RUNTIME_LINES_CEILING = 4_000


def common_modules_reached(script: Path) -> set[Path]:
    """The files of common/ that `script` imports, directly or through them, at module level or inside a function
    (`import common.x`, `from common.x import y`, `from common import x`, and a package's __init__.py)."""
    def module_files(name: str) -> list[Path]:
        parts = name.split(".")
        found = []
        for depth in range(1, len(parts) + 1):
            base = REPO_ROOT.joinpath(*parts[:depth])
            found += [path for path in (base.with_suffix(".py"), base / "__init__.py") if path.is_file()]
        return found

    reached, todo = set(), [script]
    while todo:
        for node in ast.walk(ast.parse(todo.pop().read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            for name in names:
                if name == "common" or name.startswith("common."):
                    new = [path for path in module_files(name) if path not in reached]
                    reached.update(new)
                    todo += new
    return reached


def test_common_modules_reached_follow_every_import_form(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import common.generate\n\ndef f():\n    from common import ep\n")
    reached = {path.relative_to(REPO_ROOT).as_posix() for path in common_modules_reached(script)}
    # ep.py only through the import inside f(), dist.py through ep.py, cli.py through dist.py
    assert {"common/__init__.py", "common/generate.py", "common/ep.py", "common/dist.py", "common/cli.py"} <= reached
    assert not any(path.startswith("common/memory/") for path in reached)
    script.write_text("import common.generate\n")
    assert "common/ep.py" not in {path.relative_to(REPO_ROOT).as_posix() for path in common_modules_reached(script)}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_a_script_reaches_only_the_runtime_of_common(experiment):
    reached = common_modules_reached(REPO_ROOT / "experiments" / experiment / "train.py")
    names = {path.relative_to(REPO_ROOT / "common").parts[0] for path in reached}
    assert not names & set(NOT_RUNTIME), f"{experiment} reaches {sorted(names & set(NOT_RUNTIME))}"
    lines = sum(len(path.read_text().splitlines()) for path in reached)
    assert lines <= RUNTIME_LINES_CEILING, f"{experiment} reaches {lines:,} lines of common/: {sorted(names)}"


def stop_message(main, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        main([str(arg) for arg in argv])
    assert isinstance(stop.value.code, str) and "\n" not in stop.value.code
    return stop.value.code


def test_a_missing_model_folder_and_a_preset_in_capitals_stop_before_loading(tmp_path):
    single_ft = load_experiment("single-ft")
    assert stop_message(single_ft.main, ["--model", "/no/such/dir"]) == (
        "--model /no/such/dir: no such folder (--model takes a preset, a hub id such as Qwen/Qwen3-0.6B-Base, or a "
        "folder written by save_pretrained)")
    assert stop_message(single_ft.main, ["--model", "Qwen3-0.6B"]).startswith(
        "--model Qwen3-0.6B: presets are written in lower case: --model qwen3-0.6b (random init)")
    assert stop_message(single_ft.main, ["--model", "qwen3-tinyy"]) == \
        "--model qwen3-tinyy: no such preset; did you mean qwen3-tiny?"


def test_the_memory_cli_prices_a_qwen3_hub_id_with_its_preset_without_a_download(capsys, monkeypatch):
    from common import memory, models

    monkeypatch.setattr(models, "hub_options", lambda name: pytest.fail(f"{name} looked up on the Hub"))
    for name in ("Qwen/Qwen3-4B-Base", "Qwen3-4B"):
        memory.main(["--model", name, "--gpus", "2"])
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith(f"note: {name} is priced with the qwen3-4b preset: the published geometry")
        assert lines[1].startswith("model qwen3-4b: 4,022,468,096 parameters")


def test_preset_for_maps_hub_ids_and_letter_case_and_leaves_the_rest():
    from common.memory.cli import preset_for

    for name in ("Qwen/Qwen3-4B-Base", "Qwen/Qwen3-4B", "qwen/qwen3-4b-base", "Qwen3-4B", "QWEN3-4B"):
        assert preset_for(name)[0] == "qwen3-4b", name
    assert preset_for("Qwen/Qwen3-30B-A3B-Base")[0] == "qwen3-30b-a3b"
    assert preset_for("qwen3-4b") == ("qwen3-4b", None)
    assert preset_for("Qwen/Qwen3-8B")[0] == "qwen3-8b"
    assert preset_for("Qwen/Qwen2.5-7B") == ("Qwen/Qwen2.5-7B", None)  # no preset: read from the hub as before


def bad_json_line() -> str:
    """A record with a stray character at column 84, after the first message's closing quote."""
    head = '{"messages": [{"role": "user", "content": "'
    content = "Name three colours of the rainbow, please."[:83 - len(head) - 1]
    return head + content + '"x}, {"role": "assistant", "content": "red, orange, yellow"}]}'


def test_bad_data_files_name_what_is_wrong(tmp_path, small_data):
    single_ft = load_experiment("single-ft")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "bad.jsonl").write_text(small_data.read_text().splitlines()[0] + "\n" + bad_json_line() + "\n")
    (tmp_path / "bad.json").write_text(small_data.read_text().splitlines()[0] + "\n" + bad_json_line() + "\n")
    assert stop_message(single_ft.main, ["--data", tmp_path / "empty.csv"]) == \
        f"bad training data: {tmp_path / 'empty.csv'}: empty file, no records"
    for name in ("bad.jsonl", "bad.json"):  # read here, and read by datasets (then parsed again for the position)
        assert stop_message(single_ft.main, ["--data", tmp_path / name]) == \
            f"bad training data: {tmp_path / name}:2: invalid JSON at column 84: Expecting ',' delimiter"
    (tmp_path / "cut.jsonl").write_text(bad_json_line()[:60] + "\n")  # cut inside the first message's content
    opened = bad_json_line().index("Name")  # the 1-based column of its opening quote
    assert stop_message(single_ft.main, ["--data", tmp_path / "cut.jsonl"]) == (
        f"bad training data: {tmp_path / 'cut.jsonl'}:1: invalid JSON: the string opened at column {opened} is still "
        f"open at the end of the line (column 60): is the line cut short?")


def test_show_sample_with_no_steps_prints_the_sample_and_stops(tmp_path, small_data, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert load_experiment("single-ft").main(["--data", str(small_data), "--show-sample", "--steps", "0"]) == {}
    out = capsys.readouterr().out
    assert re.search(r"^sample \(step 1, row \d+\): \d+ tokens, \d+ carry loss", out, re.M)
    assert "model: " not in out and "eval: " not in out
    assert list(tmp_path.iterdir()) == []  # no run folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, small_data):
    """A full export, a LoRA adapter trained on it through a relative path, and one trained on the preset."""
    root = tmp_path_factory.mktemp("adapters")
    single_ft = load_experiment("single-ft")
    run = ["--data", small_data, "--seq-len", 128, "--dtype", "fp32", "--steps", 2, "--warmup-steps", 1]
    single_ft.main([*map(str, run), "--out-dir", str(root / "run"), "--save-hf", str(root / "base")])
    (root / "work").mkdir()
    cwd = os.getcwd()
    os.chdir(root / "work")
    try:
        local = single_ft.main([*map(str, run), "--model", "../base", "--lora-rank", "4", "--out-dir", "lora",
                                "--save-hf", "lora-adapter"])
    finally:
        os.chdir(cwd)
    preset = single_ft.main([*map(str, run), "--seed", "3", "--lora-rank", "4", "--out-dir", str(root / "pl"),
                             "--save-hf", str(root / "preset-adapter")])
    return dict(root=root, local=local, preset=preset)


def test_an_adapter_of_a_local_model_loads_from_another_folder(adapters, small_data, monkeypatch, capfd):
    root = adapters["root"]
    config = json.loads((root / "work" / "lora-adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(root / "base")  # absolute, not "../base"
    monkeypatch.chdir(root)
    loss = load_infer().main(["--model", "work/lora-adapter", "--eval-data", str(small_data), "--seq-len", "128"])
    assert loss == pytest.approx(adapters["local"]["eval_loss"], rel=1e-5)
    assert "Loading weights" not in capfd.readouterr().err  # no progress bars


def test_an_adapter_of_a_preset_rebuilds_the_preset_from_its_seed(adapters, small_data, capsys):
    adapter = adapters["root"] / "preset-adapter"
    assert json.loads((adapter / "preset_base.json").read_text()) == {"preset": "qwen3-tiny", "seed": 3}
    loss = load_infer().main(["--model", str(adapter), "--eval-data", str(small_data), "--seq-len", "128",
                              "--seed", "3"])
    assert loss == pytest.approx(adapters["preset"]["eval_loss"], rel=1e-5)
    assert "base: the qwen3-tiny preset rebuilt from seed 3 (random init, as training built it)" in \
        capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# Resume, epochs and the step lines, in this process


@pytest.fixture(scope="module")
def single_ft():
    return load_experiment("single-ft")


def run_args(data, out, *args):
    return ["--data", str(data), "--seq-len", "128", "--dtype", "fp32", "--warmup-steps", "2", "--out-dir", str(out),
            *map(str, args)]


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_takes_a_run_folder_or_latest_and_refuses_another_run(single_ft, small_data, tmp_path, monkeypatch,
                                                                      capsys, recwarn):
    monkeypatch.chdir(tmp_path)
    single_ft.main(["--data", str(small_data), "--seq-len", "128", "--dtype", "fp32", "--warmup-steps", "2",
                    "--steps", "4", "--checkpoint-every", "2"])  # into ./runs/single-ft-<time>
    (run,) = Path("runs").glob("single-ft-*")
    whole = losses(run)
    (run / "checkpoints" / "step-4").rename(run / "checkpoints" / "step-4.tmp")  # a save that was interrupted
    single_ft.main(run_args(small_data, tmp_path / "folder", "--steps", 4, "--resume", run))
    single_ft.main(run_args(small_data, tmp_path / "latest", "--steps", 4, "--resume", "latest"))
    assert losses(tmp_path / "folder") == losses(tmp_path / "latest") == pytest.approx(whole[2:], rel=1e-6)
    out = capsys.readouterr().out
    assert "checkpoints: runs/" in out and "is the newest (continue: --resume runs/" in out
    assert not [w for w in recwarn.list if "torch.distributed" in str(w.message)]  # DCP's single-process warning
    message = stop_message(single_ft.main, run_args(small_data, tmp_path / "other", "--steps", 4, "--seq-len", 64,
                                                     "--seed", 1, "--resume", run))
    assert re.fullmatch(rf"--resume {run / 'checkpoints' / 'step-2'}: the checkpoint is of another run: --data "
                        r"\(n_train_rows \d+ -> \d+, train_tokens \d+ -> \d+, train_loss_tokens \d+ -> \d+\); "
                        r"--seq-len 128 -> 64; --seed 0 -> 1\. Its steps would not continue this run's; "
                        r"--resume-anyway resumes from it all the same", message)
    assert not (tmp_path / "other").exists()  # stopped before the model: no run folder
    single_ft.main(run_args(small_data, tmp_path / "anyway", "--steps", 4, "--seed", 1, "--resume", run,
                            "--resume-anyway"))
    assert len(losses(tmp_path / "anyway")) == 2
    assert re.search(r"^--resume-anyway: resuming from a checkpoint of another run \(--data \(.*\); --seed 0 -> 1\)$",
                     capsys.readouterr().out, re.M)
    with pytest.raises(SystemExit, match=r"--resume latest: no run under .* has a complete checkpoint"):
        monkeypatch.chdir(tmp_path / "folder")
        single_ft.main(run_args(small_data, tmp_path / "none", "--resume", "latest"))


def test_epochs_set_the_steps_and_the_lines_say_the_epoch(single_ft, small_data, tmp_path, capsys):
    summary = single_ft.main(run_args(small_data, tmp_path / "epochs", "--epochs", 0.15, "--micro-batch-size", 4,
                                      "--grad-accum", 2, "--log-every", 3))
    rows = summary["data"]["n_train_rows"]
    steps = math.ceil(0.15 * (rows / 8))
    assert steps >= 4  # so that --log-every 3 leaves a line out
    assert summary["config"]["steps"] == steps and len(losses(tmp_path / "epochs")) == steps
    assert summary["epochs"] == pytest.approx(steps * 8 / rows)
    out = capsys.readouterr().out
    assert f"--epochs 0.15: 0.15 x {rows:,} training rows / 8 rows per step -> {steps} steps" in out
    printed = [int(m.group(1)) for m in re.finditer(r"^step (\d+)/\d+ \| epoch \d\.\d\d \|", out, re.M)]
    assert printed == sorted({1, *range(3, steps + 1, 3), steps})
    assert "a line every 3 steps (--log-every); metrics.jsonl has every step" in out


def test_a_field_comment_continues_on_deeper_indented_comment_lines(tmp_path):
    """Config comments wrap to stay within 120 characters: comment-only lines indented deeper than the field continue
    its help text; one at the field's own indent heads the fields after it and belongs to none."""
    from common.cli import config_flags

    script = tmp_path / "train.py"
    script.write_text('"""doc"""\n\n\nclass Config:\n'
                      '    steps: int = 3  # optimizer steps,\n'
                      '        # counted from 1\n'
                      '    # Pipeline\n'
                      '    stages: int = 2  # pipeline stages\n')
    _, flags = config_flags(script)
    assert [(flag.name, flag.comment) for flag in flags] == [
        ("steps", "optimizer steps, counted from 1"), ("stages", "pipeline stages")]
