"""common/memory.py: the ZeRO paper's numbers, the rule of thumb, sharding, the activation formula (by hand and
against what autograd really keeps), LoRA, the decision tree and the command line."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from common.memory import (BF16_RULE_OF_THUMB, GB, GIB, PROJECT_BF16, PROJECT_FP32, ZERO_PAPER, device_slices,
                           estimate, layer_activation_terms, main, model_shape, model_state_bytes,
                           outside_layers_bytes_per_token, predict_peak_gib, recommend, zero_paper_figure1)
from common.models import PRESET_COMMON, PRESETS, model_config

QWEN3_4B_PARAMETERS = 4_022_468_096  # count_parameters of the preset (tests/test_models_metrics.py checks 0.6B)


# ---------------------------------------------------------------------------------------------------------------
# Bytes per parameter: the two conventions, pinned to the numbers their sources print
def test_zero_paper_figure1():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    assert ZERO_PAPER.weights + ZERO_PAPER.grads == 4 and ZERO_PAPER.zero_k == 12 and ZERO_PAPER.trainable == 16
    computed = {stage: gb for stage, _, gb in zero_paper_figure1()}
    assert computed == pytest.approx({"baseline": 120.0, "P_os": 31.40625, "P_os+g": 16.640625,
                                      "P_os+g+p": 1.875})
    # ... and to the precision the figure states
    assert {stage: round(gb, 1) for stage, gb in computed.items()} == {
        "baseline": 120.0, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.9}


def test_bf16_rule_of_thumb_is_12_bytes_per_parameter():
    assert BF16_RULE_OF_THUMB.trainable == 12
    # "7 x 2 + 7 x 2 + 7 x 8 = ~84 GB" for a 7B model (seed 003, Transformer Math 101)
    assert sum(model_state_bytes(7e9, 0, BF16_RULE_OF_THUMB, "single", 1).values()) == pytest.approx(84 * GB)
    # "13B ... 156 GB ... sharded across 4: 156/4 = 39 GB" (the same source)
    assert sum(model_state_bytes(13e9, 0, BF16_RULE_OF_THUMB, "fsdp", 4).values()) == pytest.approx(39 * GB)


def test_project_precisions_are_what_the_scripts_keep():
    # --dtype bf16: fp32 weights (also the master copy) + fp32 grads + fp32 AdamW m and v, bf16 compute.
    assert (PROJECT_BF16.weights, PROJECT_BF16.grads, PROJECT_BF16.optimizer, PROJECT_BF16.master,
            PROJECT_BF16.compute) == (4, 4, 8, 0, 2)
    assert (PROJECT_FP32.trainable, PROJECT_FP32.compute) == (16, 4)
    single = estimate("qwen3-4b", "single")
    assert single.model_states_bytes == QWEN3_4B_PARAMETERS * 16  # the "64 GB" of Qwen3-4B full SFT
    assert 64e9 < single.model_states_bytes < 65e9
    # Autocast's bf16 copy of every matmul weight (norm weights are never cast)
    norms = 36 * (2 * 2560 + 2 * 128) + 2560
    assert single.compute_copy_bytes == (QWEN3_4B_PARAMETERS - norms) * 2
    # FSDP2's mixed-precision policy gathers bf16 layers instead: no autocast copies, bf16 buffers
    assert estimate("qwen3-4b", "fsdp", 2).compute_copy_bytes == 0


# ---------------------------------------------------------------------------------------------------------------
# Sharding
SHARDED = {"zero-1": {"optimizer"}, "zero-2": {"grads", "optimizer"},
           "zero-3": {"weights", "grads", "optimizer"}, "fsdp": {"weights", "grads", "optimizer"}}


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("devices", [2, 8])
@pytest.mark.parametrize("precision", [PROJECT_BF16, ZERO_PAPER])
def test_sharded_states_add_up_to_the_unsharded_ones(strategy, devices, precision):
    replica = estimate("qwen3-0.6b", "ddp", devices, precision=precision)
    shard = estimate("qwen3-0.6b", strategy, devices, precision=precision)
    for state in ("weights", "grads", "optimizer", "master"):
        per_device, whole = getattr(shard, f"{state}_bytes"), getattr(replica, f"{state}_bytes")
        sharded = state in SHARDED[strategy] or (state == "master" and "optimizer" in SHARDED[strategy])
        assert per_device * (devices if sharded else 1) == pytest.approx(whole)
    if strategy in ("zero-3", "fsdp"):
        assert shard.model_states_bytes * devices == pytest.approx(replica.model_states_bytes)


def test_pipeline_stages_hold_every_layer_once_and_the_tied_head_twice():
    shape = model_shape("qwen3-0.6b")
    stages = device_slices(shape, "pp", 2, lora_rank=0)
    assert [s.layers for s in stages] == [14, 14]
    assert [s.micro_batches_in_flight for s in stages] == [2, 1]  # 1F1B: the first stage keeps p micro-batches
    held = sum(s.trainable for s in stages)
    assert held == shape.total_parameters + shape.embedding_parameters  # the LM head copy on the last stage


def test_tensor_parallel_degree_must_divide_the_heads():
    with pytest.raises(ValueError, match="divide"):
        estimate("qwen3-0.6b", "tp", 3)


# ---------------------------------------------------------------------------------------------------------------
# Activations
def test_activation_formula_by_hand_for_qwen3_0_6b():
    # d 1024, 16 query heads and 8 KV heads of 128, MLP 3072; autocast (c = 2, residual stream r = 4);
    # packed rows through SDPA: k and v repeated to 16 heads, and the s x s mask; s = 1024.
    d, q, kv, mlp, s = 1024, 16 * 128, 8 * 128, 3072, 1024
    norms = 2 * (4 * d + 4 * d + 4)  # fp32 input, normalised fp32 input, 1/rms
    linear_inputs = 5 * 2 * d  # q, k, v, gate, up: one bf16 cast each
    qk_norms = (q + kv) * (4 + 2) + 4 * (16 + 8)  # fp32 upcast + bf16 normalised, 1/rms per head
    attention = 2 * (q + 2 * q) + 2 * q + 4 * 16  # q, repeated k and v, output, log-sum-exp
    mask = 2 * s
    mlp_terms = 4 * 2 * mlp
    by_hand = norms + linear_inputs + qk_norms + attention + mask + mlp_terms
    assert by_hand == 88_232

    shape = model_shape("qwen3-0.6b")
    terms = layer_activation_terms(shape, compute_bytes=2, autocast=True, seq_len=s)
    assert terms == dict(norms=norms, linear_inputs=linear_inputs, qk_norms=qk_norms, attention=attention,
                         mask=mask, mlp=mlp_terms, lora_adapters=0)
    outside = (4 * d + 4 * d + 4) + 2 * d + 2 * 128 * 4  # final norm, LM head's bf16 input, RoPE cos and sin
    assert outside_layers_bytes_per_token(shape, compute_bytes=2, autocast=True) == outside

    single = estimate(shape, "single", seq_len=s)
    assert single.activations_bytes == s * (28 * by_hand + outside)
    assert single.logits_bytes == s * 151_936 * (2 + 12)
    checkpointed = estimate(shape, "single", seq_len=s, activation_checkpointing=True)
    assert checkpointed.activations_bytes == s * (28 * 4 * d + by_hand + outside)  # inputs + one recomputed layer


def _saved_bytes_per_token(layers: int, autocast: bool, packed: bool, lora_rank: int = 0,
                           seq_len: int = 96) -> float:
    """Bytes autograd keeps for backward after one forward of qwen3-tiny, per token, without the parameters and
    autocast's copies of them (counted apart, as `compute_copy`). Tensors sharing storage count once."""
    torch.manual_seed(0)
    config = Qwen3Config(**{**PRESETS["qwen3-tiny"], "num_hidden_layers": layers}, **PRESET_COMMON)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    model.train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {shape for p in model.parameters() for shape in (tuple(p.shape), tuple(p.shape[::-1]))}
    saved: dict[int, int] = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        is_weight_copy = tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in weight_shapes
        if storage.data_ptr() not in parameters and not is_weight_copy:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    half = seq_len // 2
    position_ids = torch.cat([torch.arange(half), torch.arange(seq_len - half)]) if packed else torch.arange(seq_len)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=torch.randint(0, 8000, (1, seq_len)), position_ids=position_ids[None],
              attention_mask=None, use_cache=False)
    return sum(saved.values()) / seq_len


