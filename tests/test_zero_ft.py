"""zero-ft against single-ft: DeepSpeed ZeRO stages 1, 2 and 3 (and ZeRO-Offload) on 2 CPU ranks (gloo) compute
single-ft's steps, also with the fast path's flags (--loss-chunk-tokens, --compile, --attn varlen); the model-state
bytes each rank holds against common/memory, the collectives against common/comm.py.

Every 2-rank configuration runs in one torchrun launch (module fixture `launch`): the imports and DeepSpeed's
start-up cost more than the runs themselves. B = 4 rows per step: 2 ranks x 1 row x 2 micro-batches for zero-ft,
1 x 4 for single-ft.
"""

import json
import math
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data import build_data, evaluate
from common.memory import DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD, DEEPSPEED_REDUCE_BUCKET_ELEMENTS, estimate, \
    predict_run, predict_state_bytes
from conftest import load_experiment, read_losses, torchrun
from test_comm import assert_formula_matches, tiny_parameters

pytestmark = pytest.mark.slow  # torchrun launches (the quick tier leaves them out)

single_ft = load_experiment("single-ft")

STEPS = 6
SHARED = ["--seq-len", 128, "--dtype", "fp32", "--steps", STEPS, "--warmup-steps", 2]
ZERO = [*SHARED, "--micro-batch-size", 1, "--grad-accum", 2]  # x 2 ranks
# The fast path's flags run 3 steps (2 with --compile, whose compilation is most of the run's time), compared with the
# first steps of the 6-step reference: with 2 warm-up steps, a step's loss and gradient depend only on the learning
# rates before it, which do not depend on --steps until the third update.
FAST = [*ZERO, "--steps", 3, "--comm-profile-steps", 0]
COMPILED = [*ZERO, "--steps", 2, "--comm-profile-steps", 0, "--compile", "--loss-chunk-tokens", 64]


def checkpoints(out_dir) -> list[str]:
    """The checkpoint folders (DeepSpeed also copies its zero_to_fp32.py converter next to them)."""
    return sorted(p.name for p in (out_dir / "checkpoints").iterdir() if p.name.startswith("step-"))


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def summary(out_dir) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def launch(tmp_path_factory, small_data):
    root = tmp_path_factory.mktemp("zero-ft")
    data = ["--data", small_data]

    def single(name, *args):
        return single_ft.main([*map(str, [*data, *args, "--out-dir", root / name])])

    reference = single("single", *SHARED, "--micro-batch-size", 1, "--grad-accum", 4)
    lora = single("single-lora", *SHARED, "--micro-batch-size", 1, "--grad-accum", 4, "--lora-rank", 4)
    # The reference's initial weights as an HF folder. Loading a folder is the "real checkpoint" route, which ZeRO-3
    # builds inside deepspeed.zero.Init (partitioned at load); presets are built whole, then partitioned.
    single("init", "--seq-len", 128, "--steps", 0, "--save-hf", root / "init-hf")
    # A save of step 6 that crashed half-way, in the out-dir of the run that resumes: a .tmp folder with a torn file.
    torn = root / "resumed" / "checkpoints" / "step-6.tmp"
    torn.mkdir(parents=True)
    (torn / "mp_rank_00_model_states.pt").write_bytes(b"\x80\x02torn")
    quiet = ["--comm-profile-steps", 0]  # no profiler where comm_ms is not looked at
    profile_one = ["--comm-profile-steps", 1]  # the third step's collectives, for common/comm.py's formula
    result = torchrun("zero-ft", [
        [*data, *ZERO, "--zero-stage", 1, "--out-dir", root / "stage1", *profile_one],
        [*data, *ZERO, "--zero-stage", 2, "--out-dir", root / "stage2", "--checkpoint-every", 3, *profile_one],
        [*data, *ZERO, "--zero-stage", 3, "--out-dir", root / "stage3", "--save-hf", root / "stage3-hf", *profile_one],
        [*data, *ZERO, "--zero-stage", 3, "--out-dir", root / "stage3-loaded", "--model", root / "init-hf",
         "--lr", 1e-3, *quiet],  # the preset's default peak LR: a loaded folder would default to 2e-5
        [*data, *ZERO, "--zero-stage", 2, "--out-dir", root / "resumed", "--checkpoint-every", 3, *quiet,
         "--resume", root / "stage2" / "checkpoints" / "step-3"],
        [*data, *ZERO, "--zero-stage", 3, "--out-dir", root / "bf16", "--dtype", "bf16", "--steps", 3, *profile_one],
        [*data, *ZERO, "--zero-stage", 2, "--cpu-offload", "--out-dir", root / "stage2-offload", *profile_one],
        [*data, *ZERO, "--zero-stage", 3, "--out-dir", root / "lora", "--lora-rank", 4, "--save-hf",
         root / "lora-merged", "--merge-lora", *quiet],
        # --sample-every generates between steps (at stage 3 on every rank, in step): the steps must not change.
        [*data, *FAST, "--zero-stage", 3, "--loss-chunk-tokens", 64, "--out-dir", root / "stage3-chunked",
         "--sample-every", 2],
        [*data, *FAST, "--zero-stage", 3, "--attn", "varlen", "--out-dir", root / "stage3-varlen"],
        [*data, *COMPILED, "--zero-stage", 2, "--out-dir", root / "stage2-compiled"],
    ])
    (root / "output.txt").write_text(result.stdout + result.stderr)
    return root, reference, lora


