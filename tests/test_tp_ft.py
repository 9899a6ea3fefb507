"""tp-ft and tp-sp-ft (2 ranks, gloo, CPU) against single-ft: per-step losses with packing, full and LoRA; replicated
q_norm/k_norm kept identical by the gradient all-reduce (and drifting without it); export; resume; SP's activations;
the model-state bytes each rank holds against common/memory, the collectives against common/comm.py.

One torchrun launch runs every configuration of both experiments (tests/run_many.py); single-ft runs in-process.
"""

import json
import math
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.memory import MASTER_BF16, predict_run, predict_state_bytes
from common.data import build_data, evaluate
from common.models import load_model, model_config
from conftest import load_experiment, read_losses, torchrun
from test_comm import assert_formula_matches, tiny_parameters

pytestmark = pytest.mark.slow  # torchrun launches (the quick tier leaves them out)

STEPS = 5  # optimizer steps compared; resume continues from step 3
RESUME_AT = 3
LORA_RANK = 4
PROFILE_ONE = ("--comm-profile-steps", 1)  # the third step's collectives, for common/comm.py's formula
BF16 = ("--steps", 3, "--dtype", "bf16")  # 3 steps: bf16 costs several times fp32 on this CPU; the later --dtype wins


def common_args(data, out_dir, *extra) -> list:
    # B = 2 x 2 packed rows of 128 tokens; fp32 so that the parity is 1e-5, not bf16's 1e-2. Profiling for comm_ms
    # is left out: it costs time here and is not what these tests check.
    return ["--data", data, "--seq-len", 128, "--dtype", "fp32", "--micro-batch-size", 2, "--grad-accum", 2,
            "--warmup-steps", 2, "--comm-profile-steps", 0, "--out-dir", out_dir, *extra]


def summary(out_dir) -> dict:
    return json.loads((out_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory, small_data):
    """single-ft on the same B, in this process: full-parameter, LoRA, and 3 steps under --dtype bf16."""
    out = tmp_path_factory.mktemp("single-ft")
    single_ft = load_experiment("single-ft")
    single_ft.main([str(a) for a in common_args(small_data, out / "full", "--steps", STEPS)])
    single_ft.main([str(a) for a in common_args(small_data, out / "lora", "--steps", STEPS, "--lora-rank", LORA_RANK)])
    single_ft.main([str(a) for a in common_args(small_data, out / "bf16", *BF16)])
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory, small_data):
    """tp-ft's and tp-sp-ft's configurations in ONE launch of 2 ranks (one round of imports), each into its own root."""
    tp, tp_sp = tmp_path_factory.mktemp("tp-ft"), tmp_path_factory.mktemp("tp-sp-ft")
    tp_runs = [
        common_args(small_data, tp / "full", "--steps", STEPS, "--checkpoint-every", RESUME_AT, "--save-hf",
                    tp / "full" / "hf", *PROFILE_ONE),
        common_args(small_data, tp / "resumed", "--steps", STEPS, "--resume",
                    tp / "full" / "checkpoints" / f"step-{RESUME_AT}"),
        # LoRA with activation checkpointing (the same steps as without; no collective left unwaited at exit).
        common_args(small_data, tp / "lora", "--steps", STEPS, "--lora-rank", LORA_RANK, "--activation-checkpointing",
                    "--save-hf", tp / "lora" / "hf", "--merge-lora"),
        # Without the q_norm/k_norm all-reduce: two steps are enough for the replicas to part.
        common_args(small_data, tp / "unsynced", "--steps", 2, "--no-sync-qk-norm-grads"),
        common_args(small_data, tp / "varlen", "--steps", 3, "--attn", "varlen"),
        # bf16 weights with fp32 masters: checkpointed after step 2, resumed for the third, exported.
        common_args(small_data, tp / "bf16", *BF16, *PROFILE_ONE, "--checkpoint-every", 2,
                    "--save-hf", tp / "bf16" / "hf"),
        common_args(small_data, tp / "bf16-resumed", *BF16, "--resume", tp / "bf16" / "checkpoints" / "step-2"),
    ]
    tp_sp_runs = [
        common_args(small_data, tp_sp / "full", "--steps", STEPS, *PROFILE_ONE),
        # LoRA with activation checkpointing, the logits gathered instead of loss-parallel, exported as an adapter.
        common_args(small_data, tp_sp / "lora", "--steps", STEPS, "--lora-rank", LORA_RANK, "--activation-checkpointing",
                    "--no-loss-parallel", "--save-hf", tp_sp / "lora" / "hf"),
        common_args(small_data, tp_sp / "varlen-compile", "--steps", 2, "--attn", "varlen", "--compile"),
        # A bf16 LoRA base (3 steps: bf16 costs several times fp32 on this CPU); the later --dtype wins.
        common_args(small_data, tp_sp / "lora-bf16", "--steps", 3, "--lora-rank", LORA_RANK, "--dtype", "bf16"),
        common_args(small_data, tp_sp / "bf16", *BF16, *PROFILE_ONE),
    ]
    # fsdp-tp-ft on the same 2 ranks as a 1 x 2 mesh (FSDP over one rank, TP over two), LoRA with activation
    # checkpointing: its own apply_tp and checkpointing call, the same B.
    fsdp_tp = common_args(small_data, tp / "fsdp-tp-lora", "--steps", 3, "--lora-rank", LORA_RANK,
                          "--activation-checkpointing", "--tp-degree", 2)
    torchrun("+", [["tp-ft", *run] for run in tp_runs] + [["tp-sp-ft", *run] for run in tp_sp_runs] +
             [["fsdp-tp-ft", *fsdp_tp]])
    return tp, tp_sp


