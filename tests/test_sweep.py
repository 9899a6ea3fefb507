"""common/sweep.py: grid expansion, the exact command of each cell, T_eff, resume, the table, scaling efficiency.

Every experiment's own Config parser reads the flags the sweep builds (no run); everything else uses fake
summary.json files, except one real single-ft run (2 steps, seq 64) that goes through the whole path: launch,
summary.json, table, and the skip on resume.
"""

import csv
import json
import sys

import pytest
from transformers import HfArgumentParser

from common import sweep
from common.sweep import Cell, Grid
from conftest import load_experiment


def cell(strategy="single-ft", nproc=1, micro=1, accum=4, checkpointing=False, dtype="fp32", **overrides):
    settings = dict(model="qwen3-tiny", seq_len=128, steps=4)
    settings.update(overrides)
    return Cell(strategy, nproc, micro, accum, checkpointing, dtype, **settings)


def fake_summary(c: Cell, tokens_per_s: float, final_loss: float = 2.5) -> dict:
    """The summary.json fields the sweep reads, as an experiment would write them for cell c."""
    return {
        "experiment": c.experiment, "command": f"fake {c.name}",
        "config": dict(model=c.model, seq_len=c.seq_len, steps=c.steps, micro_batch_size=c.micro_batch_size,
                       grad_accum=c.grad_accum, activation_checkpointing=c.activation_checkpointing, dtype=c.dtype),
        "hardware": dict(world_size=c.nproc, device_kind="cpu", cpu="test cpu", cpu_cores=2, torch="x"),
        "step_ms": c.tokens_per_step / tokens_per_s * 1000, "comm_ms": 12.5 if c.nproc > 1 else 0.0,
        "tokens_per_s": tokens_per_s, "peak_mem_gib": 1.234, "mfu": None, "t_eff": c.tokens_per_step,
        "final_loss": final_loss, "warmup_steps_excluded": 2, "memory_measure": "peak RSS of the process (CPU)",
    }


# ---------------------------------------------------------------------------------------------------------------
# Grids and commands


def test_cpu_small_grid_gives_every_cell_the_same_step():
    cells = sweep.expand(sweep.GRIDS["cpu-small"])
    assert [(c.strategy, c.nproc, c.micro_batch_size, c.grad_accum) for c in cells] == [
        ("single-ft", 1, 1, 4), ("single-ft", 1, 2, 2),
        ("ddp-ft", 2, 1, 2), ("ddp-ft", 2, 2, 1),
        ("fsdp-ft", 2, 1, 2), ("fsdp-ft", 2, 2, 1)]
    assert {c.tokens_per_step for c in cells} == {512}
    assert len({c.name for c in cells}) == len(cells)  # every cell gets its own folder


def test_t_eff_100k_grid_matches_the_seed_example():
    cells = sweep.expand(sweep.GRIDS["t-eff-100k"])
    assert {c.tokens_per_step for c in cells} == {102_400}
    by_key = {(c.strategy, c.micro_batch_size): c for c in cells}
    # A published 2x MI100 SFT demo's setting: S=1024, B_micro=1, GA=50, N=2 -> 1024 x 1 x 50 x 2 = 102,400.
    ddp = by_key[("ddp-ft", 1)]
    assert (ddp.seq_len, ddp.grad_accum, ddp.nproc) == (1024, 50, 2)
    assert 1024 * 1 * 50 * 2 == ddp.tokens_per_step
    # Pipeline ranks share rows, so the same T_eff takes twice the micro-batches; one rank likewise.
    assert by_key[("pp-ft:1f1b", 1)].grad_accum == 100
    assert by_key[("single-ft", 1)].grad_accum == 100
    assert by_key[("zero-ft:2", 5)].grad_accum == 10
    assert by_key[("single-ft", 5)].grad_accum == 20


def test_tokens_per_step_that_does_not_divide_is_an_error():
    with pytest.raises(ValueError, match="not a multiple of seq_len 1024 x micro-batch 4 x 2"):
        sweep.derived_grad_accum(102_400, 1024, 4, 2)