@pytest.mark.parametrize("run", ["stage1", "stage2", "stage3", "stage3-loaded", "stage2-offload"])
def test_every_stage_computes_the_single_process_steps(launch, run):
    root, *_ = launch
    expected, got = records(root / "single"), records(root / run)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    # The gradient itself, before clipping: DeepSpeed's 1/grad_accum and rank averaging were undone (a factor 2 or 4
    # would show here, while Adam's scale invariance hides it from the losses). 1e-3, not 1e-5: DeepSpeed sums the
    # squares in fp64, single-ft's clip_grad_norm_ in fp32, which on CPU is ~5e-4 off for the 2M-entry embedding.
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in expected], rel=1e-3)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in expected], rel=1e-9)
    assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]  # counted over both ranks
    assert expected[-1]["loss"] < expected[0]["loss"] - 0.5  # the steps really trained
    assert summary(root / run)["eval_loss"] == pytest.approx(summary(root / "single")["eval_loss"], rel=1e-5)


def test_fast_path_flags_compute_the_single_process_steps(launch):
    """--loss-chunk-tokens under ZeRO-3 (the LM head's weight gathered by hand around the loss and its backward),
    --attn varlen under ZeRO-3's hooks, and --compile with the chunked loss at stage 2, each on the first steps of
    the reference."""
    root, *_ = launch
    expected = records(root / "single")
    assert summary(root / "single")["attention"]["impl"] == "sdpa"  # the block-diagonal mask varlen replaces
    for run, steps, rel in (("stage3-chunked", 3, 1e-5), ("stage3-varlen", 3, 1e-5), ("stage2-compiled", 2, 1e-4)):
        got = records(root / run)
        assert [r["step"] for r in got] == list(range(1, steps + 1)), run
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected[:steps]], rel=rel), run
        # A head gradient left out of ZeRO's reduction, or reduced twice, would show in the norm.
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in expected[:steps]],
                                                             rel=1e-3), run
    # The runs took the other paths: the chunked loss, the varlen attention (on CPU its per-document reference),
    # the compiled layers.
    chunked, varlen, compiled = (summary(root / run) for run in ("stage3-chunked", "stage3-varlen", "stage2-compiled"))
    assert chunked["config"]["loss_chunk_tokens"] == 64 and chunked["attention"]["impl"] == "sdpa"
    assert varlen["attention"]["impl"] == "varlen" and varlen["attention"]["varlen_kernel"] == "reference"
    assert varlen["config"]["loss_chunk_tokens"] == 0
    assert compiled["config"]["compile"] and compiled["config"]["loss_chunk_tokens"] == 64
    assert compiled["zero_stage"] == 2 and chunked["zero_stage"] == varlen["zero_stage"] == 3
    # The third update too: both runs end with the same weights, evaluated through their own attention.
    assert varlen["eval_loss"] == pytest.approx(chunked["eval_loss"], rel=1e-5)
    # --sample-every 2 on the chunked run: a completion after step 2 (rank 0 prints it), and step 3 above unchanged.
    assert (root / "output.txt").read_text().count("sample step 2: ") == 1


