"""pp-ft and pp-ds-ft against single-ft: per-step losses and gradient norms of every schedule, per-parameter
gradients (the tied embedding / LM head included), LoRA (steps, resume, adapter and merged exports), the fused loss on
the last stage (--loss-chunk-tokens, against single-ft's), the bubble, the schedule trace, model-state bytes against
common/memory, collective calls and bytes against common/comm.py, resume, --save-hf, and the one-process launch.

Two torchrun launches (2 ranks, gloo, CPU), one per experiment, each running all its configurations; single-ft runs
in-process on the same B: 4 rows per step, as micro-batch 1 x grad-accum 4.
"""

import json
import socket
from contextlib import nullcontext

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.comm import pipeline_collectives, predict_bubble, predict_collectives
from common.memory import predict_state_bytes
from common.data import build_data, evaluate, token_loss_sum
from common.models import load_model, load_tokenizer, model_config
from conftest import load_experiment, read_losses, torchrun

pytestmark = pytest.mark.slow  # torchrun launches (the quick tier leaves them out)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zbv")
GRADIENT_SCHEDULES = ("1f1b", "zbv")  # the tied gradient summed across ranks, and on one rank (V placement)
LORA_SCHEDULES = ("1f1b", "zbv")
STEPS = 5
LORA_STEPS = 3  # the LoRA runs checkpoint at step 2 and resume from there
PROFILED_STEP = 3  # --comm-profile-steps 1 profiles the first step after the 2 timing warm-up steps
LORA = ["--lora-rank", 4]
FUSED = ["--loss-chunk-tokens", 16]  # the fused loss, in chunks smaller than a micro-batch's loss tokens


def common_args(data, out, profile_steps=0):
    # torch.profiler (comm_ms, collective bytes) slows CPU steps a lot and changes no number: on only where checked.
    return ["--data", data, "--seq-len", 128, "--dtype", "fp32", "--micro-batch-size", 1, "--grad-accum", 4,
            "--warmup-steps", 2, "--out-dir", out, "--comm-profile-steps", profile_steps]


def summary_of(out):
    return json.loads((out / "summary.json").read_text())


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
    """single-ft on the same B: 5 steps with clipping on (the parity runs), 1 step without clipping whose
    checkpoint holds AdamW's first moment after one step, exp_avg = (1 - beta1) x gradient, 3 LoRA steps
    that export their adapter, and 3 bf16 steps (bf16 weights, fp32 masters)."""
    single_ft = load_experiment("single-ft")
    root = tmp_path_factory.mktemp("single")
    summary = single_ft.main([*map(str, common_args(small_data, root / "steps")), "--steps", str(STEPS)])
    single_ft.main([*map(str, common_args(small_data, root / "grads")), "--steps", "1", "--max-grad-norm", "0",
                    "--checkpoint-every", "1"])
    lora = single_ft.main([*map(str, [*common_args(small_data, root / "lora"), "--steps", LORA_STEPS, *LORA,
                                      "--save-hf", root / "lora-adapter"])])
    fused = single_ft.main([*map(str, [*common_args(small_data, root / "fused"), "--steps", STEPS, *FUSED])])
    single_ft.main([*map(str, common_args(small_data, root / "bf16")), "--steps", "3", "--dtype", "bf16"])
    return dict(records=records(root / "steps"), eval_loss=summary["eval_loss"],
                fused_records=records(root / "fused"), fused_summary=fused,
                grads=root / "grads" / "checkpoints" / "step-1", lora_records=records(root / "lora"),
                bf16_records=records(root / "bf16"),
                lora_summary=lora, lora_adapter=root / "lora-adapter")