@pytest.fixture(scope="module")
def tp(launched):
    return launched[0]


@pytest.fixture(scope="module")
def tp_sp(launched):
    return launched[1]


@pytest.fixture(scope="module")
def eval_data(small_data, tokenizer):
    return build_data(small_data, tokenizer, 128, seed=0)  # the same held-out split as the runs'


def eval_loss_of(model, eval_data) -> float:
    return evaluate(model, eval_data, 1, torch.device("cpu"), nullcontext)


@pytest.mark.parametrize("run", ["full", "lora"])
def test_tp_losses_equal_single_ft(tp, single, run):
    losses = read_losses(tp / run)
    assert len(losses) == STEPS
    assert losses == pytest.approx(read_losses(single / run), rel=1e-5)
    assert losses[-1] != pytest.approx(losses[0], rel=1e-3)  # the steps really trained
    assert summary(tp / run)["model"]["trainable_parameters"] == summary(single / run)["model"]["trainable_parameters"]


@pytest.mark.parametrize("run", ["full", "lora"])
def test_tp_sp_losses_equal_single_ft(tp_sp, single, run):
    losses = read_losses(tp_sp / run)
    assert len(losses) == STEPS
    assert losses == pytest.approx(read_losses(single / run), rel=1e-5)
    # SequenceParallel re-creates the norm weights; under LoRA they must stay frozen
    assert summary(tp_sp / run)["model"]["trainable_parameters"] == \
        summary(single / run)["model"]["trainable_parameters"]


def test_lora_on_a_bf16_base_tracks_fp32_and_holds_the_prediction(tp_sp, single):
    """Each rank holds its slice of a bf16 base and of the fp32 adapters (the column-split projections' A whole, B
    split; the row-split ones' A split, B whole): common.memory's prediction, to the byte."""
    got, want = read_losses(tp_sp / "lora-bf16"), read_losses(single / "lora")[:3]
    assert got == pytest.approx(want, rel=2e-2) and got != pytest.approx(want, rel=1e-6)
    run = summary(tp_sp / "lora-bf16")
    counters = 4 * 2 * 4 * 7  # AdamW's step: one fp32 scalar per adapter tensor
    for held in run["state_bytes_per_rank"]:
        assert {**held, "optimizer": held["optimizer"] - counters} == predict_state_bytes(run)[0]
    assert predict_state_bytes(run)[0]["grads"] == 4 * 4 * (
        LORA_RANK * ((256 + 256 / 2) + 2 * (256 + 128 / 2) + 2 * (256 + 768 / 2) + (256 / 2 + 256) + (768 / 2 + 256)))


def test_fsdp_tp_lora_with_checkpointing_equals_single_ft_lora(tp, single):
    # Its first 3 steps: 2 warm-up steps, then the cosine's first value, whatever --steps is.
    assert read_losses(tp / "fsdp-tp-lora") == pytest.approx(read_losses(single / "lora")[:3], rel=1e-5)
    assert summary(tp / "fsdp-tp-lora")["replica_drift"] == 0.0


def test_qk_norm_replicas_stay_identical_only_with_the_all_reduce(tp, tp_sp):
    # replica_drift: the largest difference between a rank's and rank 0's copy of every replicated parameter
    # (q_norm, k_norm and the other norms; LoRA's replicated halves), taken by the run after its last step.
    for run in (tp / "full", tp / "lora", tp_sp / "full", tp_sp / "lora"):
        assert summary(run)["replica_drift"] == 0.0, run
    # The same training without summing the q_norm/k_norm gradients: each rank follows its own heads' gradient.
    assert summary(tp / "unsynced")["replica_drift"] > 1e-6


