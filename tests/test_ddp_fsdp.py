"""ddp-ft and fsdp-ft against single-ft (2 ranks, gloo, CPU): same per-step losses on the same B, bf16, LoRA,
the FSDP memory options, the fast path's flags (--loss-chunk-tokens, --compile, --attn varlen), checkpoint/resume
(also after a save that died half-way), and the HF export; the model-state bytes each rank holds against
common/memory, the collectives' calls and bytes against common/comm.py, and the host reads of a step.

Both experiments run all their configurations in ONE torchrun launch (a module-scoped fixture; `ddp` and `fsdp`
are each experiment's folder, holding one --out-dir per configuration); the single-ft references run once, in this
process.
"""

import json
import math
import shutil
import sys
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.checkpoint import load_checkpoint
from common.memory import predict_run, predict_state_bytes
from common.data import build_data, evaluate
from conftest import REPO_ROOT, load_experiment, load_infer, read_losses, torchrun
from test_comm import assert_formula_matches, tiny_parameters

pytestmark = pytest.mark.slow  # torchrun launches (the quick tier leaves them out)

single_ft = load_experiment("single-ft")
ddp_ft = load_experiment("ddp-ft")
fsdp_ft = load_experiment("fsdp-ft")

STEPS = 6  # every compared run has the same --steps (the cosine schedule depends on it); resume from step 3
FP32 = ("--seq-len", 128, "--dtype", "fp32", "--warmup-steps", 2)
# torch.profiler slows a step on this CPU: the runs whose comm_ms or collectives are checked profile one step
# (PROFILE_ONE), the others none.
NO_PROFILE = ("--comm-profile-steps", 0)
# One profiled step, the third (after the 2 timing warm-up steps, and after DDP has rebuilt its buckets): its
# collectives are compared with common/comm.py's formula.
PROFILE_ONE = ("--comm-profile-steps", 1)
LORA = ("--lora-rank", 4, "--steps", 3)
# The fast path's flags run 3 steps (2 with --compile, whose compilation is most of the run's time), compared with the
# first steps of the 6-step reference: with 2 warm-up steps, a step's loss and gradient depend only on the learning
# rates before it, which do not depend on --steps until the third update.
FAST = ("--steps", 3, *NO_PROFILE)
COMPILED = ("--steps", 2, *NO_PROFILE, "--compile", "--loss-chunk-tokens", 64)


def split(micro: int, accum: int) -> tuple:
    return "--micro-batch-size", micro, "--grad-accum", accum


def argv(*args) -> list[str]:
    return [str(a) for a in args]


def records(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def summary(out_dir) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


def reloaded_eval_loss(export, small_data) -> tuple[float, torch.nn.Module]:
    """Load an exported folder in this (single) process and evaluate it as single-ft's evaluate does."""
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    data = build_data(small_data, AutoTokenizer.from_pretrained(export), 128, seed=0)
    return evaluate(model, data, 1, torch.device("cpu"), nullcontext), model


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data):
    """single-ft on B = 4 rows (1 x 4): full SFT for STEPS steps, LoRA for 3, bf16 for 3."""
    root = tmp_path_factory.mktemp("single-ft")
    single_ft.main(argv("--data", small_data, *FP32, *NO_PROFILE, *split(1, 4), "--steps", STEPS,
                        "--out-dir", root / "full"))
    single_ft.main(argv("--data", small_data, *FP32, *NO_PROFILE, *split(1, 4), "--steps", 3, "--dtype", "bf16",
                        "--out-dir", root / "bf16"))
    single_ft.main(argv("--data", small_data, *FP32, *NO_PROFILE, *split(1, 4), *LORA, "--out-dir", root / "lora"))
    return root


def runs_of(experiment, root, small_data, runs: dict[str, list]) -> list[list]:
    """[experiment, *argv] for tests/run_many.py: each of `runs` (name -> extra flags) into root/<name>."""
    return [[experiment, "--data", small_data, *FP32, *args, "--out-dir", root / name] for name, args in runs.items()]