def test_single_ft_runs_once_whatever_the_nproc_list():
    grid = Grid(strategies=["single-ft", "fsdp-ft"], micro_batch_sizes=[1], checkpointing=[False, True],
                dtypes=["fp32"], model="qwen3-tiny", seq_len=64, steps=2, nproc=[1, 2], grad_accums=[2])
    cells = sweep.expand(grid)
    assert [(c.strategy, c.nproc, c.activation_checkpointing) for c in cells] == [
        ("single-ft", 1, False), ("single-ft", 1, True),
        ("fsdp-ft", 1, False), ("fsdp-ft", 1, True), ("fsdp-ft", 2, False), ("fsdp-ft", 2, True)]
    # Data-parallel at nproc 2 with the same GA does twice the rows per step.
    assert [c.tokens_per_step for c in cells] == [128, 128, 128, 128, 256, 256]


def test_single_ft_command_is_a_plain_python_run(tmp_path):
    argv = sweep.command(cell(checkpointing=True, extra_args=("--lr", "1e-4")), tmp_path / "out")
    assert argv == [sys.executable, "experiments/single-ft/train.py", "--model", "qwen3-tiny", "--seq-len", "128",
                    "--steps", "4", "--micro-batch-size", "1", "--grad-accum", "4", "--dtype", "fp32",
                    "--activation-checkpointing", "--out-dir", str(tmp_path / "out"), "--lr", "1e-4"]


def test_multi_rank_commands_go_through_torchrun_with_the_strategy_flag(tmp_path):
    zero = sweep.command(cell("zero-ft:2", nproc=2, micro=2, accum=1, dtype="bf16"), tmp_path)
    assert zero == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    "experiments/zero-ft/train.py", "--model", "qwen3-tiny", "--seq-len", "128", "--steps", "4",
                    "--micro-batch-size", "2", "--grad-accum", "1", "--dtype", "bf16", "--zero-stage", "2",
                    "--out-dir", str(tmp_path)]
    pipeline = sweep.command(cell("pp-ft:1f1b", nproc=2, accum=8), tmp_path)
    assert pipeline[5] == "experiments/pp-ft/train.py"
    assert pipeline[pipeline.index("--schedule") + 1] == "1f1b"
    assert "--nproc_per_node=1" in sweep.command(cell("fsdp-ft", nproc=1), tmp_path)


@pytest.mark.parametrize("strategy", ["single-ft", "ddp-ft", "fsdp-ft", "zero-ft:2", "tp-ft", "tp-sp-ft",
                                      "fsdp-tp-ft", "pp-ft:1f1b", "pp-ds-ft"])
def test_every_flag_the_sweep_passes_is_one_the_script_accepts(strategy, tmp_path):
    c = cell(strategy, nproc=1 if strategy == "single-ft" else 2, micro=2, accum=3, checkpointing=True,
             dtype="bf16", extra_args=("--lr", "1e-4"))
    argv = sweep.command(c, tmp_path)
    script_args = argv[argv.index(f"experiments/{c.experiment}/train.py") + 1:]
    (config,) = HfArgumentParser(load_experiment(c.experiment).Config).parse_args_into_dataclasses(args=script_args)
    assert (config.model, config.seq_len, config.steps) == ("qwen3-tiny", 128, 4)
    assert (config.micro_batch_size, config.grad_accum, config.activation_checkpointing) == (2, 3, True)
    assert (config.dtype, config.lr, config.out_dir) == ("bf16", 1e-4, str(tmp_path))
    if strategy == "zero-ft:2":
        assert config.zero_stage == 2
    if strategy == "pp-ft:1f1b":
        assert config.schedule == "1f1b"


def test_fsdp_tp_reads_one_share_of_rows_per_row_of_its_mesh():
    # 4 ranks at the default --tp-degree 2: 2 rows of the mesh, each with its own rows (its 2 tp ranks share them)
    assert cell("fsdp-tp-ft", nproc=4).data_parallel_ranks == 2
    assert cell("fsdp-tp-ft", nproc=4, micro=1, accum=2).tokens_per_step == 128 * 1 * 2 * 2
    assert cell("fsdp-tp-ft", nproc=8, extra_args=("--tp-degree", "4")).data_parallel_ranks == 2