def test_resume_equals_the_uninterrupted_run(tp):
    checkpoint = tp / "full" / "checkpoints" / f"step-{RESUME_AT}"
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # each rank's shards
    resumed = read_losses(tp / "resumed")
    assert len(resumed) == STEPS - RESUME_AT
    assert resumed == pytest.approx(read_losses(tp / "full")[RESUME_AT:], rel=1e-5)


@pytest.mark.parametrize("run", ["full", "lora"])  # lora: merged into the weights
def test_save_hf_reloads_with_the_same_eval_loss(tp, eval_data, tokenizer, run):
    export = tp / run / "hf"
    assert AutoTokenizer.from_pretrained(export).get_vocab() == tokenizer.get_vocab()
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert not any("lora" in name for name, _ in model.named_parameters())
    assert eval_loss_of(model, eval_data) == pytest.approx(summary(tp / run)["eval_loss"], rel=1e-5)


def test_lora_adapter_export_loads_with_peft(tp_sp, eval_data, tokenizer):
    from peft import PeftModel

    torch.manual_seed(0)  # the preset's random base weights, as the run built them
    model = PeftModel.from_pretrained(load_model("qwen3-tiny", tokenizer, "sdpa"), tp_sp / "lora" / "hf")
    assert eval_loss_of(model, eval_data) == pytest.approx(summary(tp_sp / "lora")["eval_loss"], rel=1e-5)


def test_sequence_parallel_saves_activation_memory(tp, tp_sp):
    # Bytes autograd keeps for the backward of one micro-batch on rank 0, same settings: SP stores the norms' and
    # residuals' inputs for seq_len/2 tokens instead of seq_len.
    assert summary(tp_sp / "full")["activation_mib"] < 0.95 * summary(tp / "full")["activation_mib"]