def split_output(stdout: str, roots: list) -> dict:
    """Rank 0's output of a shared launch, cut per experiment: each main() prints its `config: {...}` line first,
    whose out_dir says which root the lines up to the next config line belong to (lines after the last config line,
    such as preflight's table, to that root as well)."""
    lines, root = {r: [] for r in roots}, roots[0]
    for line in stdout.splitlines(keepends=True):
        if line.startswith("config: {"):
            root = next(r for r in roots if str(r) in json.loads(line[len("config: "):])["out_dir"])
        lines[root].append(line)
    return {r: "".join(text) for r, text in lines.items()}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, small_data, formats):
    """Every ddp-ft and every fsdp-ft configuration, and common.preflight, in ONE launch of 2 ranks (one round of
    imports): two torchrun agents of one rank each, meeting at a c10d rendezvous as two nodes would, so every
    comparison with single-ft below is also the multi-node test (RANK 0 and 1, LOCAL_RANK 0 on both: a script that
    took its data shard from LOCAL_RANK would give both ranks the same rows). B = 4 rows as in the reference. Each
    experiment's root holds one --out-dir per configuration and output.txt, rank 0's lines of its runs."""
    ddp_root, fsdp_root = tmp_path_factory.mktemp("ddp-ft"), tmp_path_factory.mktemp("fsdp-ft")
    ddp_runs = {
        "1x2": [*split(1, 2), "--steps", STEPS, *PROFILE_ONE, "--checkpoint-every", 3, "--save-hf", ddp_root / "hf"],
        "resumed": [*split(1, 2), "--steps", STEPS, *NO_PROFILE, "--resume",
                    ddp_root / "1x2" / "checkpoints" / "step-3"],
        # 1 MiB buckets: 9 all-reduces per step instead of one, the same sums.
        "2x1": [*split(2, 1), "--steps", STEPS, *PROFILE_ONE, "--bucket-cap-mb", 1],
        # Every micro-batch's backward all-reduces (no no_sync()): the same step, twice the gradient traffic.
        "1x2-every": [*split(1, 2), "--steps", STEPS, *PROFILE_ONE, "--bucket-cap-mb", 1,
                      "--reduce-every-micro-batch"],
        "lora": [*split(1, 2), *LORA, *NO_PROFILE, "--activation-checkpointing", "--save-hf", ddp_root / "lora-merged",
                 "--merge-lora"],
        "lora-bf16": [*split(1, 2), *LORA, *NO_PROFILE, "--dtype", "bf16"],  # a bf16 base; the later --dtype wins
        "lora-fused": [*split(1, 2), *LORA, *NO_PROFILE, "--lora-fused"],
        # --sample-every generates between steps (under FSDP on every rank): the steps must not change.
        "chunked": [*split(1, 2), *FAST, "--loss-chunk-tokens", 64, "--sample-every", 2],
        "varlen": [*split(1, 2), *FAST, "--attn", "varlen"],
        "compiled": [*split(1, 2), *COMPILED],
        # bf16 weights, fp32 masters (common/precision.py), 3 steps as fsdp's "bf16": 1 MiB buckets of bf16 weights
        # (6 all-reduces of fp32 master gradients), a checkpoint at step 2; its third step resumed from there, with
        # every micro-batch reduced (one bucket).
        "bf16": [*split(1, 2), "--steps", 3, *PROFILE_ONE, "--dtype", "bf16", "--bucket-cap-mb", 1,
                 "--checkpoint-every", 2],
        "bf16-resumed": [*split(1, 2), "--steps", 3, *NO_PROFILE, "--dtype", "bf16", "--reduce-every-micro-batch",
                         "--resume", ddp_root / "bf16" / "checkpoints" / "step-2"],
    }
    fsdp_runs = {
        "1x2": [*split(1, 2), "--steps", STEPS, *PROFILE_ONE, "--checkpoint-every", 3, "--save-hf", fsdp_root / "hf"],
        "resumed": [*split(1, 2), "--steps", STEPS, *NO_PROFILE, "--resume",
                    fsdp_root / "1x2" / "checkpoints" / "step-3"],
        "2x1": [*split(2, 1), "--steps", STEPS, *PROFILE_ONE],
        # 3 steps (bf16 costs ~5x fp32 on this CPU): the profiled third is the last. Their learning rates are the
        # 6-step run's (2 warm-up steps, then the cosine's first value), so its first 3 losses compare.
        "bf16": [*split(1, 2), "--steps", 3, *PROFILE_ONE, "--dtype", "bf16"],  # the later --dtype wins
        # An eval between steps leaves the gathered weights in place (no backward reshards them): the next step
        # must still see the updated ones.
        # Profiled: the fourth step (3 timing warm-up steps), which no evaluation precedes (the formula's steady state).
        "options": [*split(1, 2), "--steps", STEPS, *PROFILE_ONE, "--timing-warmup-steps", 3,
                    "--no-reshard-after-forward", "--activation-checkpointing", "--cpu-offload",
                    "--reduce-every-micro-batch", "--eval-every", 2],
        # The weights gathered once per optimizer step, kept through both micro-batches' forward and backward.
        "gather-once": [*split(1, 2), "--steps", STEPS, *PROFILE_ONE, "--no-reshard-after-forward",
                        "--no-reshard-after-backward"],
        "lora": [*split(1, 2), *LORA, *NO_PROFILE, "--save-hf", fsdp_root / "lora-merged", "--merge-lora"],
        "lora-bf16": [*split(1, 2), *LORA, *NO_PROFILE, "--dtype", "bf16"],
        "lora-fused": [*split(1, 2), *LORA, *NO_PROFILE, "--lora-fused"],  # inside each layer's gathered unit
        # --sample-every generates between steps (under FSDP on every rank): the steps must not change.
        "chunked": [*split(1, 2), *FAST, "--loss-chunk-tokens", 64, "--sample-every", 2],
        "varlen": [*split(1, 2), *FAST, "--attn", "varlen"],
        "compiled": [*split(1, 2), *COMPILED],
        # A CSV under its own column names (--data-columns) against the same records as prompt/completion JSONL:
        # fsdp-ft hands its data flags to build_data. That parquet, ShareGPT JSON and save_to_disk folders read as
        # their JSONL is tests/test_data.py's, in one process.
        "pairs.jsonl": [*split(1, 2), "--steps", 2, *NO_PROFILE, "--data", formats / "pairs.jsonl"],
        "pairs.csv": [*split(1, 2), "--steps", 2, *NO_PROFILE, "--data", formats / "pairs.csv",
                      "--data-columns", "prompt=question,completion=answer"],
    }
    preflight = [["preflight", "--sizes-mb", 1, "--iters", 2, "--expect-world-size", 2, "--json",
                  fsdp_root / "preflight.json"]]
    result = torchrun("+", [*runs_of("ddp-ft", ddp_root, small_data, ddp_runs),
                            *runs_of("fsdp-ft", fsdp_root, small_data, fsdp_runs), *preflight], nodes=2)
    for out, text in split_output(result.stdout, [ddp_root, fsdp_root]).items():
        (out / "output.txt").write_text(text + result.stderr)
    return ddp_root, fsdp_root