def test_compile_is_refused_at_stage_3_with_the_reason():
    zero_ft = load_experiment("zero-ft")
    zero_ft.resolve(zero_ft.Config(compile=True, zero_stage=2))  # accepted
    with pytest.raises(SystemExit) as refusal:
        zero_ft.resolve(zero_ft.Config(compile=True, zero_stage=3))
    message = str(refusal.value)
    assert message.startswith("--compile needs --zero-stage 1 or 2: ZeRO-3 gathers") and "\n" not in message


def test_resume_equals_the_uninterrupted_run_and_ignores_a_torn_save(launch):
    root, *_ = launch
    uninterrupted, resumed = read_losses(root / "stage2"), read_losses(root / "resumed")
    assert checkpoints(root / "stage2") == ["step-3", "step-6"]
    assert len(resumed) == 3
    assert resumed == pytest.approx(uninterrupted[3:], rel=1e-5)
    assert [r["step"] for r in records(root / "resumed")] == [4, 5, 6]
    # The torn step-6.tmp was never read; the resumed run's own save of step 6 cleared it and published a whole one.
    assert checkpoints(root / "resumed") == ["step-6"]
    step_6 = root / "resumed" / "checkpoints" / "step-6"
    saved = {p.name for p in step_6.iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "mp_rank_00_model_states.pt"} <= saved
    assert (step_6 / "mp_rank_00_model_states.pt").stat().st_size > 1000


def test_zero3_export_reloads_in_one_process_with_the_same_eval_loss(launch, small_data):
    root, reference, _ = launch
    export = root / "stage3-hf"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export)
    reloaded = evaluate(model, build_data(small_data, tokenizer, 128, seed=0), 1, torch.device("cpu"), nullcontext)
    assert reloaded == pytest.approx(summary(root / "stage3")["eval_loss"], rel=1e-5)
    assert reloaded == pytest.approx(reference["eval_loss"], rel=1e-5)  # the same weights single-ft ends with


def test_peak_memory_is_recorded_per_rank(launch):
    root, *_ = launch
    for run, stage in [("stage1", 1), ("stage2", 2), ("stage3", 3)]:
        result = summary(root / run)
        assert result["zero_stage"] == stage and result["hardware"]["world_size"] == 2
        per_rank = result["peak_mem_gib_per_rank"]
        # On CPU this is each process's peak RSS, mostly the Python/torch runtime: no ordering between stages.
        assert len(per_rank) == 2 and all(gib > 0 for gib in per_rank), per_rank
        assert result["memory_measure"] == "peak RSS of the process (CPU)"
        assert result["deepspeed"]["config"]["zero_optimization"]["stage"] == stage
        assert result["deepspeed"]["config"]["gradient_clipping"] == 1.0  # --max-grad-norm, set explicitly


def test_bf16_holds_bf16_weights_and_tracks_fp32(launch):
    root, *_ = launch
    # Its 3 steps see the 6-step reference's learning rates (warm-up of 2, then the cosine starts at the peak).
    fp32, bf16 = read_losses(root / "single")[:3], read_losses(root / "bf16")
    # bf16 weights and activations (fp32 master weights in the optimizer): close to fp32, but not fp32 in disguise.
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-6)