def test_results_contract(tp, single):
    result = summary(tp / "full")
    assert result["experiment"] == "tp-ft" and result["tensor_parallel"] == 2
    assert result["hardware"]["world_size"] == 2
    assert result["t_eff"] == summary(single / "full")["t_eff"] == 2 * 2 * 128  # the same B as single-ft
    records = [json.loads(line) for line in (tp / "full" / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (single / "full" / "metrics.jsonl").read_text().splitlines()]
    # Every rank processes the same rows, so a step's tokens are counted once, not once per rank.
    assert [r["tokens"] for r in records] == [r["tokens"] for r in reference]
    assert [r["loss_tokens"] for r in records] == [r["loss_tokens"] for r in reference]
    assert result["tokens_per_s_per_device"] == pytest.approx(result["tokens_per_s"] / 2)


@pytest.mark.parametrize("experiment, run, steps, tolerance",
                         [("tp", "varlen", 3, 1e-5), ("tp_sp", "varlen-compile", 2, 1e-4)])
def test_varlen_and_compile_compute_single_ft_steps(experiment, run, steps, tolerance, request, single):
    """--attn varlen (each rank's heads over the whole row's documents, the CPU reference kernel) and, in tp-sp-ft,
    --compile of each split decoder layer, against single-ft's --attn sdpa steps."""
    out = request.getfixturevalue(experiment) / run
    assert read_losses(out) == pytest.approx(read_losses(single / "full")[:steps], rel=tolerance)
    assert summary(out)["attention"]["varlen_kernel"] == "reference"
    assert summary(out)["config"]["compile"] == (run == "varlen-compile")


@pytest.mark.parametrize("flag, reason", [("compile", "fails in backward inside DTensor's redistribution"),
                                          ("loss_chunk_tokens", "no --loss-chunk-tokens: loss parallelism")])
def test_tp_ft_refuses_what_it_cannot_run_with_the_reason(flag, reason):
    tp_ft = load_experiment("tp-ft")
    with pytest.raises(SystemExit, match=reason):
        tp_ft.resolve(tp_ft.Config(out_dir="unused", **{flag: 64 if flag == "loss_chunk_tokens" else True}))


def test_head_counts_that_do_not_divide_stop_with_the_reason():
    check_divisible = load_experiment("tp-ft").check_divisible
    tiny = model_config("qwen3-tiny")  # 8 query heads, 4 KV heads
    with pytest.raises(SystemExit, match=r"num_attention_heads \(8\) divisible by 3"):
        check_divisible(tiny, 3)
    with pytest.raises(SystemExit, match=r"num_key_value_heads \(4\) divisible by 8"):
        check_divisible(tiny, 8)


def test_collective_bytes_equal_the_formula(tp, tp_sp):
    # Per micro-batch 4 L + 2 all-reduces of the hidden states (tp-ft), or as many reduce-scatters and all-gathers
    # (tp-sp-ft; gloo runs a reduce-scatter as an all-reduce), the loss-parallel cross-entropy's three, and once per
    # step the partial gradients and the gradient norm.
    for run in (tp / "full", tp_sp / "full", tp / "bf16", tp_sp / "bf16"):
        assert_formula_matches(summary(run))


@pytest.mark.parametrize("experiment", ["tp", "tp_sp"])
def test_model_state_bytes_are_the_predicted_ones(experiment, request):
    parameters = tiny_parameters()
    psi = sum(math.prod(shape) for _, shape in parameters)
    embedding = math.prod(dict(parameters)["model.embed_tokens.weight"])
    replicated = sum(math.prod(shape) for name, shape in parameters if "norm" in name)  # every norm weight
    split = psi - embedding - replicated  # the layers' seven projections
    counters = 4 * len(parameters)  # AdamW's step: one fp32 scalar per parameter tensor
    result = summary(request.getfixturevalue(experiment) / "full")
    predicted = predict_state_bytes(result)[0]
    for measured in result["state_bytes_per_rank"]:
        # Each rank: 1/2 of every projection and of the vocabulary-split embedding (the tied LM head), the norms
        # whole; common/memory models the same split. AdamW's step counters are the only difference.
        local = split // 2 + embedding // 2 + replicated
        assert measured == {"weights": 4 * local, "grads": 4 * local, "optimizer": 8 * local + counters, "master": 0}
        assert measured == {**predicted, "optimizer": predicted["optimizer"] + counters}


@pytest.mark.parametrize("experiment", ["tp", "tp_sp"])
def test_bf16_computes_single_ft_s_bf16_steps(experiment, request, single):
    """--dtype bf16: bf16 weights (each rank's shards) read without autocast, fp32 masters that AdamW updates, as
    single-ft's (common/precision.py). TP splits each matrix multiply's sum over the ranks, so bf16 rounds at other
    places: the first step's loss within 1e-3, the next within bf16 rounding of each other's updates; not fp32's."""
    runs = request.getfixturevalue(experiment)
    got, want = read_losses(runs / "bf16"), read_losses(single / "bf16")
    assert len(got) == len(want) == 3
    assert got[0] == pytest.approx(want[0], rel=1e-3)
    assert got == pytest.approx(want, rel=2e-2)
    assert got != pytest.approx(read_losses(single / "full")[:3], rel=1e-6)  # bf16, not fp32
    run = summary(runs / "bf16")
    assert run["master_weights"] == summary(single / "bf16")["master_weights"]  # every trainable tensor, by name
    assert run["replica_drift"] == 0.0  # the q_norm/k_norm masters' gradients summed over the group
    # What autograd keeps of one micro-batch, a bf16 residual stream, no weight copies: common.memory's terms (its
    # tp-sp is Korthikanti et al.'s, the linear inputs split too, which PyTorch's plan keeps whole: a few % less).
    predicted = predict_run(run).activations_bytes
    assert run["activation_mib"] * 2**20 == pytest.approx(predicted, rel=1e-2 if experiment == "tp" else 5e-2)


@pytest.mark.parametrize("experiment", ["tp", "tp_sp"])
def test_bf16_state_bytes_are_the_predicted_ones(experiment, request):
    """Each rank: bf16 weights 2, fp32 gradients 4 (on the masters), fp32 masters 4, AdamW's moments 8 bytes per
    parameter of its slice, as common.memory's MASTER_BF16 prices tp and tp-sp."""
    run = summary(request.getfixturevalue(experiment) / "bf16")
    local = run["state_bytes_per_rank"][0]["master"] // 4
    counters = 4 * run["master_weights"]["tensors"]
    assert predict_run(run).precision is MASTER_BF16
    for measured in run["state_bytes_per_rank"]:
        assert measured == {"weights": 2 * local, "grads": 4 * local, "optimizer": 8 * local + counters,
                            "master": 4 * local}
        assert measured == {**predict_state_bytes(run)[0], "optimizer": predict_state_bytes(run)[0]["optimizer"] +
                            counters}


def test_bf16_resume_and_export_hold_the_fp32_masters(tp, eval_data):
    """The checkpoint holds the fp32 masters under the model's names: the resumed third step is the uninterrupted
    one's, bit for bit. --save-hf writes the fp32 masters, not their bf16 rounding."""
    assert read_losses(tp / "bf16-resumed") == read_losses(tp / "bf16")[2:]
    model = AutoModelForCausalLM.from_pretrained(tp / "bf16" / "hf", dtype=torch.float32)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(weight, weight.to(torch.bfloat16).float())
    # bf16 weights in the run's evaluation, their fp32 masters here
    assert eval_loss_of(model, eval_data) == pytest.approx(summary(tp / "bf16")["eval_loss"], rel=1e-2)