@pytest.fixture(scope="module")
def ddp(launched):
    return launched[0]


@pytest.fixture(scope="module")
def fsdp(launched):
    return launched[1]


# ---------------------------------------------------------------------------------------------------------------
# Both experiments


@pytest.mark.parametrize("experiment", ["ddp", "fsdp"])
def test_losses_equal_single_ft_on_the_same_batch(experiment, request, reference):
    runs = request.getfixturevalue(experiment)
    expected = records(reference / "full")
    for name in ("1x2", "2x1"):  # 2 ranks x 1 row x 2 micro-batches; 2 ranks x 2 rows x 1 micro-batch
        got = records(runs / name)
        assert len(got) == STEPS, name
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5), name
        # The norm of the reduced gradient: every rank's rows counted once, the tied embedding once. Not to 1e-5:
        # PyTorch's fp32 norm on CPU accumulates in fp32, ~1e-4 relative error over the 2M-element embedding
        # gradient, and FSDP takes it per shard (two 1M halves, closer to the float64 value than single-ft's).
        # A wrong reduction (a missing x world_size, a tie counted twice) is off by tens of percent.
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in expected], rel=1e-3), name
        assert [r["tokens"] for r in got] == [r["tokens"] for r in expected]  # tokens of all ranks
    assert expected[-1]["loss"] < expected[0]["loss"] - 0.5  # the steps really trained
    run = summary(runs / "1x2")
    assert run["hardware"]["world_size"] == 2 and run["t_eff"] == 4 * 128
    assert run["comm_ms"] > 0  # gloo collectives found by the profiler in the measured window
    assert run["eval_loss"] == pytest.approx(summary(reference / "full")["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("experiment", ["ddp", "fsdp"])
def test_lora_equals_single_ft_lora_and_merges(experiment, request, reference, small_data):
    runs = request.getfixturevalue(experiment)
    assert read_losses(runs / "lora") == pytest.approx(read_losses(reference / "lora"), rel=1e-5)
    run, single = summary(runs / "lora"), summary(reference / "lora")
    assert run["model"]["trainable_parameters"] == single["model"]["trainable_parameters"] < 100_000
    loss, model = reloaded_eval_loss(runs / "lora-merged", small_data)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert loss == pytest.approx(run["eval_loss"], rel=1e-5)
    # --lora-fused (common/lora.py): the same steps as single-ft's unfused LoRA, under DDP's gradient hooks and
    # inside FSDP's gathered layer units.
    assert read_losses(runs / "lora-fused") == pytest.approx(read_losses(reference / "lora"), rel=1e-5)
    assert summary(runs / "lora-fused")["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("experiment", ["ddp", "fsdp"])
def test_lora_on_a_bf16_base_tracks_fp32_and_holds_the_prediction(experiment, request, reference):
    """--dtype bf16 under LoRA: each rank holds the frozen base in bf16 (its FSDP shard of it), the adapters and
    their AdamW state in fp32; the steps track single-ft's fp32 LoRA within bf16 rounding."""
    runs = request.getfixturevalue(experiment)
    got, want = read_losses(runs / "lora-bf16"), read_losses(reference / "lora")
    assert got == pytest.approx(want, rel=2e-2) and got != pytest.approx(want, rel=1e-6)
    run = summary(runs / "lora-bf16")
    base, adapters = run["model"]["parameters"], run["model"]["trainable_parameters"]
    shards = 2 if experiment == "fsdp" else 1
    counters = 4 * 2 * 4 * 7 // shards * shards  # AdamW's step: one fp32 scalar per adapter tensor, on every rank
    # ddp-ft: bf16 adapters too, beside their fp32 masters (common/precision.py), as single-ft; fsdp-ft's adapters are
    # fp32 shards, gathered in bf16.
    adapter_bytes = 2 if experiment == "ddp" else 4
    assert (run.get("master_weights") is not None) == (experiment == "ddp")
    for held in run["state_bytes_per_rank"]:
        assert held["weights"] == (2 * base + adapter_bytes * adapters) / shards
        assert held["master"] == (4 * adapters if experiment == "ddp" else 0)
        assert {**held, "optimizer": held["optimizer"] - counters} == predict_state_bytes(run)[0]


@pytest.mark.parametrize("experiment", ["ddp", "fsdp"])
def test_fast_path_flags_compute_single_ft_steps(experiment, request, reference):
    """--loss-chunk-tokens, --attn varlen, and --compile with the chunked loss, each on the first steps of the
    reference. The chunked loss runs the wrapped model whole (its forward arms DDP's gradient hooks; FSDP's root
    gathers the LM head): a forward that bypassed the wrapper would leave each rank stepping on its own gradient."""
    runs = request.getfixturevalue(experiment)
    expected = records(reference / "full")
    assert summary(reference / "full")["attention"]["impl"] == "sdpa"  # the block-diagonal mask varlen replaces
    for name, steps, rel in (("chunked", 3, 1e-5), ("varlen", 3, 1e-5), ("compiled", 2, 1e-4)):
        got = records(runs / name)
        assert [r["step"] for r in got] == list(range(1, steps + 1)), name
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected[:steps]], rel=rel), name
        # A gradient summed on one rank only, or a tie counted twice, is off by tens of percent (see above).
        assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in expected[:steps]],
                                                             rel=1e-3), name
    # The runs took the other paths: the chunked loss, the varlen attention (on CPU its per-document reference),
    # the compiled layers.
    chunked, varlen, compiled = (summary(runs / name) for name in ("chunked", "varlen", "compiled"))
    assert chunked["config"]["loss_chunk_tokens"] == 64 and chunked["attention"]["impl"] == "sdpa"
    assert varlen["attention"]["impl"] == "varlen" and varlen["attention"]["varlen_kernel"] == "reference"
    assert varlen["config"]["loss_chunk_tokens"] == 0
    assert compiled["config"]["compile"] and compiled["config"]["loss_chunk_tokens"] == 64
    # The third update too: both runs end with the same weights, evaluated through their own attention.
    assert varlen["eval_loss"] == pytest.approx(chunked["eval_loss"], rel=1e-5)
    # --sample-every 2 on the chunked run: a completion after step 2 (rank 0 prints it), and step 3 above unchanged.
    assert (runs / "output.txt").read_text().count("sample step 2: ") == 1