def test_bad_strategy_specs_are_refused():
    with pytest.raises(ValueError, match="no experiments/nope-ft/train.py"):
        sweep.parse_strategy("nope-ft")
    with pytest.raises(ValueError, match="ddp-ft takes no ':value'"):
        sweep.parse_strategy("ddp-ft:3")


def test_command_line_options_override_the_named_grid():
    args = sweep.parse_args(["--grid", "t-eff-100k", "--strategies", "fsdp-ft", "--grad-accums", "4", "8",
                             "--checkpointing", "off", "on", "--seq-len", "512"])
    grid = sweep.grid_from_args(args)
    assert (grid.strategies, grid.grad_accums, grid.tokens_per_step) == (["fsdp-ft"], [4, 8], None)
    assert (grid.checkpointing, grid.seq_len, grid.model) == ([False, True], 512, "Qwen/Qwen3-0.6B-Base")
    assert sweep.GRIDS["t-eff-100k"].tokens_per_step == 102_400  # the named grid itself is untouched


# ---------------------------------------------------------------------------------------------------------------
# Running: resume and failures (no real runs)


def test_resume_skips_cells_with_a_summary(tmp_path, monkeypatch):
    cells = sweep.expand(sweep.GRIDS["cpu-small"])
    for done in cells[:2]:
        (tmp_path / done.name).mkdir()
        (tmp_path / done.name / "summary.json").write_text(json.dumps(fake_summary(done, 1000.0)))
    ran = []

    def fake_run(c, cell_dir):
        ran.append(c)
        return {"summary": fake_summary(c, 1500.0)}

    monkeypatch.setattr(sweep, "run_cell", fake_run)
    results = sweep.run_sweep(cells, tmp_path, print_fn=lambda *_: None)
    assert ran == cells[2:]
    assert list(results) == cells  # the table keeps the grid order
    assert results[cells[0]]["summary"]["tokens_per_s"] == 1000.0  # read back, not rerun


def test_resume_refuses_a_folder_holding_a_different_run(tmp_path):
    c = cell()
    (tmp_path / c.name).mkdir()
    (tmp_path / c.name / "summary.json").write_text(json.dumps(fake_summary(cell(seq_len=256), 1000.0)))
    with pytest.raises(SystemExit, match="seq_len 256 \\(this sweep: 128\\)"):
        sweep.finished_summary(c, tmp_path / c.name)


def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch):
    failing, fine = cell(micro=1), cell(micro=2, accum=2)

    def fake_command(c, out_dir):
        if c == failing:
            return [sys.executable, "-c", "print('step 1/4 | loss 9.0'); raise SystemExit('bad: out of memory')"]
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "summary.json").write_text(json.dumps(fake_summary(c, 800.0)))
        return [sys.executable, "-c", "pass"]

    monkeypatch.setattr(sweep, "command", fake_command)
    results = sweep.run_sweep([failing, fine], tmp_path, print_fn=lambda *_: None)
    assert results[failing] == {"error": "exit 1: bad: out of memory"}
    assert results[fine]["summary"]["tokens_per_s"] == 800.0
    rows = sweep.table_rows(results)
    assert rows[0]["status"] == "FAILED exit 1: bad: out of memory" and rows[0]["toks/s"] is None
    assert rows[0]["t_eff"] == failing.tokens_per_step  # the planned value when the run produced none
    assert "step 1/4" in (tmp_path / failing.name / "train.log").read_text()


# ---------------------------------------------------------------------------------------------------------------
# The table and scaling efficiency