@pytest.mark.parametrize("autocast,packed,lora_rank", [(False, False, 0), (True, True, 0), (True, False, 8)])
def test_activation_formula_matches_what_autograd_keeps(autocast, packed, lora_rank):
    """One forward of the 4-layer qwen3-tiny on CPU (no training): the difference between 3 and 2 layers is one
    layer's saved tensors (the first layer is left out: under LoRA its input needs no gradient)."""
    shape = model_shape(Qwen3Config(**PRESETS["qwen3-tiny"], **PRESET_COMMON))
    compute_bytes = 2 if autocast else 4
    terms = layer_activation_terms(shape, compute_bytes=compute_bytes, autocast=autocast, seq_len=96,
                                   attention="sdpa-packed" if packed else "sdpa", lora_rank=lora_rank)
    two, three = (_saved_bytes_per_token(n, autocast, packed, lora_rank) for n in (2, 3))
    assert three - two == sum(terms.values())
    if not lora_rank:
        # Outside the layers: the formula, plus the int64 input ids the embedding keeps (8 bytes per token)
        outside = outside_layers_bytes_per_token(shape, compute_bytes=compute_bytes, autocast=autocast)
        assert two - 2 * (three - two) == outside + 8


# ---------------------------------------------------------------------------------------------------------------
# LoRA
def test_lora_shrinks_grads_and_optimizer_to_the_adapters():
    shape = model_shape("qwen3-0.6b")
    # rank x (in + out) for q, k, v, o, gate, up, down, per layer
    adapters = 16 * 28 * ((1024 + 2048) + 2 * (1024 + 1024) + (2048 + 1024) + 2 * (1024 + 3072) + (3072 + 1024))
    assert shape.lora_parameters(16) == adapters == 10_092_544
    full, lora = estimate(shape, "single"), estimate(shape, "single", lora_rank=16)
    assert lora.grads_bytes == adapters * 4
    assert lora.optimizer_bytes == adapters * 8
    assert lora.weights_bytes == (shape.total_parameters + adapters) * 4  # the frozen base stays fp32
    assert lora.total_bytes < full.total_bytes
    ddp = estimate(shape, "ddp", 2, lora_rank=16)
    assert ddp.buffers_bytes == adapters * 4  # DDP's buckets hold only the adapters' gradients