@pytest.mark.parametrize("module", [ddp_ft, fsdp_ft], ids=["ddp", "fsdp"])
def test_the_step_reads_the_device_once(module, small_data, tmp_path, monkeypatch):
    """The training loop waits for the device once per optimizer step: the step line's loss and gradient norm,
    read together, also with the chunked loss and varlen. Counted on CPU in a 1-rank run by wrapping every Tensor
    method that copies a value to the host, for calls made from the script itself, as tests/test_single_ft.py
    counts single-ft's (syncs inside libraries are the GPU suite's to count)."""
    script = str(REPO_ROOT / "experiments" / module.EXPERIMENT / "train.py")
    calls = []

    def counting(method):
        def wrapper(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename == script:
                calls.append(method.__name__)
            return method(self, *args, **kwargs)
        return wrapper

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    module.main(argv("--data", small_data, *FP32, *NO_PROFILE, *split(2, 2), "--steps", 3, "--eval-fraction", 0,
                     "--loss-chunk-tokens", 64, "--attn", "varlen", "--out-dir", tmp_path))
    assert Counter(calls) == Counter({"tolist": 3})
    assert not torch.distributed.is_initialized()  # the 1-rank group the script made is gone


@pytest.mark.parametrize("experiment", ["ddp", "fsdp"])
def test_resume_equals_the_uninterrupted_run(experiment, request):
    runs = request.getfixturevalue(experiment)
    checkpoints = runs / "1x2" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-3", "step-6"]
    assert {"trainer_state_rank0.pt", "trainer_state_rank1.pt", ".metadata"} <= {
        p.name for p in (checkpoints / "step-3").iterdir()}
    resumed = read_losses(runs / "resumed")
    assert len(resumed) == STEPS - 3
    assert resumed == pytest.approx(read_losses(runs / "1x2")[3:], rel=1e-5)


@pytest.mark.parametrize("experiment", ["ddp", "fsdp"])
def test_save_hf_reloads_in_one_process_with_the_same_eval_loss(experiment, request, small_data):
    runs = request.getfixturevalue(experiment)
    loss, model = reloaded_eval_loss(runs / "hf", small_data)
    assert loss == pytest.approx(summary(runs / "1x2")["eval_loss"], rel=1e-5)
    # Qwen3 ties the embedding and the LM head: the export must keep one matrix, not two copies.
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # experiments/infer.py reads the same export: its --eval-data gives the number training printed, and it answers.
    infer = load_infer()
    assert infer.main(["--model", runs / "hf", "--eval-data", small_data, "--seq-len", 128]) == \
        pytest.approx(summary(runs / "1x2")["eval_loss"], rel=1e-5)
    assert isinstance(infer.main(["--model", runs / "hf", "--prompt", "Hi", "--max-new-tokens", 4])[0], str)


# ---------------------------------------------------------------------------------------------------------------
# DDP only


def test_ddp_bf16_computes_single_ft_s_bf16_steps_and_resumes_exactly(ddp, reference):
    """--dtype bf16: bf16 weights and fp32 masters that AdamW updates (common/precision.py), as single-ft. Each
    micro-batch's bf16 gradients are added into the masters' fp32 ones, and DDP's comm hook all-reduces those sums
    (bucket by bucket, once per step): both scripts sum the same bf16 gradients in fp32, in another order, so the
    steps agree to fp32 rounding (measured 1e-7 relative; under autocast the first loss alone was 2.5e-5 away).
    Resumed from step 2's checkpoint (the masters and AdamW's state), the third step's loss is the uninterrupted
    run's, bit for bit; resumed with every micro-batch reduced, each one's mean is added once: its gradient and the
    update it makes are single-ft's too."""
    want, reference_summary = records(reference / "bf16"), summary(reference / "bf16")
    got, run = records(ddp / "bf16"), summary(ddp / "bf16")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-6)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
    assert run["eval_loss"] == pytest.approx(reference_summary["eval_loss"], rel=1e-6)
    assert run["master_weights"] == reference_summary["master_weights"]
    fp32 = read_losses(ddp / "1x2")[:3]
    assert read_losses(ddp / "bf16") == pytest.approx(fp32, rel=2e-2)
    assert read_losses(ddp / "bf16") != pytest.approx(fp32, rel=1e-6)  # it did compute in bf16
    (resumed,) = records(ddp / "bf16-resumed")
    assert resumed["step"] == 3 and resumed["loss"] == got[2]["loss"]
    assert resumed["grad_norm"] == pytest.approx(want[2]["grad_norm"], rel=1e-5)
    assert summary(ddp / "bf16-resumed")["eval_loss"] == pytest.approx(reference_summary["eval_loss"], rel=1e-6)