def pp_runs(root, small_data) -> list:
    """Every pp-ft configuration: each schedule for 5 steps with step 3 profiled (collective calls and bytes;
    1f1b also checkpoints at step 3 and exports; interleaved recomputes activations; gpipe uses an uneven split), a
    resume from step 3, bf16 runs (1f1b with step 3 profiled, a checkpoint at step 2 and an export; its resume; one
    step of zbv with recomputation and of 2 replicas), 1-step runs without clipping that checkpoint, for the
    per-parameter gradients, and LoRA: 1f1b (checkpoint at step 2, adapter export), its resume, and zbv (merged
    export)."""
    extra = {"1f1b": ["--checkpoint-every", 3, "--save-hf", root / "hf"],
             "interleaved-1f1b": ["--activation-checkpointing"],
             "gpipe": ["--split", 1]}  # stage 0: embedding + layer 0; stage 1: layers 1-3 + head
    runs = [[*common_args(small_data, root / schedule, profile_steps=1), "--schedule", schedule, "--steps", STEPS,
             *extra.get(schedule, [])] for schedule in SCHEDULES]
    runs.append([*common_args(small_data, root / "resumed"), "--schedule", "1f1b", "--steps", STEPS,
                 "--resume", root / "1f1b" / "checkpoints" / "step-3"])
    bf16 = ["--dtype", "bf16"]  # the last --dtype wins
    runs += [[*common_args(small_data, root / "bf16", profile_steps=1), "--steps", 3, *bf16, "--checkpoint-every", 2,
              "--save-hf", root / "bf16-hf"],
             [*common_args(small_data, root / "bf16-resumed"), "--steps", 3, *bf16, "--resume",
              root / "bf16" / "checkpoints" / "step-2"],
             [*common_args(small_data, root / "bf16-zbv"), "--schedule", "zbv", "--steps", 1, *bf16,
              "--activation-checkpointing"],
             [*common_args(small_data, root / "bf16-replicas"), "--stages", 1, "--grad-accum", 2, "--steps", 1, *bf16]]
    runs += [[*common_args(small_data, root / f"grads-{schedule}"), "--schedule", schedule, "--steps", 1,
              "--max-grad-norm", 0, "--checkpoint-every", 1] for schedule in GRADIENT_SCHEDULES]
    lora_extra = {"1f1b": ["--checkpoint-every", 2, "--save-hf", root / "lora-adapter"],
                  "zbv": ["--save-hf", root / "lora-merged", "--merge-lora"]}
    runs += [[*common_args(small_data, root / f"lora-{schedule}"), "--schedule", schedule, "--steps", LORA_STEPS,
              *LORA, *lora_extra[schedule]] for schedule in LORA_SCHEDULES]
    runs.append([*common_args(small_data, root / "lora-resumed"), "--schedule", "1f1b", "--steps", LORA_STEPS, *LORA,
                 "--resume", root / "lora-1f1b" / "checkpoints" / "step-2"])
    runs.append([*common_args(small_data, root / "lora-bf16"), "--schedule", "1f1b", "--steps", LORA_STEPS, *LORA,
                 "--dtype", "bf16"])  # a bf16 base (its stages pass bf16 hidden states); the later --dtype wins
    runs.append([*common_args(small_data, root / "lora-fused"), "--schedule", "1f1b", "--steps", LORA_STEPS, *LORA,
                 "--lora-fused"])  # the fused layers, cut into stages with the rest
    # The fused loss on the last stage: 1f1b (the tied head copy's gradient summed across ranks), interleaved (the
    # head on rank 1's second stage), and one stage x 2 data-parallel replicas (DDP sees the head used in forward).
    runs += [[*common_args(small_data, root / "fused-1f1b"), "--schedule", "1f1b", "--steps", STEPS, *FUSED],
             [*common_args(small_data, root / "fused-interleaved"), "--schedule", "interleaved-1f1b", "--steps", 3,
              *FUSED],
             [*common_args(small_data, root / "fused-replicas"), "--stages", 1, "--grad-accum", 2, "--steps", 3,
              *FUSED]]  # B = 1 x 2 x 2 replicas: single-ft's 4 rows
    runs += [[*common_args(small_data, root / "varlen"), "--schedule", "zbv", "--steps", 3, "--attn", "varlen"],
             [*common_args(small_data, root / "compile"), "--steps", 2, "--compile"]]
    # Only what a smoke run needs: the default --grad-accum is one micro-batch per stage, which 1F1B accepts.
    runs.append(["--data", small_data, "--seq-len", 128, "--steps", 1, "--eval-fraction", 0, "--out-dir",
                 root / "defaults"])
    return runs