def test_lora_count_matches_peft():
    from peft import LoraConfig, get_peft_model

    config = Qwen3Config(**PRESETS["qwen3-tiny"], **PRESET_COMMON)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape(config).lora_parameters(8) == trainable


# ---------------------------------------------------------------------------------------------------------------
# Decisions, checked by hand (project-bf16: 16 bytes per trainable parameter; 90% of a GPU usable)
def test_qwen3_4b_full_sft_needs_sharding_across_two_80gb_gpus():
    # 4.02B x 16 = 64.4 GB = 59.9 GiB of model states: far over one 24 GB GPU (21.6 GiB usable) ...
    assert estimate("qwen3-4b", "single").model_states_bytes / GIB > 24
    one_24gb = recommend("qwen3-4b", 1, 24)
    assert "single" not in one_24gb.fitting
    # ... so one 24 GB GPU needs CPU offload for full SFT, and LoRA is named as the faster way out
    assert one_24gb.strategy == "fsdp-offload" and "LoRA" in one_24gb.reason
    # Over 2 x 80 GB, FSDP/ZeRO-3 holds 32 GB of states per GPU and fits; DDP's replica (plus its gradient
    # buckets: 64 + 16 GB) does not, and ZeRO-2 (16 GB weights + 8 grads + 16 AdamW) is the first rung that fits.
    two_80gb = recommend("qwen3-4b", 2, 80)
    assert {"zero-3", "fsdp", "zero-2"} <= set(two_80gb.fitting) and "ddp" not in two_80gb.fitting
    assert two_80gb.strategy == "zero-2" and not two_80gb.activation_checkpointing


def test_qwen3_4b_fits_one_80gb_gpu_only_with_checkpointing():
    # states 59.9 GiB + bf16 copies 7.5 + logits 2.0 + activations 7.2 = 76.7 GiB > 72 usable; checkpointing keeps
    # 36 layer inputs (36 x 10 KiB/token) + one layer: 0.6 GiB of activations -> about 70 GiB.
    advice = recommend("qwen3-4b", 1, 80)
    assert advice.strategy == "single" and advice.activation_checkpointing
    assert 69 < advice.choice.total_gib < 72 < estimate("qwen3-4b", "single").total_gib