def test_scaling_efficiency_is_n_rank_throughput_over_n_times_one_rank():
    single = cell("single-ft", micro=1, accum=4)
    ddp = cell("ddp-ft", nproc=2, micro=1, accum=2)
    fsdp_1, fsdp_2 = cell("fsdp-ft", nproc=1, accum=4), cell("fsdp-ft", nproc=2, accum=2)
    different_step = cell("ddp-ft", nproc=2, micro=1, accum=4)  # 1024 tokens per step: no 1-rank twin
    results = {c: {"summary": fake_summary(c, tps)} for c, tps in
               [(single, 1000.0), (ddp, 1800.0), (fsdp_1, 900.0), (fsdp_2, 1530.0), (different_step, 1900.0)]}
    efficiencies = sweep.scaling_efficiencies(results)
    assert efficiencies[ddp] == (pytest.approx(1800 / (2 * 1000)), single)
    assert efficiencies[fsdp_2] == (pytest.approx(1530 / (2 * 900)), fsdp_1)  # its own 1-rank run first
    assert different_step not in efficiencies and single not in efficiencies


def test_markdown_and_csv_tables_from_summaries(tmp_path):
    single = cell("single-ft", accum=4, checkpointing=True, dtype="bf16")
    ddp = cell("ddp-ft", nproc=2, accum=2, checkpointing=True, dtype="bf16")
    failed = cell("fsdp-ft", nproc=2, accum=2)
    results = {single: {"summary": fake_summary(single, 1000.0, final_loss=2.34567)},
               ddp: {"summary": fake_summary(ddp, 1600.0)}, failed: {"error": "exit 1: boom | bang"}}
    rows = sweep.table_rows(results)
    table = sweep.markdown_table(rows).splitlines()
    assert table[0] == ("| strategy | nproc | micro_bsz | GA | ckpt | bf16 | step_ms | comm_ms | toks/s | "
                        "peak_mem_gib | t_eff | mfu | final_loss | scaling_eff | status |")
    assert table[2] == "| single-ft | 1 | 1 | 4 | T | T | 512 | 0 | 1,000 | 1.23 | 512 | - | 2.3457 | - | ok |"
    assert table[3] == ("| ddp-ft | 2 | 1 | 2 | T | T | 320 | 12 | 1,600 | 1.23 | 512 | - | 2.5000 | 0.80 (vs "
                        "single-ft) | ok |")
    assert table[4].startswith("| fsdp-ft | 2 | 1 | 2 | F | F | - | - | - | - | 512 |")
    assert table[4].endswith("| - | - | FAILED exit 1: boom \\| bang |")  # a pipe in an error keeps the table intact

    sweep.write_csv(rows, tmp_path / "sweep.csv")
    with open(tmp_path / "sweep.csv") as handle:
        read = list(csv.DictReader(handle))
    assert tuple(read[0]) == sweep.COLUMNS
    assert float(read[1]["scaling_eff"]) == pytest.approx(0.8) and read[1]["scaling_ref"] == single.name
    assert float(read[0]["step_ms"]) == pytest.approx(512.0) and read[2]["toks/s"] == ""

    report = sweep.report(results, "uv run python -m common.sweep --grid cpu-small")
    assert "CPU only: test cpu, 2 cores" in report and "1 failed" in report and "fake ddp-ft" in report


# ---------------------------------------------------------------------------------------------------------------
# One real run: the sweep's command line is one single-ft accepts, and its summary lands in the table


@pytest.mark.slow
def test_real_single_ft_cell_runs_and_is_then_skipped(tmp_path, small_data, monkeypatch):
    real = Cell("single-ft", 1, 2, 1, True, "fp32", "qwen3-tiny", 64, 2, ("--data", str(small_data)))
    results = sweep.run_sweep([real], tmp_path, print_fn=lambda *_: None)
    summary = results[real]["summary"]
    assert summary["config"]["activation_checkpointing"] is True and summary["t_eff"] == 128
    assert sweep.table_rows(results)[0]["final_loss"] == summary["final_loss"]

    monkeypatch.setattr(sweep, "run_cell", lambda *_: pytest.fail("a finished cell ran again"))
    assert sweep.run_sweep([real], tmp_path, print_fn=lambda *_: None)[real]["summary"] == summary