def pp_ds_runs(root, small_data) -> list:
    """pp-ds-ft: fp32 without ZeRO (checkpoints at step 3), its resume, ZeRO-1 with activation checkpointing (both
    profile step 3), and LoRA: 3 steps (checkpoint at step 2, adapter export), a resume from step 2 with activation
    checkpointing and the merged export, and 2 bf16 steps."""
    return [
        [*common_args(small_data, root / "zero0", profile_steps=1), "--steps", STEPS, "--checkpoint-every", 3],
        [*common_args(small_data, root / "resumed"), "--steps", STEPS, "--resume",
         root / "zero0" / "checkpoints" / "step-3"],
        [*common_args(small_data, root / "zero1", profile_steps=1), "--steps", STEPS, "--zero-stage", 1,
         "--activation-checkpointing"],
        [*common_args(small_data, root / "lora"), "--steps", LORA_STEPS, *LORA, "--checkpoint-every", 2,
         "--save-hf", root / "lora-adapter"],
        [*common_args(small_data, root / "lora-resumed"), "--steps", LORA_STEPS, *LORA, "--activation-checkpointing",
         "--resume", root / "lora" / "checkpoints" / "step-2", "--save-hf", root / "lora-merged", "--merge-lora"],
        [*common_args(small_data, root / "lora-bf16"), "--steps", 2, *LORA, "--dtype", "bf16"],  # ZeRO-1's bf16 path
        [*common_args(small_data, root / "varlen"), "--steps", 3, "--attn", "varlen"],
        [*common_args(small_data, root / "compile"), "--steps", 2, "--compile"],
    ]


@pytest.fixture(scope="module")
def launched(tmp_path_factory, small_data):
    """pp-ft's and pp-ds-ft's configurations in one torchrun launch (one round of imports; DeepSpeed's last)."""
    pp_root, ds_root = tmp_path_factory.mktemp("pp"), tmp_path_factory.mktemp("pp_ds")
    torchrun("+", [["pp-ft", *run] for run in pp_runs(pp_root, small_data)]
             + [["pp-ds-ft", *run] for run in pp_ds_runs(ds_root, small_data)])
    return pp_root, ds_root


@pytest.fixture(scope="module")
def pp(launched):
    return launched[0]


@pytest.fixture(scope="module")
def pp_ds(launched):
    return launched[1]


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
    summary = summary_of(pp / schedule)
    assert summary["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    # The profiled step: p2p and the small collectives show up as gloo time; the others are not profiled.
    assert summary["profiled_steps"] == [PROFILED_STEP]
    assert [r["comm_ms"] is not None and r["comm_ms"] > 0 for r in got] == [r["step"] == PROFILED_STEP for r in got]


def test_the_default_runs_one_micro_batch_per_stage(pp):
    summary = summary_of(pp / "defaults")
    assert (summary["config"]["schedule"], summary["config"]["grad_accum"]) == ("1f1b", 2)
    assert summary["t_eff"] == 2 * 128 and len(records(pp / "defaults")) == 1


def test_bf16_tracks_fp32(pp, single):
    bf16 = [r["loss"] for r in records(pp / "bf16")]
    fp32 = [r["loss"] for r in single["records"][:3]]
    # bf16 rounds every matmul input to 8 bits of mantissa: losses agree to about 1%, not to 1e-5.
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-6)


@pytest.mark.parametrize("name, steps", [("bf16", 3), ("bf16-zbv", 1), ("bf16-replicas", 1)])
def test_bf16_computes_single_ft_s_bf16_steps(pp, single, name, steps):
    """--dtype bf16: every rank's stages compute in bf16 weights, AdamW updates their fp32 masters
    (common/precision.py), as single-ft's bf16: the same bf16 micro-batches, so the first step agrees to float
    rounding, the later ones within bf16 rounding of each other's updates. 1f1b (the tied copies' gradients summed
    on the masters across ranks), zbv with recomputation (its weight pass writes .grad past the masters' hooks), 2
    replicas (the masters' gradients averaged)."""
    got, want = records(pp / name), single["bf16_records"][:steps]
    assert len(got) == steps
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-6)
    # The same bf16 gradients accumulated in fp32 in another order (a gradient lost, or counted twice, shows here)
    assert got[0]["grad_norm"] == pytest.approx(want[0]["grad_norm"], rel=1e-4)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-3)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-2)
    summary = summary_of(pp / name)
    assert summary["master_weights"]["compute_dtype"] == "bfloat16"
    assert summary["master_weights"]["master_dtype"] == "float32"