@pytest.mark.parametrize("gpus,gpu_mem_gb,expected", [(1, 24, "single"), (1, 80, "single"), (2, 24, "ddp"),
                                                      (2, 32, "ddp"), (2, 80, "ddp")])
def test_qwen3_0_6b_fits_a_replica(gpus, gpu_mem_gb, expected):
    # 0.6B: 9.5 GB of states + 1.2 copies + 2.5 activations + 2.2 logits = about 14.4 GiB; DDP adds 2.2 of buckets
    advice = recommend("qwen3-0.6b", gpus, gpu_mem_gb)
    assert (advice.strategy, advice.activation_checkpointing, advice.lora_rank) == (expected, False, 0)


def test_qwen3_0_6b_on_two_16gb_gpus_shards_gradients_and_optimizer():
    # Micro-batch 2 x 1024 on 2 x 16 GB (14.4 GiB usable): logits alone are 2 x 2.03 GiB. DDP needs 21.0 GiB, 16.7
    # with checkpointing (8.9 of states + 2.2 of buckets + 1.1 of bf16 copies + 4.1 of logits); ZeRO-2 halves
    # gradients and AdamW state (-3.3) and its bucket is 1.9: 17.3 GiB, 13.0 with checkpointing.
    advice = recommend("qwen3-0.6b", 2, 16, micro_batch_size=2)
    assert (advice.strategy, advice.activation_checkpointing) == ("zero-2", True)
    assert "ddp" not in advice.fitting and "zero-2" not in advice.fitting  # not as given, without checkpointing


def test_nothing_fits_says_so():
    advice = recommend("qwen3-4b", 1, 2)  # the logits alone need 2.0 GiB
    assert advice.strategy is None and "nothing fits" in advice.reason


def test_lora_when_full_sft_fits_nowhere():
    # Qwen3-4B on one 4 GB GPU (3.6 GiB usable), full SFT at its leanest (CPU offload + checkpointing): logits
    # 1024 x 151,936 x 14 B = 2.03 GiB, activations 0.37, gathered bf16 root + 2 layers (389.0M + 2 x 100.9M) x 2 B
    # = 1.10, unsharded fp32 gradients of root + 1 layer (389.0M + 100.9M) x 4 B = 1.83: 5.33 GiB. LoRA drops those
    # gradients (the embedding is frozen): 3.48 GiB.
    advice = recommend("qwen3-4b", 1, 4)
    assert (advice.strategy, advice.lora_rank, advice.activation_checkpointing) == ("fsdp-offload", 16, True)
    assert advice.reason.startswith("full SFT fits nowhere")
    assert advice.choice.total_gib == pytest.approx(3.48, abs=0.01)


def test_a_given_lora_rank_walks_the_ladder():
    # On 2 x 24 GB, LoRA's 16 GB of frozen fp32 weights fit a replica once activations are checkpointed.
    advice = recommend("qwen3-4b", 2, 24, lora_rank=16)
    assert (advice.strategy, advice.lora_rank) == ("ddp", 16) and advice.activation_checkpointing


# ---------------------------------------------------------------------------------------------------------------
# API for the experiments, and the command line
def test_predict_peak_gib_matches_estimate():
    config = model_config("qwen3-0.6b")
    expected = estimate("qwen3-0.6b", "fsdp", 2, seq_len=512, micro_batch_size=2).total_gib
    assert predict_peak_gib(config, "fsdp", 2, seq_len=512, micro_batch_size=2) == pytest.approx(expected)
    fp32 = predict_peak_gib(config, "fsdp", 2, seq_len=512, micro_batch_size=2, dtype="fp32")
    assert fp32 == pytest.approx(estimate(config, "fsdp", 2, seq_len=512, micro_batch_size=2,
                                          precision=PROJECT_FP32).total_gib)


def test_raw_counts_give_the_preset():
    raw = dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936)
    assert model_shape(raw).total_parameters == model_shape("qwen3-0.6b").total_parameters == 596_049_920


def test_cli_prints_the_table_and_the_recommendation(capsys):
    main(["--model", "qwen3-0.6b", "--gpus", "2", "--gpu-mem-gb", "32", "--seq-len", "1024"])
    out = capsys.readouterr().out
    assert "recommendation: ddp" in out and "experiments/ddp-ft/train.py" in out
    assert "88,232 bytes/token" in out
    main(["--zero-paper"])
    out = capsys.readouterr().out
    assert "31.406" in out and "1.875" in out