def test_ddp_bf16_sends_fp32_gradients_and_holds_the_predicted_states(ddp):
    """DDP buckets the bf16 weights, but each bucket all-reduces its masters' fp32 gradients: in 1 MiB buckets, the
    bytes of fp32 DDP's 1 MiB buckets in fewer calls (twice the gradients a bucket). Each rank holds the bf16
    weights 2, DDP's bf16 buckets 2 (its .grad are views of them) beside the masters' fp32 gradients 4, the fp32
    masters 4 and AdamW's moments 8 bytes a parameter: common.memory's MASTER_BF16 with DDP's buckets."""
    bf16, fp32 = (summary(ddp / name)["collective_bytes_per_step"]["gloo:all_reduce"] for name in ("bf16", "2x1"))
    assert bf16["bytes"] == fp32["bytes"] and bf16["calls"] < fp32["calls"]
    run = summary(ddp / "bf16")
    n = run["model"]["trainable_parameters"]
    counters = 4 * run["master_weights"]["tensors"]  # AdamW's fp32 step, one per tensor, which it does not price
    for held in run["state_bytes_per_rank"]:
        assert held == {"weights": 2 * n, "grads": (2 + 4) * n, "optimizer": 8 * n + counters, "master": 4 * n}
        assert {**held, "optimizer": held["optimizer"] - counters} == predict_state_bytes(run)[0]


# ---------------------------------------------------------------------------------------------------------------
# FSDP only


def test_fsdp_trains_a_csv_with_its_own_column_names(fsdp):
    pairs = read_losses(fsdp / "pairs.jsonl")
    assert read_losses(fsdp / "pairs.csv") == pytest.approx(pairs, rel=1e-6)
    assert pairs != pytest.approx(read_losses(fsdp / "1x2")[:2], rel=1e-3)  # other records: other steps


def test_fsdp_bf16_tracks_fp32(fsdp):
    fp32, bf16 = read_losses(fsdp / "1x2")[:3], read_losses(fsdp / "bf16")
    assert len(bf16) == 3
    # bf16 compute (weights gathered in bf16, fp32 master shards and fp32 gradient reduction): about 1%, not 1e-5.
    assert bf16 == pytest.approx(fp32, rel=2e-2)
    assert bf16 != pytest.approx(fp32, rel=1e-6)