def test_bf16_stages_send_bf16_hidden_states_and_sum_fp32_tied_gradients(pp):
    summary = summary_of(pp / "bf16")
    measured, formula = summary["collective_bytes_per_step_per_rank"], predict_collectives(summary)
    assert summary["profiled_steps"] == [PROFILED_STEP] and measured == formula
    for rank in range(2):  # 1f1b, m = 4 micro-batches of 128 x 256 bf16 hidden states; the masters' 8192 x 256 fp32
        assert formula[rank]["gloo:send"] == {"calls": 4, "bytes": 4 * 128 * 256 * 2}
        assert formula[rank]["gloo:all_reduce"]["bytes"] == 4 + 8192 * 256 * 4
    # A summary without `master_weights` (a run from before the masters) keeps its fp32 hidden states' prediction.
    before = predict_collectives({**summary, "master_weights": None})
    assert [rank["gloo:send"]["bytes"] for rank in before] == [2 * 4 * 128 * 256 * 2] * 2


def test_bf16_resume_and_export_hold_the_fp32_masters(pp, small_data):
    """The checkpoint holds the fp32 masters under the model's names (the tied copies identical), the resumed step is
    the uninterrupted one bit for bit, and --save-hf writes the masters (fp32 values bf16 cannot hold)."""
    weights = read_tensors(pp / "bf16" / "checkpoints" / "step-2", "model.")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    assert torch.equal(weights["model.lm_head.weight"], weights["model.model.embed_tokens.weight"])
    assert not torch.equal(weights["model.lm_head.weight"], weights["model.lm_head.weight"].bfloat16().float())
    resumed, uninterrupted = records(pp / "bf16-resumed"), records(pp / "bf16")
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in uninterrupted[2:]]
    assert summary_of(pp / "bf16-resumed")["eval_loss"] == summary_of(pp / "bf16")["eval_loss"]
    export = pp / "bf16-hf"
    tensors = {name: t for shard in export.glob("*.safetensors") for name, t in load_file(shard).items()}
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert not all(torch.equal(t, t.bfloat16().float()) for t in tensors.values())
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    reloaded = eval_loss_of(model, export, small_data)  # in fp32: within bf16 rounding of the run's bf16 evaluation
    assert reloaded == pytest.approx(summary_of(pp / "bf16")["eval_loss"], rel=2e-2)


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
        assert predict_bubble(summary)[0] == pytest.approx(textbook[schedule])
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
    modes = {file.name: file.stat().st_mode & 0o777 for file in export.iterdir()}
    assert set(modes.values()) == {modes["config.json"]}, modes  # both ranks' shards readable like the config
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


@pytest.mark.parametrize("experiment", ["pp", "pp_ds"])
def test_varlen_and_compile_compute_single_ft_steps(experiment, request, single):
    """--attn varlen (the per-document reference on CPU, its documents found from the position_ids each stage
    passes its layers) and --compile (each decoder layer of a stage) against single-ft's --attn sdpa steps."""
    root, want = request.getfixturevalue(experiment), single["records"]
    for name, steps, tolerance in (("varlen", 3, 1e-5), ("compile", 2, 1e-4)):
        got = records(root / name)
        assert len(got) == steps
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want[:steps]], rel=tolerance), name
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want[:steps]], rel=1e-3)
    assert summary_of(root / "varlen")["attention"]["varlen_kernel"] == "reference"
    assert summary_of(root / "compile")["config"]["compile"] is True