def test_lora_trains_only_the_adapters_and_the_merged_export_reloads(launch, small_data):
    root, _, lora = launch
    got = summary(root / "lora")
    assert got["model"]["trainable_parameters"] == lora["model"]["trainable_parameters"] < 100_000
    assert read_losses(root / "lora") == pytest.approx(read_losses(root / "single-lora"), rel=1e-5)
    model = AutoModelForCausalLM.from_pretrained(root / "lora-merged", dtype=torch.float32)
    assert not any("lora" in name for name, _ in model.named_parameters())
    data = build_data(small_data, AutoTokenizer.from_pretrained(root / "lora-merged"), 128, seed=0)
    reloaded = evaluate(model, data, 1, torch.device("cpu"), nullcontext)
    assert reloaded == pytest.approx(lora["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("run", ["stage1", "stage2", "stage3", "bf16", "stage2-offload"])
def test_collective_bytes_equal_the_formula(launch, run):
    root, *_ = launch
    assert_formula_matches(summary(root / run))


def gradients_kept_whole(world_size: int, rank: int) -> int:
    """Elements of the gradients ZeRO stages 1-2 keep on `rank` (DeepSpeed's grads_in_partition): every parameter
    that overlaps the rank's partition of a parameter group, whole. zero-ft's groups: matrices, then vectors."""
    shapes = [shape for _, shape in tiny_parameters()]
    total = 0
    for numels in ([math.prod(s) for s in shapes if len(s) >= 2], [math.prod(s) for s in shapes if len(s) < 2]):
        padded = -(-sum(numels) // (2 * world_size)) * 2 * world_size  # the flat group, aligned to 2 W elements
        low, high = rank * padded // world_size, (rank + 1) * padded // world_size
        starts = [sum(numels[:i]) for i in range(len(numels))]
        total += sum(n for start, n in zip(starts, numels) if start < high and start + n > low)
    return total


def test_model_state_bytes_are_the_predicted_ones(launch):
    root, *_ = launch
    numels = [math.prod(shape) for _, shape in tiny_parameters()]
    psi, world = sum(numels), 2
    persistent = sum(n for n in numels if n <= DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD)  # kept whole on every rank
    counters = 4 * 2  # AdamW's step counters: one per parameter group (one flat tensor each), not in common/memory
    runs = {stage: summary(root / f"stage{stage}") for stage in (1, 2, 3)}
    for stage, result in runs.items():
        predicted = predict_state_bytes(result)[0]
        assert result["state_bytes_step"] == 2 and len(result["state_bytes_per_rank"]) == world
        for rank, measured in enumerate(result["state_bytes_per_rank"]):
            # Every stage: AdamW's moments of this rank's fp32 partition, and that partition itself, a master copy
            # DeepSpeed clones even in fp32.
            assert measured["optimizer"] == predicted["optimizer"] + counters == 8 * psi // world + counters
            assert measured["master"] == predicted["master"] == 4 * psi // world
            if stage < 3:
                # Whole weights; the reduce bucket exists only during backward.
                assert measured["weights"] == predicted["weights"] == 4 * psi
                assert measured["buffers"] == 0
                # After the last backward both stages hold only the reduced gradients of their partition, whole
                # for the parameters that straddle its edges: more than 4 Psi / W by those parameters' other
                # parts. Stage 1 held full gradients (common/memory's 4 Psi) until this backward reduced them.
                assert measured["grads"] == 4 * gradients_kept_whole(world, rank) > 4 * psi // world
                assert predicted["grads"] == (4 * psi if stage == 1 else 4 * psi // world)
            else:
                # Every parameter's partition, plus whole copies of the persistent ones (which keep their
                # partition too).
                assert measured["weights"] == predicted["weights"] == 4 * psi // world + 4 * persistent
                assert measured["grads"] == predicted["grads"] == 4 * psi // world
                # The fp32 reduce bucket, held for the whole run.
                assert measured["buffers"] == 4 * DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    # ZeRO-Offload: the device keeps the weights; the fp32 gradient partition, master partition and AdamW state are
    # in host memory, where common/memory predicts them (with its staging buffers besides).
    offload = summary(root / "stage2-offload")
    host = estimate("qwen3-tiny", "zero-2-offload", world, seq_len=128, precision="fp32")
    assert int(predict_run(offload).cpu_bytes) == int(host.cpu_bytes)
    for measured in offload["state_bytes_per_rank"]:
        assert measured["weights"] == predict_state_bytes(offload)[0]["weights"] == 4 * psi
        assert measured["grads"] == 4 * psi // world
        host_states = measured["grads"] + measured["optimizer"] + measured["master"]
        assert host_states == host.cpu_bytes - host.cpu_buffers_bytes + counters == 16 * psi // world + counters