def test_fsdp_bf16_computes_single_ft_s_bf16_steps(fsdp, reference):
    """Under --dtype bf16 both keep fp32 masters and compute in bf16 weights without autocast (fsdp-ft: FSDP2's
    MixedPrecisionPolicy; single-ft: common/precision.py): the same bf16 forward, so the first step's loss is the
    same to fp32 rounding (single-ft under autocast, its residual stream fp32, was 2.5e-5 away), the next within
    bf16 rounding of each other's updates."""
    got, want = read_losses(fsdp / "bf16"), read_losses(reference / "bf16")
    assert len(got) == len(want) == 3
    assert got == pytest.approx(want, rel=2e-2)
    assert got[0] == pytest.approx(want[0], rel=1e-6)


def test_fsdp_memory_options_change_nothing_but_memory(fsdp):
    # --no-reshard-after-forward, --activation-checkpointing, --cpu-offload, --reduce-every-micro-batch together,
    # with evaluations between steps.
    assert read_losses(fsdp / "options") == pytest.approx(read_losses(fsdp / "1x2"), rel=1e-5)
    options = summary(fsdp / "options")
    assert [step for step, _ in options["eval_history"]] == [2, 4]
    assert options["eval_loss"] == pytest.approx(summary(fsdp / "1x2")["eval_loss"], rel=1e-5)