@pytest.mark.parametrize("name, steps", [("fused-1f1b", STEPS), ("fused-interleaved", 3), ("fused-replicas", 3)])
def test_fused_loss_computes_single_ft_fused_steps(pp, single, name, steps):
    """--loss-chunk-tokens: the last stage's fused loss against single-ft's with the same flag, per step."""
    got, want = records(pp / name), single["fused_records"][:steps]
    assert len(got) == steps
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-6)
    summary = summary_of(pp / name)
    # The FLOPs of the work done: the head on loss tokens only, as single-ft's fused run counts them (averaged over
    # the same measured steps: the 5-step runs').
    assert summary["lm_head_flops_on"] == "loss tokens"
    if steps == STEPS:
        assert summary["flops_per_token"] == pytest.approx(single["fused_summary"]["flops_per_token"], rel=1e-9)
        assert summary["flops_per_token"] < summary_of(pp / "1f1b")["flops_per_token"]
        assert summary["eval_loss"] == pytest.approx(single["fused_summary"]["eval_loss"], rel=1e-5)


def test_last_stage_runs_the_fused_loss_on_loss_tokens():
    """In process: the last stage given labels returns scale x the plain head's summed loss, with the same
    gradients for the head copy, the final norm and the stage's input; without labels it returns the logits."""
    module = load_experiment("pp-ft")
    torch.manual_seed(0)
    model = load_model("qwen3-tiny", load_tokenizer("qwen3-tiny"), "sdpa", device="cpu")
    config = model.config
    stage = module.Qwen3Stage(model, range(3, 4), is_first=False, is_last=True, loss_chunk_tokens=5)
    hidden = torch.randn(1, 24, config.hidden_size)
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0)
    labels = torch.randint(0, config.vocab_size, (1, 24))
    labels[0, :6] = labels[0, 10:13] = -100  # prompt tokens: no loss, and no head either under the fused loss
    scale = torch.tensor(1 / 15)

    def run(**kwargs):
        stage.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        out = stage(x, position_ids, **kwargs)
        loss = token_loss_sum(out, labels) * scale if out.ndim == 3 else out
        loss.backward()
        return out.shape, [loss.detach(), x.grad, stage.lm_head.weight.grad.clone(), stage.model.norm.weight.grad]

    (plain_shape, plain), (fused_shape, fused) = run(), run(labels=labels, loss_scale=scale)
    assert plain_shape == (1, 24, config.vocab_size) and fused_shape == ()  # logits, or the loss itself
    assert fused[0] > 0
    for want, got in zip(plain, fused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_fused_loss_with_zbv_is_refused_with_the_reason():
    module = load_experiment("pp-ft")
    with pytest.raises(SystemExit, match="--loss-chunk-tokens does not combine with --schedule zbv: ZBV runs"):
        module.resolve(module.Config(loss_chunk_tokens=64, schedule="zbv", out_dir="unused"))
    assert module.resolve(module.Config(loss_chunk_tokens=64, out_dir="unused")).loss_chunk_tokens == 64


def test_deepspeed_pipeline_refuses_the_fused_loss_with_the_reason():
    module = load_experiment("pp-ds-ft")
    config = module.Config(loss_chunk_tokens=64, out_dir="unused")
    with pytest.raises(SystemExit, match="no --loss-chunk-tokens yet: the last stage"):
        module.resolve(config, 2)


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
    assert predict_bubble(summary)[0] == 0.0
    assert not torch.distributed.is_initialized()  # the group is gone, so later in-process runs start clean


# ---------------------------------------------------------------------------------------------------------------
# LoRA


def base_model():
    """The frozen base every run starts from: qwen3-tiny's random init under --seed 0 (as the experiments build it)."""
    torch.manual_seed(0)
    return load_model("qwen3-tiny", load_tokenizer("qwen3-tiny"), "sdpa", dtype=torch.float32, device="cpu")


def eval_loss_of(model, export, small_data) -> float:
    data = build_data(small_data, AutoTokenizer.from_pretrained(export), 128, seed=0)
    return evaluate(model, data, 1, torch.device("cpu"), nullcontext)


@pytest.mark.parametrize("schedule", LORA_SCHEDULES)
def test_lora_computes_single_ft_lora_steps(pp, single, schedule):
    got, want = records(pp / f"lora-{schedule}"), single["lora_records"]
    assert len(got) == LORA_STEPS
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
    summary = summary_of(pp / f"lora-{schedule}")
    assert summary["eval_loss"] == pytest.approx(single["lora_summary"]["eval_loss"], rel=1e-5)
    # Only the adapters train: single-ft's count, spread over the stages.
    assert summary["model"]["trainable_parameters"] == single["lora_summary"]["model"]["trainable_parameters"]
    assert sum(summary["model"]["trainable_parameters_per_rank"]) == summary["model"]["trainable_parameters"]
    # The frozen tied weight needs no gradient sum: no V x d all-reduce (and nothing profiled here).
    assert predict_collectives(summary)[0]["gloo:all_reduce"] == {"calls": 1, "bytes": 4}


def test_fused_lora_computes_single_ft_lora_steps(pp, single):
    got, want = records(pp / "lora-fused"), single["lora_records"]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5) and len(got) == LORA_STEPS
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
    assert summary_of(pp / "lora-fused")["eval_loss"] == pytest.approx(single["lora_summary"]["eval_loss"], rel=1e-5)


