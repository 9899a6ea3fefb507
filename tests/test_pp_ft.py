"""pp-ft and pp-ds-ft against single-ft: per-step losses and gradient norms of every schedule, per-parameter
gradients (the tied embedding / LM head included), the bubble, resume, --save-hf, and the one-process launch.

Two torchrun launches (2 ranks, gloo, CPU), one per experiment, each running all its configurations; single-ft runs
in-process on the same B: 4 rows per step, as micro-batch 1 x grad-accum 4.
"""

import json
import socket
from contextlib import nullcontext

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import build_data, evaluate
from conftest import load_experiment, read_losses, torchrun

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
GRADIENT_SCHEDULES = ("1f1b", "zbv")  # the tied gradient summed across ranks, and on one rank (V placement)
STEPS = 5


def common_args(data, out, profile=False):
    # torch.profiler (comm_ms) slows CPU steps a lot and changes no number: on only where comm_ms is checked.
    return ["--data", data, "--seq-len", 128, "--dtype", "fp32", "--micro-batch-size", 1, "--grad-accum", 4,
            "--warmup-steps", 2, "--out-dir", out, *([] if profile else ["--comm-profile-steps", 0])]


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def read_tensors(checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of a DCP checkpoint whose key starts with `prefix`, read in this (non-distributed) process."""
    reader = dcp.FileSystemReader(checkpoint)
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in reader.read_metadata().state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@pytest.fixture(scope="module")
def single(tmp_path_factory, small_data):
    """single-ft on the same B: 5 steps with clipping on (the parity runs), and 1 step without clipping whose
    checkpoint holds AdamW's first moment after one step, exp_avg = (1 - beta1) x gradient."""
    single_ft = load_experiment("single-ft")
    root = tmp_path_factory.mktemp("single")
    summary = single_ft.main([*map(str, common_args(small_data, root / "steps")), "--steps", str(STEPS)])
    single_ft.main([*map(str, common_args(small_data, root / "grads")), "--steps", "1", "--max-grad-norm", "0",
                    "--checkpoint-every", "1"])
    return dict(records=records(root / "steps"), eval_loss=summary["eval_loss"],
                grads=root / "grads" / "checkpoints" / "step-1")


@pytest.fixture(scope="module")
def pp(tmp_path_factory, small_data):
    """One launch, every configuration: each schedule for 5 steps (1f1b also profiles comm_ms, checkpoints at step 3
    and exports; interleaved recomputes activations; gpipe uses an uneven split), a resume from step 3, a bf16 run,
    and 1-step runs without clipping that checkpoint, for the per-parameter gradients."""
    root = tmp_path_factory.mktemp("pp")
    extra = {"1f1b": ["--checkpoint-every", 3, "--save-hf", root / "hf"],
             "interleaved-1f1b": ["--activation-checkpointing"],
             "gpipe": ["--split", 1]}  # stage 0: embedding + layer 0; stage 1: layers 1-3 + head
    runs = [[*common_args(small_data, root / schedule, profile=schedule == "1f1b"), "--schedule", schedule,
             "--steps", STEPS, *extra.get(schedule, [])] for schedule in SCHEDULES]
    runs.append([*common_args(small_data, root / "resumed"), "--schedule", "1f1b", "--steps", STEPS,
                 "--resume", root / "1f1b" / "checkpoints" / "step-3"])
    runs.append([*common_args(small_data, root / "bf16"), "--steps", 3, "--dtype", "bf16"])  # the last --dtype wins
    runs += [[*common_args(small_data, root / f"grads-{schedule}"), "--schedule", schedule, "--steps", 1,
              "--max-grad-norm", 0, "--checkpoint-every", 1] for schedule in GRADIENT_SCHEDULES]
    torchrun("pp-ft", runs)
    return root


@pytest.fixture(scope="module")
def pp_ds(tmp_path_factory, small_data):
    """One launch: fp32 without ZeRO (checkpoints at step 3), its resume, and ZeRO-1 with activation checkpointing."""
    root = tmp_path_factory.mktemp("pp_ds")
    torchrun("pp-ds-ft", [
        [*common_args(small_data, root / "zero0"), "--steps", STEPS, "--checkpoint-every", 3],
        [*common_args(small_data, root / "resumed"), "--steps", STEPS, "--resume",
         root / "zero0" / "checkpoints" / "step-3"],
        [*common_args(small_data, root / "zero1"), "--steps", STEPS, "--zero-stage", 1,
         "--activation-checkpointing"],
    ])
    return root


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_computes_single_ft_steps(pp, single, schedule):
    got, want = records(pp / schedule), single["records"]
    assert len(got) == STEPS
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    # The norm comes from the stages' parts, with the tied weight counted once; clipping is active (norm > 1), so
    # a wrong norm would also move the losses.
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
    assert min(r["grad_norm"] for r in want) > 1.0
    assert [r["loss_tokens"] for r in got] == [r["loss_tokens"] for r in want]
    # tokens/s counts the step's real tokens once, not once per rank.
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    summary = json.loads((pp / schedule / "summary.json").read_text())
    assert summary["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    if schedule == "1f1b":  # the profiled run: p2p and the small collectives show up as gloo time
        assert all(r["comm_ms"] > 0 for r in got[2:])


def test_bf16_tracks_fp32(pp, single):
    bf16 = [r["loss"] for r in records(pp / "bf16")]
    fp32 = [r["loss"] for r in single["records"][:3]]
    # bf16 rounds every matmul input to 8 bits of mantissa: losses agree to about 1%, not to 1e-5.
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-6)


@pytest.mark.parametrize("schedule", GRADIENT_SCHEDULES)
def test_gradients_match_single_ft_per_parameter(pp, single, schedule):
    """After one step without clipping, AdamW's exp_avg is 0.1 x the gradient: compare it parameter by parameter.
    The LM head copy must hold the tied weight's full gradient (lookup + head), as single-ft's one tensor does."""
    want = read_tensors(single["grads"], "optimizer.state.")
    got = read_tensors(pp / f"grads-{schedule}" / "checkpoints" / "step-1", "optimizer.state.")
    moments = {key for key in want if key.endswith(".exp_avg")}
    assert {key for key in got if key.endswith(".exp_avg")} == moments | {"optimizer.state.lm_head.weight.exp_avg"}
    want["optimizer.state.lm_head.weight.exp_avg"] = want["optimizer.state.model.embed_tokens.weight.exp_avg"]
    for key in sorted(moments) + ["optimizer.state.lm_head.weight.exp_avg"]:
        expected = want[key]
        torch.testing.assert_close(got[key], expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item(), msg=key)
    # Both copies of the tied weight took the same update: still bit-identical after the step.
    weights = read_tensors(pp / f"grads-{schedule}" / "checkpoints" / "step-1", "model.")
    assert torch.equal(weights["model.lm_head.weight"], weights["model.model.embed_tokens.weight"])


def test_bubble_is_measured_per_rank_next_to_the_textbook_value(pp):
    textbook = {"gpipe": 1 / 5, "1f1b": 1 / 5, "interleaved-1f1b": 1 / 9, "zbv": 0.0}  # p = 2, m = 4, v = 2
    for schedule in SCHEDULES:
        summary = json.loads((pp / schedule / "summary.json").read_text())
        assert summary["bubble_fraction_textbook"] == pytest.approx(textbook[schedule])
        per_rank = summary["bubble_fraction_per_rank"]
        assert len(per_rank) == 2 and all(0.0 < fraction < 1.0 for fraction in per_rank), (schedule, per_rank)
        for busy, total, fraction in zip(summary["busy_ms_per_rank"], summary["schedule_ms_per_rank"], per_rank):
            assert 0 < busy < total and fraction == pytest.approx((total - busy) / total)
        assert summary["bubble_fraction"] == pytest.approx(sum(per_rank) / 2)
        # The schedule's time is most of the step (the rest: tied-gradient sum, clipping, AdamW, loss broadcast).
        assert max(summary["schedule_ms_per_rank"]) < summary["step_ms"] * 1.5


def test_layout_follows_the_schedule_and_split(pp):
    layouts = {schedule: json.loads((pp / schedule / "summary.json").read_text())["pipeline"] for schedule in SCHEDULES}
    assert layouts["gpipe"]["stage_layers"] == [[0, 1], [1, 4]]  # --split 1
    assert layouts["1f1b"]["stage_layers"] == [[0, 2], [2, 4]]
    assert layouts["interleaved-1f1b"]["stage_rank"] == [0, 1, 0, 1]  # loop placement
    assert layouts["zbv"]["stage_rank"] == [0, 1, 1, 0]  # V: rank 0 holds the first and the last stage
    held = json.loads((pp / "1f1b" / "summary.json").read_text())["model"]
    vocab, hidden = 8192, 256
    assert sum(held["parameters_held_per_rank"]) == held["parameters"] + vocab * hidden  # one LM head copy more


def test_resume_equals_the_uninterrupted_run(pp):
    uninterrupted = read_losses(pp / "1f1b")
    assert sorted(p.name for p in (pp / "1f1b" / "checkpoints").iterdir()) == ["step-3"]
    resumed = read_losses(pp / "resumed")
    assert len(resumed) == STEPS - 3
    assert resumed == pytest.approx(uninterrupted[3:], rel=1e-5)


def test_save_hf_reloads_in_plain_transformers_with_the_same_eval_loss(pp, small_data):
    export = pp / "hf"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # one shard per rank
    assert "lm_head.weight" not in index["weight_map"]  # tied: rebuilt from the embedding
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    data = build_data(small_data, AutoTokenizer.from_pretrained(export), 128, seed=0)
    reloaded = evaluate(model, data, 1, torch.device("cpu"), nullcontext)
    assert reloaded == pytest.approx(json.loads((pp / "1f1b" / "summary.json").read_text())["eval_loss"], rel=1e-5)


def test_deepspeed_pipeline_computes_single_ft_steps(pp_ds, single):
    want = single["records"]
    zero0, zero1 = records(pp_ds / "zero0"), records(pp_ds / "zero1")
    for got in (zero0, zero1):
        assert len(got) == STEPS
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    # ZeRO-0: our clipping (DeepSpeed's fp32 path would count the first stage only) uses torch's norm, as single-ft.
    assert [r["grad_norm"] for r in zero0] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
    # ZeRO-1: DeepSpeed's own norm. torch's fp32 vector_norm on CPU is ~1e-4 off on the 2M-element embedding
    # gradient (it disagrees with float64 by that much) and DeepSpeed's is not, hence the looser tolerance here.
    assert [r["grad_norm"] for r in zero1] == pytest.approx([r["grad_norm"] for r in want], rel=1e-3)
    summary = json.loads((pp_ds / "zero0" / "summary.json").read_text())
    assert summary["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)


def test_deepspeed_resume_equals_the_uninterrupted_run(pp_ds):
    uninterrupted = read_losses(pp_ds / "zero0")
    resumed = read_losses(pp_ds / "resumed")
    assert len(resumed) == STEPS - 3
    assert resumed == pytest.approx(uninterrupted[3:], rel=1e-5)


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


@pytest.mark.parametrize("launch", ["torchrun", "python"])
def test_one_process_runs_the_pipeline_on_one_rank(tmp_path, small_data, single, monkeypatch, capsys, launch):
    """`torchrun --nproc_per_node=1` (its environment, one rank) and plain `python` both run: one stage (1f1b), or
    two stages on the same rank (zbv, which also sums the tied gradient locally). Same steps as single-ft."""
    if launch == "torchrun":
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", free_port())
    else:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            monkeypatch.delenv(name, raising=False)
    schedule = "1f1b" if launch == "torchrun" else "zbv"
    out = tmp_path / "one"
    summary = load_experiment("pp-ft").main(
        [*map(str, common_args(small_data, out)), "--steps", "2", "--schedule", schedule])
    assert "one process" in capsys.readouterr().out
    assert read_losses(out) == pytest.approx([r["loss"] for r in single["records"][:2]], rel=1e-5)
    assert summary["bubble_fraction_textbook"] == 0.0
    assert not torch.distributed.is_initialized()  # the group is gone, so later in-process runs start clean