def test_fsdp_gathers_the_weights_once_per_step_without_resharding(fsdp):
    """--no-reshard-after-forward --no-reshard-after-backward at GA 2: the same steps as the default, and every unit
    (the root and 4 layers) all-gathered once per optimizer step, its shard in fp32: 4 bytes x Psi / 2 per step,
    where the default gathers 2 x 5 - 1 units per micro-batch."""
    assert read_losses(fsdp / "gather-once") == pytest.approx(read_losses(fsdp / "1x2"), rel=1e-5)
    once, default = summary(fsdp / "gather-once"), summary(fsdp / "1x2")
    psi = sum(math.prod(shape) for _, shape in tiny_parameters())
    assert once["collective_bytes_per_step"]["gloo:all_gather"] == {"calls": 5, "bytes": 4 * psi // 2}
    assert default["collective_bytes_per_step"]["gloo:all_gather"]["calls"] == 2 * (5 + 4)
    assert once["collective_bytes_per_step"]["gloo:all_reduce"] == default["collective_bytes_per_step"]["gloo:all_reduce"]
    with pytest.raises(SystemExit, match="add --no-reshard-after-forward"):
        fsdp_ft.resolve(fsdp_ft.Config(model="qwen3-tiny", reshard_after_backward=False))


def test_fsdp_checkpoint_of_a_killed_save_resumes_from_the_previous_one_in_one_process(fsdp, small_data, tmp_path):
    """The run died while writing step 6: only step-6.tmp (incomplete) exists. Re-running with --resume step-3 in
    the same --out-dir continues exactly, here as a single plain process (DCP reshards 2 ranks' shards to 1), and
    its own save of step 6 replaces the leftovers."""
    checkpoints = tmp_path / "checkpoints"
    shutil.copytree(fsdp / "1x2" / "checkpoints", checkpoints)
    (checkpoints / "step-6").rename(checkpoints / "step-6.tmp")
    (checkpoints / "step-6.tmp" / ".metadata").unlink()
    with pytest.raises(SystemExit, match="unfinished checkpoint"):
        load_checkpoint(checkpoints / "step-6.tmp", None, None, None)
    fsdp_ft.main(argv("--data", small_data, *FP32, *NO_PROFILE, *split(2, 2), "--steps", STEPS,
                      "--checkpoint-every", 3, "--resume", checkpoints / "step-3", "--out-dir", tmp_path))
    assert read_losses(tmp_path) == pytest.approx(read_losses(fsdp / "1x2")[3:], rel=1e-5)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-3", "step-6"]
    assert (checkpoints / "step-6" / ".metadata").exists()
    assert not torch.distributed.is_initialized()  # the 1-rank group the script made is gone


# ---------------------------------------------------------------------------------------------------------------
# What each rank holds and what it sends


def test_ddp_reduce_every_micro_batch_is_the_same_step_for_m_times_the_traffic(ddp, reference):
    assert read_losses(ddp / "1x2-every") == pytest.approx(read_losses(reference / "full"), rel=1e-5)
    every, once = summary(ddp / "1x2-every"), summary(ddp / "2x1")  # both in 1 MiB buckets
    gradients = once["collective_bytes_per_step"]["gloo:all_reduce"]["bytes"] - 4  # less the step loss
    assert gradients == 4 * sum(math.prod(shape) for _, shape in tiny_parameters())  # every fp32 gradient, once
    all_reduce = every["collective_bytes_per_step"]["gloo:all_reduce"]
    assert all_reduce["bytes"] == 2 * gradients + 4  # grad_accum 2: every micro-batch sends the whole gradient
    assert all_reduce["calls"] == 2 * (once["collective_bytes_per_step"]["gloo:all_reduce"]["calls"] - 1) + 1


@pytest.mark.parametrize("experiment,runs", [("ddp", ["1x2", "2x1", "1x2-every", "bf16"]),
                                             ("fsdp", ["1x2", "2x1", "bf16", "options", "gather-once"])])
def test_collective_bytes_equal_the_formula(experiment, runs, request):
    # ddp: the default 25 MiB bucket (one bucket) and 1 MiB buckets (9; 6 of bf16 weights carrying fp32 master
    # gradients), GA 1 and 2, with and without no_sync();
    # fsdp: GA 1 and 2, resharded after forward or not, gathered once per step, bf16 gathers, offload, checkpointing,
    # reduce per micro-batch.
    root = request.getfixturevalue(experiment)
    for name in runs:
        assert_formula_matches(summary(root / name))


def test_model_state_bytes_are_the_predicted_ones(reference, ddp, fsdp):
    shapes = [shape for _, shape in tiny_parameters()]
    psi = sum(math.prod(shape) for shape in shapes)
    counters = 4 * len(shapes)  # AdamW's `step`: one fp32 scalar per parameter tensor, not in common/memory
    for run, world, sharded in [(reference / "full", 1, 1), (ddp / "1x2", 2, 1), (fsdp / "1x2", 2, 2)]:
        result = summary(run)
        per_rank, predicted = result["state_bytes_per_rank"], predict_state_bytes(result)[0]
        assert len(per_rank) == world and result["state_bytes_step"] == 2, run
        for measured in per_rank:
            # single-ft and DDP: every rank holds 4 Psi of weights and of gradients (DDP's are views into its
            # buckets), 8 Psi of AdamW moments; FSDP2 a 1/W shard of each (no padding: every dim 0 divides by 2).
            assert measured == {"weights": 4 * psi // sharded, "grads": 4 * psi // sharded,
                                "optimizer": 8 * psi // sharded + counters, "master": 0}, run
            assert measured == {**predicted, "optimizer": predicted["optimizer"] + counters}, run
    # --cpu-offload: the same shards, in host memory, where common/memory predicts them.
    offloaded = summary(fsdp / "options")
    assert predict_state_bytes(offloaded)[0] == dict.fromkeys(("weights", "grads", "optimizer", "master"), 0)
    for measured in offloaded["state_bytes_per_rank"]:
        assert measured == summary(fsdp / "1x2")["state_bytes_per_rank"][0]
        assert sum(measured.values()) == int(predict_run(offloaded).cpu_bytes) + counters


def test_the_readme_main_command_runs_clean(tmp_path):
    """The README's main command as a new user runs it (with --steps 3, from another folder): it works, both ranks
    write into one default out-dir (rank 0's time stamp), every step line ends with the ETA, and nothing in its
    output looks like an error (Kineto's USDT and gpuGetDeviceCount lines are silenced)."""
    import re
    import subprocess

    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    command = next(line for line in readme if line.startswith("uv run torchrun")).split("#")[0].split()
    assert command[:3] == ["uv", "run", "torchrun"] and command[-1] == "experiments/fsdp-ft/train.py"
    argv = [sys.executable, "-m", "torch.distributed.run", *command[3:-1], REPO_ROOT / command[-1], "--steps", 3]
    result = subprocess.run(list(map(str, argv)), cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [out_dir] = (tmp_path / "runs").iterdir()
    assert out_dir.name.startswith("fsdp-ft-") and (out_dir / "summary.json").exists()
    lines = (result.stdout + result.stderr).splitlines()
    assert [line for line in lines if "ERROR" in line or "USDT" in line or "Traceback" in line] == []
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 3 and all(re.search(r" \| eta \d+m\d\ds$", line) for line in steps)
    assert steps[-1].endswith("| eta 0m00s")


# ---------------------------------------------------------------------------------------------------------------
# Beyond one machine


def test_the_launches_were_two_nodes_and_preflight_reports_them(fsdp):
    """The launch ran as two torchrun agents (ddp-ft's and fsdp-ft's losses equal single-ft's above); common.preflight
    in the same launch saw two ranks with LOCAL_RANK 0 each and timed its collectives with nccl-tests' bus bandwidth."""
    report = json.loads((fsdp / "preflight.json").read_text())
    assert report["world_size"] == 2 and report["problems"] == []
    assert sorted((r["rank"], r["local_rank"], r["local_world_size"]) for r in report["ranks"]) == [(0, 0, 1),
                                                                                                  (1, 0, 1)]
    rows = {(r["op"], r["bytes"]): r for r in report["collectives"]}
    assert set(rows) == {("all_reduce", 2**20), ("all_gather", 2**20)}
    for (op, n_bytes), row in rows.items():
        algbw = n_bytes / (row["ms"] / 1e3) / 1e9
        assert row["algbw_gbps"] == pytest.approx(algbw)
        assert row["busbw_gbps"] == pytest.approx(algbw * (1.0 if op == "all_reduce" else 0.5))  # 2(n-1)/n, (n-1)/n
    assert "| all_reduce | 1 MiB |" in (fsdp / "output.txt").read_text()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, small_data, fsdp):
    """One launch of 4 ranks on B = 1 x 1 x 4 = 4 rows, as the reference: HSDP (2 replicas x 2 shards), fsdp-ft's
    2-rank checkpoint of step 3 resumed on 4 ranks, the HSDP checkpoint resumed as plain FSDP, fsdp-tp-ft on a 2 x 2
    mesh (2 dp rows x 2 tp ranks: 1 x 2 x 2 rows = 4), and pp-ft and pp-ds-ft as 2 stages x 2 data-parallel replicas
    (1 x 2 x 2 replicas = 4 rows)."""
    root = tmp_path_factory.mktemp("four-ranks")
    common = ["--data", small_data, *FP32, *NO_PROFILE, "--steps", STEPS, "--micro-batch-size", 1]
    runs = [["fsdp-ft", *common, "--replicate-degree", 2, "--checkpoint-every", 3, "--out-dir", root / "hsdp"],
            ["fsdp-ft", *common, "--resume", fsdp / "1x2" / "checkpoints" / "step-3", "--out-dir", root / "2-to-4"],
            ["fsdp-ft", *common, "--resume", root / "hsdp" / "checkpoints" / "step-3", "--out-dir", root / "hsdp-to-4"],
            ["fsdp-tp-ft", *common, "--tp-degree", 2, "--grad-accum", 2, "--out-dir", root / "fsdp-tp-2x2"],
            ["pp-ft", *common, "--stages", 2, "--grad-accum", 2, "--out-dir", root / "pp-2x2"],
            ["pp-ds-ft", *common, "--stages", 2, "--grad-accum", 2, "--out-dir", root / "pp-ds-2x2"]]
    result = torchrun("+", runs, nproc=4)
    (root / "output.txt").write_text(result.stdout + result.stderr)
    return root


def test_four_ranks_hsdp_resharding_and_pipeline_replicas(four_ranks, reference):
    expected = read_losses(reference / "full")
    hsdp = summary(four_ranks / "hsdp")
    assert "sharded over 2 ranks x 2 replicas (HSDP)" in (four_ranks / "output.txt").read_text()
    assert hsdp["config"]["replicate_degree"] == 2 and hsdp["hardware"]["world_size"] == 4
    assert read_losses(four_ranks / "hsdp") == pytest.approx(expected, rel=1e-5)
    # A rank of HSDP holds what FSDP over its 2-rank shard group holds: half of every parameter.
    assert hsdp["state_bytes_per_rank"][0]["weights"] == pytest.approx(predict_state_bytes(hsdp)[0]["weights"],
                                                                       rel=0.01)
    # After step 3 of a checkpoint written by 2 ranks (or by HSDP) and read by 4 plain FSDP ranks: the same steps.
    assert read_losses(four_ranks / "2-to-4") == pytest.approx(expected[3:], rel=1e-5)
    assert read_losses(four_ranks / "hsdp-to-4") == pytest.approx(expected[3:], rel=1e-5)
    # DeepSpeed's pipeline with 2 replicas of 2 stages.
    assert read_losses(four_ranks / "pp-ds-2x2") == pytest.approx(expected, rel=1e-5)


def test_four_ranks_fsdp_x_tp_and_pipeline_x_data_parallel(four_ranks, reference):
    expected = read_losses(reference / "full")
    # FSDP x TP on a ("dp", "tp") mesh of 2 x 2: each dp row reads its own 2 rows, the tp ranks of a row the same ones.
    assert read_losses(four_ranks / "fsdp-tp-2x2") == pytest.approx(expected, rel=1e-5)
    run = summary(four_ranks / "fsdp-tp-2x2")
    assert run["hardware"]["world_size"] == 4 and (run["data_parallel"], run["tensor_parallel"]) == (2, 2)
    # q_norm/k_norm's partial gradients summed over each row: the replicated weights stay equal across its tp ranks.
    assert run["replica_drift"] == 0.0
    # Every rank holds 1/4 of each split weight (projections, tied embedding) and 1/2 of each norm, with their
    # gradients and AdamW moments: common/memory's fsdp-tp layout, plus AdamW's 4-byte step counter per tensor.
    counters = 4 * len(tiny_parameters())
    predicted = predict_state_bytes(run)[0]
    assert len(run["state_bytes_per_rank"]) == 4
    for measured in run["state_bytes_per_rank"]:
        assert measured == {**predicted, "optimizer": predicted["optimizer"] + counters}
    psi = sum(math.prod(shape) for _, shape in tiny_parameters())
    norms = sum(math.prod(shape) for name, shape in tiny_parameters() if "norm" in name)
    assert predicted["weights"] == 4 * ((psi - norms) // 4 + norms // 2)  # fp32
    # pp-ft (torch.distributed.pipelining) with 2 replicas of 2 stages: DDP per stage over the "dp" dimension.
    assert read_losses(four_ranks / "pp-2x2") == pytest.approx(expected, rel=1e-5)
    pipeline = summary(four_ranks / "pp-2x2")["pipeline"]
    assert (pipeline["ranks"], pipeline["replicas"], pipeline["stage_layers"]) == (2, 2, [[0, 2], [2, 4]])