def test_lora_resume_equals_the_uninterrupted_run(pp):
    resumed = read_losses(pp / "lora-resumed")
    assert len(resumed) == LORA_STEPS - 2
    assert resumed == pytest.approx(read_losses(pp / "lora-1f1b")[2:], rel=1e-5)
    assert summary_of(pp / "lora-resumed")["eval_loss"] == pytest.approx(
        summary_of(pp / "lora-1f1b")["eval_loss"], rel=1e-5)


def test_lora_adapter_export_is_single_ft_s_and_loads_with_peft(pp, single, small_data):
    from peft import PeftModel

    export = pp / "lora-adapter"
    got, want = load_file(export / "adapter_model.safetensors"), load_file(single["lora_adapter"] /
                                                                          "adapter_model.safetensors")
    assert set(got) == set(want)  # peft's names, gathered from both stages
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-5, msg=name)
    model = PeftModel.from_pretrained(base_model(), export)
    assert eval_loss_of(model, export, small_data) == pytest.approx(single["lora_summary"]["eval_loss"], rel=1e-5)


def test_lora_merged_export_loads_in_plain_transformers(pp, single, small_data):
    export = pp / "lora-merged"
    index = json.loads((export / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2  # one shard per rank, merged where the layers live
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert not any("lora" in name or "base_layer" in name for name, _ in model.named_parameters())
    assert eval_loss_of(model, export, small_data) == pytest.approx(single["lora_summary"]["eval_loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The schedule trace


def one_f_one_b_order(rank: int, n_ranks: int, n_microbatches: int) -> list[tuple[str, int]]:
    """1F1B as Narayanan et al. 2021 (section 2.2.1) define it: rank r first runs the forwards that fill the
    pipeline below it (p - 1 - r of them), then alternates one forward, one backward, then drains the backwards."""
    warmup = min(n_microbatches, n_ranks - 1 - rank)
    order = [("F", i) for i in range(warmup)]
    for i in range(n_microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(n_microbatches - warmup, n_microbatches)]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_schedule_trace_is_the_schedule_and_causal(pp, schedule):
    summary = summary_of(pp / schedule)
    trace, layout = summary["schedule_trace"], summary["pipeline"]
    p, m, stage_rank = layout["ranks"], layout["microbatches"], layout["stage_rank"]
    last_stage = len(stage_rank) - 1
    assert trace["step"] == STEPS and trace["step"] not in summary["profiled_steps"]
    assert trace["clock"] == "perf_counter"
    assert min(a["start_ms"] for a in trace["actions"]) == 0.0
    by_rank = {r: [a for a in trace["actions"] if a["rank"] == r] for r in range(p)}
    at = {(a["kind"], a["stage"], a["microbatch"]): a for a in trace["actions"]}
    assert len(at) == len(trace["actions"])  # each action once
    for r, actions in by_rank.items():
        assert {a["stage"] for a in actions} == {s for s, owner in enumerate(stage_rank) if owner == r}
        compute = [(a["kind"], a["microbatch"]) for a in actions if a["kind"] != "loss"]
        if schedule == "1f1b":
            assert compute == one_f_one_b_order(r, p, m)
        else:  # F, B (input half) and W (weight half) of every micro-batch on both stages of the V
            for s in {a["stage"] for a in actions}:
                for kind in "FBW":
                    assert sorted(a["microbatch"] for a in actions if a["stage"] == s and a["kind"] == kind) \
                        == list(range(m))
        # One rank computes one thing at a time.
        for before, after in zip(actions, actions[1:]):
            assert before["end_ms"] <= after["start_ms"], (before, after)
        # The step's busy time is these actions' total, inside the schedule's wall time.
        busy = sum(a["end_ms"] - a["start_ms"] for a in actions)
        assert busy == pytest.approx(trace["busy_ms_per_rank"][r], rel=1e-9)
        assert actions[-1]["end_ms"] - actions[0]["start_ms"] <= trace["schedule_ms_per_rank"][r]
    for i in range(m):
        for s in range(last_stage + 1):
            forward, backward = at[("F", s, i)], at[("B", s, i)]
            assert forward["end_ms"] <= backward["start_ms"]
            if s < last_stage:  # activations flow down the stages, gradients back up, across ranks too
                assert forward["end_ms"] <= at[("F", s + 1, i)]["start_ms"]
                assert at[("B", s + 1, i)]["end_ms"] <= backward["start_ms"]
            if ("W", s, i) in at:
                assert backward["end_ms"] <= at[("W", s, i)]["start_ms"]
        loss = at[("loss", last_stage, i)]  # between the last stage's forward and backward of that micro-batch
        assert at[("F", last_stage, i)]["end_ms"] <= loss["start_ms"] <= loss["end_ms"] \
            <= at[("B", last_stage, i)]["start_ms"]


# ---------------------------------------------------------------------------------------------------------------
# Model-state bytes and collective bytes against their predictions


def trainable_tensors_per_layer(lora: bool) -> int:
    model = AutoModelForCausalLM.from_config(model_config("qwen3-tiny"))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])).get_base_model()
    return sum(p.requires_grad for p in model.model.layers[0].parameters())


def test_lora_on_a_bf16_base_tracks_fp32(pp, single):
    got, want = read_losses(pp / "lora-bf16"), [r["loss"] for r in single["lora_records"]]
    assert got == pytest.approx(want, rel=2e-2) and got != pytest.approx(want, rel=1e-6)
    eval_loss = summary_of(pp / "lora-bf16")["eval_loss"]  # the stages hand bf16 hidden states to each other
    assert eval_loss == pytest.approx(single["lora_summary"]["eval_loss"], rel=2e-2)


@pytest.mark.parametrize("run,lora", [("1f1b", False), ("lora-1f1b", True), ("lora-bf16", True), ("bf16", False)])
def test_state_bytes_match_the_memory_model(pp, run, lora):
    """1F1B on 2 ranks (fp32, bf16 weights with fp32 masters, and LoRA on a bf16 base): weights, gradients and master
    as predicted, the LM head copy included (the last rank holds 1 x V x d more); AdamW's state as predicted plus its
    4-byte step counter per trainable tensor."""
    summary = summary_of(pp / run)
    measured, predicted = summary["state_bytes_per_rank"], predict_state_bytes(summary)
    assert summary["state_bytes_step"] == 2
    per_layer = trainable_tensors_per_layer(lora)
    layers = summary["pipeline"]["stage_layers"]
    for rank, (got, want) in enumerate(zip(measured, predicted)):
        assert {key: got[key] for key in ("weights", "grads", "master")} == \
               {key: want[key] for key in ("weights", "grads", "master")}
        roots = 0 if lora else (1 if rank == 0 else 2)  # embedding; final norm + LM head copy
        tensors = per_layer * (layers[rank][1] - layers[rank][0]) + roots
        assert got["optimizer"] == want["optimizer"] + 4 * tensors
    if not lora:  # each end holds one V x d matrix (embedding, LM head copy); the last also the final norm
        hidden, weight_bytes = 256, 2 if run == "bf16" else 4  # bf16: the masters' fp32 gradients, 4 bytes
        assert measured[1]["weights"] - measured[0]["weights"] == weight_bytes * hidden
        assert measured[0]["grads"] * weight_bytes == measured[0]["weights"] * 4
        assert measured[0]["master"] == (measured[0]["grads"] if run == "bf16" else 0)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_collective_bytes_match_the_formula(pp, schedule):
    summary = summary_of(pp / schedule)
    measured, formula = summary["collective_bytes_per_step_per_rank"], predict_collectives(summary)
    assert measured == formula  # per rank, calls and bytes of every backend collective
    # The formula's closed forms (common/comm.py): m = 4 micro-batches of 128 x 256 fp32 hidden states each way
    # per boundary a rank sits on; the tied gradient (8192 x 256 fp32) only when its two copies are on two ranks.
    transfers = {"gpipe": 4, "1f1b": 4, "interleaved-1f1b": 12, "zbv": 8}[schedule]
    tied = schedule != "zbv"
    for rank in range(2):
        assert formula[rank]["gloo:send"] == {"calls": transfers, "bytes": transfers * 128 * 256 * 4}
        assert formula[rank]["gloo:all_reduce"]["bytes"] == 4 + tied * 8192 * 256 * 4


def test_pipeline_formula_closed_forms():
    """pipeline_collectives against its docstring's closed forms, for 4 ranks: loop placement with v = 2 (out_r =
    v - [r = p-1], in_r = v - [r = 0]) and the V (out_r = in_r = [r > 0] + [r < p-1])."""
    p, v, m = 4, 2, 8
    shape = dict(microbatches=m, micro_batch_size=1, seq_len=16, hidden=8, vocab=32, tied_gradients=True)
    loop = [s % p for s in range(p * v)]
    vee = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    for r in range(p):
        sends = pipeline_collectives(loop, r, **shape)["send"]["calls"]
        assert sends == m * ((v - (r == p - 1)) + (v - (r == 0)))
        assert pipeline_collectives(vee, r, **shape)["send"]["calls"] == m * 2 * ((r > 0) + (r < p - 1))
        assert pipeline_collectives(vee, r, **shape)["all_reduce"]["calls"] == 1  # rank 0 holds both ends
        assert pipeline_collectives(loop, r, **shape)["all_reduce"]["calls"] == (2 if r in (0, p - 1) else 1)
    assert "send" not in pipeline_collectives([0, 0], 0, **shape)  # one process: nothing crosses


# ---------------------------------------------------------------------------------------------------------------
# pp-ds-ft: LoRA and collectives


def test_deepspeed_lora_computes_single_ft_lora_steps_and_resumes(pp_ds, single):
    got, want = records(pp_ds / "lora"), single["lora_records"]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
    summary = summary_of(pp_ds / "lora")
    assert summary["eval_loss"] == pytest.approx(single["lora_summary"]["eval_loss"], rel=1e-5)
    assert summary["model"]["trainable_parameters"] == single["lora_summary"]["model"]["trainable_parameters"]
    # The resume recomputes step 3 with activation checkpointing: the same loss, and (eval) the same update, so the
    # first stage's adapters, whose input comes from the frozen embedding, got their gradients under recomputation.
    assert read_losses(pp_ds / "lora-resumed") == pytest.approx([r["loss"] for r in want][2:], rel=1e-5)
    assert summary_of(pp_ds / "lora-resumed")["eval_loss"] == pytest.approx(summary["eval_loss"], rel=1e-5)


def test_deepspeed_lora_bf16_tracks_fp32(pp_ds, single):
    """bf16 runs DeepSpeed's BF16_Optimizer, whose tied-gradient step reads a frozen tied weight's `_hp_grad`."""
    bf16 = read_losses(pp_ds / "lora-bf16")
    fp32 = [r["loss"] for r in single["lora_records"][:2]]
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-6)


def test_deepspeed_lora_exports_load(pp_ds, single, small_data):
    from peft import PeftModel

    want = single["lora_summary"]["eval_loss"]
    adapter = PeftModel.from_pretrained(base_model(), pp_ds / "lora-adapter")
    assert eval_loss_of(adapter, pp_ds / "lora-adapter", small_data) == pytest.approx(want, rel=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(pp_ds / "lora-merged", dtype=torch.float32)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert eval_loss_of(merged, pp_ds / "lora-merged", small_data) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("run", ["zero0", "zero1"])
def test_deepspeed_collective_bytes_match_the_formula(pp_ds, run):
    summary = summary_of(pp_ds / run)
    assert summary["profiled_steps"] == [PROFILED_STEP]
    assert summary["collective_bytes_per_step_per_rank"] == predict_collectives(summary)
