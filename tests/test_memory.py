"""common/memory: the ZeRO paper's numbers, the rule of thumb, sharding, the activation formula (by hand and
against what autograd really keeps), LoRA, what each experiment keeps (DeepSpeed's layouts counted in a live engine,
and reconciled term by term with DeepSpeed's own estimators), the decision tree and the command line."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig
from transformers.masking_utils import create_causal_mask

from common.memory import (BF16_RULE_OF_THUMB, DEEPSPEED_BF16, DEEPSPEED_FP32, DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD,
                           DEEPSPEED_REDUCE_BUCKET_ELEMENTS, ERROR_BAND, ERROR_BAND_FLOOR, EXPERIMENT_STRATEGY, GB, GIB,
                           GPU_MEMORY_GIB, MASTER_BF16, PEAK_TESTED_FROM_GIB, PROJECT_BF16, PROJECT_FP32, STRATEGIES,
                           USABLE_FRACTION, ZERO_PAPER, FAST_FLAGS, LORA_FUSED, LOSS_CHUNK_TOKENS, Ladder, PeakCheck,
                           device_slices, error_band, estimate,
                           estimate_stages, gpu_peak_checks,
                           largest_trainable_parameter, layer_activation_terms, leaf_modules, main, model_shape,
                           model_state_bytes, multi_node_layouts, outside_layers_bytes_per_token,
                           predict_run, predict_state_bytes, recommend, strategy_precision, uses_autocast,
                           zero3_gathered_elements, zero3_persistent_parameters, zero_paper_figure1)
from common.precision import MasterWeights
from common.models import MOE_COMMON, MOE_PRESETS, PRESET_COMMON, PRESETS, count_parameters, model_config

QWEN3_4B_PARAMETERS = 4_022_468_096  # count_parameters of the preset (tests/test_models_metrics.py checks 0.6B)
REPO_ROOT = Path(__file__).resolve().parent.parent


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
    # fp32 weights under autocast, one replica (tp-ft and pp-ft keep this layout; ddp-ft did before
    # common/precision.py, and its committed runs are priced so).
    ddp = estimate("qwen3-4b", "ddp", precision=PROJECT_BF16)
    assert ddp.model_states_bytes == QWEN3_4B_PARAMETERS * 16  # the "64 GB" of Qwen3-4B full SFT
    assert 64e9 < ddp.model_states_bytes < 65e9
    # Autocast's bf16 copy of every matmul weight (norm weights are never cast)
    norms = 36 * (2 * 2560 + 2 * 128) + 2560
    assert ddp.compute_copy_bytes == (QWEN3_4B_PARAMETERS - norms) * 2
    # single-ft (common/precision.py): bf16 weights 2 + fp32 grads 4 + fp32 masters 4 + AdamW 8, no autocast copies;
    # the bf16 weights are freed for the optimizer step, whose peak is the same 16 bytes a parameter.
    single = estimate("qwen3-4b", "single")
    assert single.precision is MASTER_BF16 and single.model_states_bytes == QWEN3_4B_PARAMETERS * 18
    assert single.compute_copy_bytes == 0 and single.step_bytes == QWEN3_4B_PARAMETERS * 16 == ddp.step_bytes
    # ddp-ft keeps single-ft's layout, plus DDP's bf16 buckets (2), freed with the weights for the step.
    masters = estimate("qwen3-4b", "ddp")
    assert masters.precision is MASTER_BF16 and masters.model_states_bytes == QWEN3_4B_PARAMETERS * (18 + 2)
    assert masters.compute_copy_bytes == 0 and masters.step_bytes == single.step_bytes
    # FSDP2's mixed-precision policy gathers bf16 layers instead: no autocast copies, bf16 buffers
    assert estimate("qwen3-4b", "fsdp", 2).compute_copy_bytes == 0


def test_each_strategy_is_priced_as_its_experiment_runs_it():
    # zero-ft runs DeepSpeed's own bf16 mode (bf16 module, fp32 gradient accumulation, fp32 master, no autocast);
    # with --dtype fp32 DeepSpeed still keeps a separate fp32 master partition. single-ft, ddp-ft, tp-ft, tp-sp-ft,
    # pp-ft and ep-ft compute in bf16 weights with fp32 masters (common/precision.py); every other experiment keeps
    # fp32 weights that are their own master copy.
    def layout(p):
        return p.weights, p.grads, p.master, p.optimizer

    masters = ("single", "ddp", "tp", "tp-sp", "pp", "ep")

    assert layout(DEEPSPEED_BF16) == (2, 4, 4, 8) and layout(DEEPSPEED_FP32) == (4, 4, 4, 8)
    for strategy in STRATEGIES:
        deepspeed = strategy.startswith("zero-")
        assert strategy_precision(strategy, "bf16") is (DEEPSPEED_BF16 if deepspeed else
                                                        MASTER_BF16 if strategy in masters else
                                                        PROJECT_BF16)
        assert strategy_precision(strategy, "fp32") is (DEEPSPEED_FP32 if deepspeed else PROJECT_FP32)
    with pytest.raises(ValueError, match="dtype"):
        strategy_precision("zero-2", "fp16")
    zero2 = estimate("qwen3-4b", "zero-2", 8)
    assert zero2.precision is DEEPSPEED_BF16 and zero2.compute_copy_bytes == 0  # no autocast in DeepSpeed's bf16
    assert zero2.weights_bytes == QWEN3_4B_PARAMETERS * 2
    # One convention for every strategy when asked for (the ZeRO paper's, say)
    assert estimate("qwen3-4b", "zero-2", 8, precision=ZERO_PAPER).precision is ZERO_PAPER


@pytest.mark.parametrize("strategy", ["zero-2", "zero-3-offload", "ddp", "fsdp"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_command_line_recommend_and_summaries_agree(strategy, dtype, capsys):
    """The CLI's row, recommend()'s estimate and predict_run's (estimate with the experiment's precision) come from
    one place; zero-ft's bf16 is DeepSpeed's layout (DEEPSPEED_BF16), the one strategy_precision names."""
    config = model_config("qwen3-4b")
    advice = recommend("qwen3-4b", 8, 80, precision=dtype, micro_batch_size=1, grad_accum=1, fast=False)
    (row,) = [e for e in advice.estimates if e.strategy == strategy]  # checkpointed where it would not fit without
    zero_ft_precision = DEEPSPEED_BF16 if strategy.startswith("zero-") and dtype == "bf16" else None
    summary = estimate(config, strategy, 8, seq_len=1024, precision=zero_ft_precision or dtype,
                       activation_checkpointing=row.activation_checkpointing).total_gib
    assert summary == estimate(config, strategy, 8, seq_len=1024, precision=dtype,
                               activation_checkpointing=row.activation_checkpointing).total_gib
    assert row.total_gib == pytest.approx(summary) and row.precision is strategy_precision(strategy, dtype)
    main(["--model", "qwen3-4b", "--gpus", "8", "--gpu-mem-gib", "80", "--dtype", dtype, "--strategy", strategy,
          "--micro-batch-size", "1", "--grad-accum", "1", "--no-fast"])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"{strategy} ")]
    assert float(line.split()[10]) == pytest.approx(summary, abs=0.005)  # the "peak" column


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
    # ZeRO-3 keeps its persistent parameters (the norms: 28 x (2 x 1024 + 2 x 128) + 1024) gathered beside their
    # partition: every rank holds them whole once more.
    persistent = 65_536 * precision.weights if strategy == "zero-3" else 0
    assert zero3_persistent_parameters(model_shape("qwen3-0.6b")) == 65_536
    for state in ("weights", "grads", "optimizer", "master"):
        per_device, whole = getattr(shard, f"{state}_bytes"), getattr(replica, f"{state}_bytes")
        sharded = state in SHARDED[strategy] or (state == "master" and "optimizer" in SHARDED[strategy])
        extra = persistent if state == "weights" else 0
        assert (per_device - extra) * (devices if sharded else 1) == pytest.approx(whole)
    if strategy in ("zero-3", "fsdp"):
        assert (shard.model_states_bytes - persistent) * devices == pytest.approx(replica.model_states_bytes)


def test_pipeline_stages_hold_every_layer_once_and_the_tied_head_twice():
    shape = model_shape("qwen3-0.6b")
    stages = device_slices(shape, "pp", 2, lora_rank=0)
    assert [s.layers for s in stages] == [14, 14]
    assert [s.micro_batches_in_flight for s in stages] == [2, 1]  # 1F1B: the first stage keeps p micro-batches
    held = sum(s.trainable for s in stages)
    assert held == shape.total_parameters + shape.embedding_parameters  # the LM head copy on the last stage


def test_pipeline_stages_under_lora_train_only_their_adapters():
    # pp-ft --lora-rank: the embedding and the last stage's copy of the tied head stay frozen, like the tied weight
    # in single-ft; each stage trains the adapters of its own layers.
    shape = model_shape("qwen3-0.6b")
    stages = device_slices(shape, "pp", 2, lora_rank=16)
    adapters = shape.lora_parameters(16)
    assert [s.trainable for s in stages] == [adapters / 2, adapters / 2]
    assert sum(s.frozen for s in stages) == shape.total_parameters + shape.embedding_parameters
    first, last = estimate_stages(shape, "pp", 2, lora_rank=16)
    assert first.grads_bytes == last.grads_bytes == adapters / 2 * 4  # fp32 gradients of the adapters only
    # A bf16 base, bf16 adapters with fp32 masters (pp-ft's --dtype bf16, common/precision.py)
    assert last.weights_bytes == stages[1].frozen * 2 + adapters / 2 * 2
    assert last.master_bytes == adapters / 2 * 4


def test_tensor_parallel_degree_must_divide_the_heads():
    with pytest.raises(ValueError, match="divide"):
        estimate("qwen3-0.6b", "tp", 3)


def test_fsdp_tp_shards_the_tp_slice_over_the_data_parallel_ranks():
    # fsdp-tp-ft on 8 ranks as 4 dp rows x 2 tp ranks: the split weights (projections, tied embedding) are divided
    # by dp x t = 8, the norms, replicated over t, by dp = 4; gradients and AdamW's moments likewise.
    shape = model_shape("qwen3-4b")
    norms = shape.layers * shape.layer_norm_parameters + shape.hidden
    fsdp_tp = estimate(shape, "fsdp-tp", 8, tensor_parallel=2)
    split = (QWEN3_4B_PARAMETERS - norms) / 8 + norms / 4
    assert (fsdp_tp.weights_bytes, fsdp_tp.grads_bytes, fsdp_tp.optimizer_bytes, fsdp_tp.master_bytes) == (
        split * 4, split * 4, split * 8, 0)
    # tp's activations and logits (each rank computes 1/t of every layer and of the vocabulary), FSDP's units
    # gathered in bf16 without autocast copies; t = 1 is plain FSDP.
    tp = estimate(shape, "tp", 2)
    assert fsdp_tp.logits_bytes == tp.logits_bytes and fsdp_tp.compute_copy_bytes == 0
    assert fsdp_tp.activations_bytes == tp.activations_bytes  # neither under autocast: a bf16 residual stream
    under_autocast = estimate(shape, "tp", 2, precision=PROJECT_BF16)  # tp-ft's layout before bf16 weights
    assert fsdp_tp.activations_bytes < under_autocast.activations_bytes  # its residual stream fp32
    assert estimate(shape, "fsdp-tp", 8, tensor_parallel=1) == replace(estimate(shape, "fsdp", 8), strategy="fsdp-tp")
    with pytest.raises(ValueError, match="must divide the world size"):
        estimate(shape, "fsdp-tp", 6, tensor_parallel=4)
    assert "fsdp-tp" not in STRATEGIES  # priced on request, not a row of the one-dimensional table


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

    # one process under autocast (single-ft's and ddp-ft's bf16 weights: no autocast)
    single = estimate(shape, "ddp", seq_len=s, precision=PROJECT_BF16)
    assert single.activations_bytes == s * (28 * by_hand + outside)
    assert single.logits_bytes == s * 151_936 * (2 + 12)
    checkpointed = estimate(shape, "ddp", seq_len=s, activation_checkpointing=True, precision=PROJECT_BF16)
    assert checkpointed.activations_bytes == s * (28 * 4 * d + by_hand + outside)  # inputs + one recomputed layer


# A Qwen3 whose attention width (8 heads x 64) is not its hidden size (256), so that no term can stand in for another.
TERMS_GEOMETRY = {**PRESETS["qwen3-tiny"], "head_dim": 64, "intermediate_size": 640}


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each counted once (views and shared casts share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _terms_model(layers: int, lora_rank: int, base: str, fused: bool = False):
    """The model whose saved tensors are measured: fp32 or bf16 weights (a bf16 LoRA base, as common.models loads
    it under --dtype bf16), or QLoRA's 4-bit base (bitsandbytes on the CPU), with LoRA on top where asked (`fused`:
    --lora-fused)."""
    from common.models import add_lora, load_model_4bit, load_tokenizer

    torch.manual_seed(0)
    if base == "nf4":
        PRESETS["terms-geometry"] = {**TERMS_GEOMETRY, "num_hidden_layers": layers}
        try:
            model = load_model_4bit("terms-geometry", load_tokenizer("qwen3-tiny"), "sdpa", torch.device("cpu"))
        finally:
            del PRESETS["terms-geometry"]
    else:
        config = Qwen3Config(**{**TERMS_GEOMETRY, "num_hidden_layers": layers}, **PRESET_COMMON)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                 dtype=torch.bfloat16 if base == "bf16" else torch.float32)
    return add_lora(model, lora_rank, 2.0 * lora_rank, fused=fused) if lora_rank else model


def _saving(model, saved: list[torch.Tensor]):
    """A pack hook that keeps every saved tensor except the parameters and bf16 copies of them (autocast's, counted
    apart as `compute_copy`). The tensor itself is kept, not its address: a saved tensor of a graph branch freed
    during the forward would otherwise hand its storage to a later one, which would then count once for two."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {shape for p in model.parameters() for shape in (tuple(p.shape), tuple(p.shape[::-1]))}
    for module in model.modules():  # --lora-fused: the stacked A of a group's shared down product, cast too
        for group in getattr(module, "lora_shared_groups", ()):
            rows = sum(layer.lora_A[layer.active_adapters[0]].weight.shape[0] for layer in group.layers)
            weight_shapes |= {(rows, group.layers[0].in_features), (group.layers[0].in_features, rows)}

    def keep(tensor):
        is_weight_copy = tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in weight_shapes
        if tensor.untyped_storage().data_ptr() not in parameters and not is_weight_copy:
            saved.append(tensor)
        return tensor
    return keep


def _saved_bytes_per_token(layers: int, autocast: bool, packed: bool, lora_rank: int = 0, base: str = "fp32",
                           seq_len: int = 96, fused: bool = False, masters: bool = False) -> float:
    """Bytes autograd keeps for backward after one forward of the whole model, per token. Tensors sharing storage
    count once. `masters`: the trainable weights made bf16 beside fp32 masters, as single-ft's --dtype bf16 does."""
    model = _terms_model(layers, lora_rank, base, fused)
    if masters:
        MasterWeights(model)
    model.train()
    saved: list[torch.Tensor] = []
    half = seq_len // 2
    position_ids = torch.cat([torch.arange(half), torch.arange(seq_len - half)]) if packed else torch.arange(seq_len)
    with torch.autograd.graph.saved_tensors_hooks(_saving(model, saved), lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=torch.randint(0, 8000, (1, seq_len)), position_ids=position_ids[None],
              attention_mask=None, use_cache=False)
    return _unique_bytes(saved) / seq_len


def _compiled_layer_bytes_per_token(autocast: bool, packed: bool, lora_rank: int, base: str,
                                    seq_len: int = 96, fused: bool = False) -> float:
    """Bytes one compiled decoder layer keeps for backward, per token: the layer alone, given an input that needs
    its gradient (as every layer's but the first does) and the model's RoPE tables (shared by all layers, not
    counted)."""
    model = _terms_model(1, lora_rank, base, fused)
    model.train()
    decoder = model.get_decoder()
    layer = decoder.layers[0]
    layer.compile()
    dtype = torch.bfloat16 if base == "bf16" else torch.float32
    x = torch.randn(1, seq_len, TERMS_GEOMETRY["hidden_size"], dtype=dtype, requires_grad=True)
    half = seq_len // 2
    position_ids = (torch.cat([torch.arange(half), torch.arange(seq_len - half)]) if packed
                    else torch.arange(seq_len))[None]
    saved: list[torch.Tensor] = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        cos_sin = decoder.rotary_emb(x, position_ids)
        mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=position_ids)
        with torch.autograd.graph.saved_tensors_hooks(_saving(model, saved), lambda tensor: tensor):
            layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin, use_cache=False)
    tables = {t.untyped_storage().data_ptr() for t in cos_sin}
    return _unique_bytes([t for t in saved if t.untyped_storage().data_ptr() not in tables]) / seq_len


TERM_CASES = {  # name: autocast, packed, LoRA rank, base weights
    "fp32": (False, False, 0, "fp32"),
    "autocast packed": (True, True, 0, "fp32"),
    "LoRA on an fp32 base": (True, False, 8, "fp32"),
    "LoRA on a bf16 base, packed": (True, True, 8, "bf16"),
    "QLoRA": (True, False, 8, "nf4"),
}


@pytest.mark.parametrize("case", TERM_CASES)
def test_activation_formula_matches_what_autograd_keeps(case):
    """One forward on CPU (no training): the difference between 3 and 2 layers is one layer's saved tensors (the
    first layer is left out: under LoRA its input needs no gradient)."""
    autocast, packed, lora_rank, base = TERM_CASES[case]
    if base == "nf4":
        pytest.importorskip("bitsandbytes")
    shape = model_shape(Qwen3Config(**TERMS_GEOMETRY, **PRESET_COMMON))
    compute_bytes = 2 if autocast or base == "bf16" else 4
    # The residual stream: the embedding's dtype (fp32 weights, QLoRA's fp32 embedding, a bf16 base)
    residual = 2 if base == "bf16" else 4
    terms = layer_activation_terms(shape, compute_bytes=compute_bytes, autocast=autocast, seq_len=96,
                                   attention="sdpa-packed" if packed else "sdpa", lora_rank=lora_rank,
                                   residual_bytes=residual, projection_bytes=4 if base == "nf4" else None)
    two, three = (_saved_bytes_per_token(n, autocast, packed, lora_rank, base) for n in (2, 3))
    assert three - two == pytest.approx(sum(terms.values()), abs=1e-9)
    outside = outside_layers_bytes_per_token(shape, compute_bytes=compute_bytes, autocast=autocast,
                                             lora_rank=lora_rank, residual_bytes=residual)
    if lora_rank:
        # The frozen embedding's output needs no gradient: the first layer's input norm keeps nothing of its own
        # (4d + 4 less than every other layer's), and the embedding keeps no input ids.
        assert two - 2 * (three - two) == pytest.approx(outside - (4 * shape.hidden + 4), abs=1e-9)
    else:
        # Outside the layers: the formula, plus the int64 input ids the embedding keeps (8 bytes per token)
        assert two - 2 * (three - two) == outside + 8


@pytest.mark.parametrize("lora_rank", [0, 8])
def test_single_ft_bf16_weights_keep_what_estimate_prices(lora_rank):
    """single-ft --dtype bf16 (common/precision.py): bf16 weights beside fp32 masters, no autocast. One layer keeps
    the no-autocast terms with a bf16 residual stream (the normed inputs shared by the projections, no casts), which
    is how estimate() prices strategy "single" at bf16."""
    shape = model_shape(Qwen3Config(**TERMS_GEOMETRY, **PRESET_COMMON))
    assert not uses_autocast("single", MASTER_BF16)
    terms = layer_activation_terms(shape, compute_bytes=2, autocast=False, seq_len=96, attention="sdpa-packed",
                                   lora_rank=lora_rank, residual_bytes=2)
    base = "bf16" if lora_rank else "fp32"  # as weights_dtype loads them; MasterWeights makes the trainable ones bf16
    two, three = (_saved_bytes_per_token(n, False, True, lora_rank, base, masters=True) for n in (2, 3))
    assert three - two == pytest.approx(sum(terms.values()), abs=1e-9)
    autocast_terms = layer_activation_terms(shape, compute_bytes=2, autocast=True, seq_len=96, attention="sdpa-packed",
                                            lora_rank=lora_rank, residual_bytes=2 if lora_rank else 4)
    assert sum(terms.values()) < sum(autocast_terms.values())  # what dropping autocast saves per layer


COMPILED_CASES = {  # name: autocast, packed, LoRA rank, base weights
    "autocast packed": (True, True, 0, "fp32"),
    "bf16 weights, no autocast (FSDP's compute)": (False, False, 0, "bf16"),
    "LoRA on a bf16 base": (True, False, 8, "bf16"),
}


@pytest.mark.parametrize("case", COMPILED_CASES)
def test_compiled_layer_terms_match_what_autograd_keeps(case):
    """--compile: one compiled decoder layer's saved tensors against the compiled terms (activations.py, section
    2). AOTAutograd's partitioner decides what a compiled layer keeps; this holds the formula to it."""
    autocast, packed, lora_rank, base = COMPILED_CASES[case]
    shape = model_shape(Qwen3Config(**TERMS_GEOMETRY, **PRESET_COMMON))
    compute_bytes = 2
    terms = layer_activation_terms(shape, compute_bytes=compute_bytes, autocast=autocast, seq_len=96,
                                   attention="sdpa-packed" if packed else "sdpa", lora_rank=lora_rank,
                                   residual_bytes=2 if base == "bf16" else 4, compiled=True)
    eager = layer_activation_terms(shape, compute_bytes=compute_bytes, autocast=autocast, seq_len=96,
                                   attention="sdpa-packed" if packed else "sdpa", lora_rank=lora_rank,
                                   residual_bytes=2 if base == "bf16" else 4)
    measured = _compiled_layer_bytes_per_token(autocast, packed, lora_rank, base)
    assert measured == pytest.approx(sum(terms.values()), abs=1e-9)
    assert measured < 0.75 * sum(eager.values())  # what compiling buys


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_lora_terms_match_what_autograd_keeps(compiled):
    """--lora-fused on a bf16 base under autocast: what a layer keeps against the terms with lora_fused, and less
    than peft's own adapters keep (o_proj's input is not cast again; eagerly, q/k/v and gate/up share their casts)."""
    shape = model_shape(Qwen3Config(**TERMS_GEOMETRY, **PRESET_COMMON))

    def terms(fused):
        return sum(layer_activation_terms(shape, compute_bytes=2, autocast=True, seq_len=96, attention="sdpa",
                                          lora_rank=8, residual_bytes=2, compiled=compiled,
                                          lora_fused=fused).values())

    def measured(fused):
        if compiled:
            return _compiled_layer_bytes_per_token(True, False, 8, "bf16", fused=fused)
        return _saved_bytes_per_token(3, True, False, 8, "bf16", fused=fused) - \
            _saved_bytes_per_token(2, True, False, 8, "bf16", fused=fused)

    assert measured(True) == pytest.approx(terms(True), abs=1e-9)
    q_width, d = shape.heads * shape.head_dim, shape.hidden
    assert terms(False) - terms(True) == 2 * q_width + (0 if compiled else 3 * 2 * d)


# ---------------------------------------------------------------------------------------------------------------
# Every GPU run committed under devlog/data, against its prediction
GPU_RUNS = sorted(path.parent for path in (REPO_ROOT / "devlog" / "data").rglob("summary.json")
                  if json.loads(path.read_text())["hardware"]["device_kind"] in ("cuda", "rocm"))
PEAK_TOLERANCE = 0.15  # |predicted / max_memory_reserved - 1|; runs measured under PEAK_TESTED_FROM_GIB are skipped


def test_gpu_runs_are_committed():
    assert len(GPU_RUNS) >= 10  # the first GPU entry's ladder (devlog/2026-11-26-gpu-suite-nvidia-h200.md)


@pytest.mark.parametrize("run", GPU_RUNS, ids=lambda run: run.name)
def test_every_gpu_run_peak_is_predicted(run):
    """The prediction for the settings the run had (common.memory.predict_run: its summary.json's model, strategy,
    batch layout, attention, the chunked loss, compile, LoRA), within PEAK_TOLERANCE of the max_memory_reserved it
    measured; a miss names the run and the prediction's largest term."""
    summary = json.loads((run / "summary.json").read_text())
    if summary["experiment"] not in EXPERIMENT_STRATEGY:
        pytest.skip(f"{summary['experiment']} is not one of ours: its states are TRL's, not priced here")
    assert summary["memory_measure"] == "max_memory_reserved"
    predicted, measured = predict_run(summary), summary["peak_mem_gib"]
    if measured < PEAK_TESTED_FROM_GIB:
        pytest.skip(f"{run.name}: {measured:.2f} GiB measured, {predicted.total_gib:.2f} predicted: below "
                    f"{PEAK_TESTED_FROM_GIB} GiB the fixed allocations the model leaves out dominate")
    terms = {name: getattr(predicted, field) / GIB for name, field in (
        ("weights", "weights_bytes"), ("optimizer", "optimizer_bytes"), ("copies", "compute_copy_bytes"),
        ("activations", "activations_bytes"), ("logits", "logits_bytes"), ("buffers", "buffers_bytes"))}
    largest = max(terms, key=terms.get)
    assert predicted.total_gib / measured - 1 == pytest.approx(0, abs=PEAK_TOLERANCE), (
        f"{run.name}: predicted {predicted.total_gib:.2f} GiB, measured {measured:.2f} GiB; the largest term, "
        f"{largest}, is {terms[largest]:.2f} GiB ({', '.join(f'{k} {v:.2f}' for k, v in terms.items())})")


def test_the_error_band_is_the_largest_under_prediction_of_the_committed_gpu_runs():
    """ERROR_BAND is stored (the CLI runs without devlog/); recomputed from the committed GPU runs by the same rule
    as the peak test above (runs measured under PEAK_TESTED_FROM_GIB left out), it must be the same: a new run that
    needs more than the band says, or a model change that moves the worst run, makes it stale, and this fails."""
    checks = gpu_peak_checks(REPO_ROOT / "devlog" / "data")
    tested = [run for run in GPU_RUNS if json.loads((run / "summary.json").read_text())["experiment"]
              in EXPERIMENT_STRATEGY and json.loads((run / "summary.json").read_text())["peak_mem_gib"]
              >= PEAK_TESTED_FROM_GIB]
    assert len(checks) == len(tested) >= 10
    worst = max(checks, key=lambda check: check.under)
    assert error_band(checks) == ERROR_BAND, (
        f"ERROR_BAND is {ERROR_BAND}, the committed GPU runs say {error_band(checks)} (worst: {worst.run}, "
        f"{worst.measured_gib:.2f} GiB reserved, {worst.predicted_gib:.2f} predicted): update common/memory/states.py")
    assert ERROR_BAND >= ERROR_BAND_FLOOR and worst.under <= ERROR_BAND < worst.under + 0.01


def test_error_band_rounds_up_and_keeps_its_floor():
    def check(measured: float, predicted: float) -> PeakCheck:
        return PeakCheck("run", predicted, measured, None)

    assert error_band([check(11.3, 10.0), check(9.0, 10.0)]) == 0.13  # 13% under: 0.13, not 0.12
    assert error_band([check(11.0, 10.0)]) == 0.10  # exactly 10% stays 0.10
    assert error_band([check(9.0, 10.0)]) == ERROR_BAND_FLOOR  # only over-predictions: the floor
    assert error_band([]) == ERROR_BAND_FLOOR


def test_a_rung_just_under_the_usable_memory_is_refused_with_its_margin():
    """The margin rule: a rung whose peak is just under a GPU's usable share fits without the margin, not with it;
    the recommendation and the ladder's JSON both take the next rung, and the CLI prints the margin it kept."""
    e = estimate("qwen3-1.7b", "single", micro_batch_size=2, attention="flash", loss_chunk_tokens=1024, compile=True)
    just_above_peak = e.total_gib / USABLE_FRACTION * 1.001  # the peak alone fits: 99.9% of the usable share
    assert e.total_gib <= just_above_peak * USABLE_FRACTION and not e.fits(just_above_peak)
    assert e.needed_gib == pytest.approx(e.total_gib * (1 + ERROR_BAND)) and e.margin_gib > 0
    assert e.fits(e.needed_gib / USABLE_FRACTION * 1.001)
    rungs = Ladder("qwen3-1.7b", 1, rows_per_gpu=2).rungs()
    first = rungs[0]  # the ladder's first rung is this one: without the margin it would be the answer
    assert (first.strategy, first.micro_batch_size, first.activation_checkpointing) == ("single", 2, False)
    assert first.estimate.total_gib == e.total_gib
    advice = recommend("qwen3-1.7b", 1, just_above_peak, rows_per_gpu=2)
    assert advice.rung != first and advice.choice.needed_gib <= just_above_peak * USABLE_FRACTION
    assert next(r for r in rungs if r.estimate.fits(just_above_peak)) == advice.rung


def test_cli_prints_the_margin_and_refuses_the_old_unit(capsys):
    main(["--model", "qwen3-4b", "--gpus", "2", "--gpu-mem-gib", "80"])
    out = capsys.readouterr().out
    (peak,) = [line for line in out.splitlines() if line.startswith("predicted peak: ")]
    assert f"margin ({ERROR_BAND:.0%})" in peak and peak.endswith("of 72.00 GiB usable")
    total, margin = float(peak.split()[2]), float(peak.split(" + ")[1].split()[0])
    assert margin == pytest.approx(total * ERROR_BAND, abs=0.006)
    assert "recommendation: fsdp" in out  # ddp + checkpointing's 71.4 GiB is under 72.0, not with its margin
    with pytest.raises(SystemExit) as stop:
        main(["--model", "qwen3-4b", "--gpu-mem-gb", "80"])
    assert stop.value.code == 2 and "--gpu-mem-gb is now --gpu-mem-gib" in capsys.readouterr().err


def test_named_gpus_are_at_their_real_size():
    # The makers' "80GB" is rounded: an H100 80GB reports 81,559 MiB. --gpu takes the card at that size.
    assert GPU_MEMORY_GIB["H100"] == 79.65 and GPU_MEMORY_GIB["RTX 4090"] == 23.99
    assert all(gib < float(name.split()[-1].removesuffix("GB")) + 0.5 for name, gib in GPU_MEMORY_GIB.items()
               if name.endswith("GB"))
    assert recommend("qwen3-4b", 2, GPU_MEMORY_GIB["H100"]).gpu_mem_gib == 79.65


# ---------------------------------------------------------------------------------------------------------------
# LoRA
def test_lora_shrinks_grads_and_optimizer_to_the_adapters():
    shape = model_shape("qwen3-0.6b")
    # rank x (in + out) for q, k, v, o, gate, up, down, per layer
    adapters = 16 * 28 * ((1024 + 2048) + 2 * (1024 + 1024) + (2048 + 1024) + 2 * (1024 + 3072) + (3072 + 1024))
    assert shape.lora_parameters(16) == adapters == 10_092_544
    # one process under autocast
    full, lora = estimate(shape, "ddp", precision=PROJECT_BF16), estimate(shape, "ddp", lora_rank=16,
                                                                          precision=PROJECT_BF16)
    assert lora.grads_bytes == adapters * 4
    assert lora.optimizer_bytes == adapters * 8
    assert lora.weights_bytes == shape.total_parameters * 2 + adapters * 4  # a bf16 base, fp32 adapters
    assert lora.compute_copy_bytes == adapters * 2  # autocast casts the adapters; the bf16 base needs no copy
    assert lora.total_bytes < full.total_bytes
    # single-ft: bf16 adapters with fp32 masters, nothing cast
    single = estimate(shape, "single", lora_rank=16)
    assert (single.weights_bytes, single.master_bytes, single.grads_bytes, single.compute_copy_bytes) == (
        (shape.total_parameters + adapters) * 2, adapters * 4, adapters * 4, 0)
    # --dtype fp32 keeps the base in fp32
    assert estimate(shape, "single", lora_rank=16, precision="fp32").weights_bytes == (
        shape.total_parameters + adapters) * 4
    # DeepSpeed casts every parameter of the module to bf16, the frozen base included
    assert estimate(shape, "zero-2", 2, lora_rank=16).weights_bytes == (shape.total_parameters + adapters) * 2


def test_qlora_states_are_what_bitsandbytes_holds():
    """QLoRA's model states, counted from the tensors of a real 4-bit model (bitsandbytes quantizes on the CPU too):
    NF4 weights with their double-quantized absmaxes, the fp32 embedding and norms, fp32 adapters. The prediction
    leaves out each 4-bit tensor's two 256-entry fp32 code books and offset (2 KiB a tensor)."""
    pytest.importorskip("bitsandbytes")
    from common.memory import NF4_BYTES_PER_WEIGHT
    from common.metrics import state_bytes
    from common.models import add_lora, load_model_4bit, load_tokenizer

    torch.manual_seed(0)
    model = add_lora(load_model_4bit("qwen3-tiny", load_tokenizer("qwen3-tiny"), "sdpa", torch.device("cpu")), 8, 16)
    quantized = [p for p in model.parameters() if hasattr(p, "quant_state")]
    assert len(quantized) == 4 * 7  # every projection of every layer
    measured = state_bytes(model.parameters())
    predicted = estimate("qwen3-tiny", "single", lora_rank=8, qlora=True, seq_len=256)
    assert 0 <= measured["weights"] - predicted.weights_bytes <= len(quantized) * (2 * 256 * 4 + 8)
    assert NF4_BYTES_PER_WEIGHT == 0.5 + 1 / 64 + 4 / (64 * 256)  # 4.127 bits, the QLoRA paper's
    with pytest.raises(ValueError, match="QLoRA runs in single and ddp"):
        estimate("qwen3-tiny", "fsdp", 2, lora_rank=8, qlora=True)


def test_lora_count_matches_peft():
    from peft import LoraConfig, get_peft_model

    config = Qwen3Config(**PRESETS["qwen3-tiny"], **PRESET_COMMON)
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert model_shape(config).lora_parameters(8) == trainable
    # leaf_modules lists the same parameters peft's model has, adapters and frozen base alike
    embedding, layers, tail = leaf_modules(model_shape(config), 8)
    modules = (embedding, *(m for layer in layers for m in layer), *tail)
    listed = {name: n for module in modules for name, n, _ in module}
    assert sum(listed.values()) == sum(p.numel() for p in model.parameters())
    assert sum(n for module in (m for layer in layers for m in layer) for _, n, trainable in module if trainable) \
        == trainable


# ---------------------------------------------------------------------------------------------------------------
# DDP and FSDP, as ddp-ft and fsdp-ft run them
def test_ddp_gradients_are_its_buckets():
    # ddp-ft wraps with gradient_as_bucket_view=True: the gradients are views into the all-reduce buckets, so
    # nothing beyond the fp32 gradients themselves (LoRA: the adapters' only).
    # The buckets exist from the first backward on, so the gradients are held at the start of every backward; one
    # process with zero_grad(set_to_none=True) and one micro-batch has none then.
    # Under --dtype bf16 (common/precision.py) the buckets are bf16, of the bf16 weights', beside single-ft's layout:
    # they are held at every backward, the fp32 masters' gradients (which they all-reduce) from a step's second
    # micro-batch on, as single-ft's; the step frees them with the weights.
    for lora_rank in (0, 16):
        ddp = estimate("qwen3-0.6b", "ddp", 2, lora_rank=lora_rank, precision=PROJECT_BF16)  # fp32 weights, autocast
        single = estimate("qwen3-0.6b", "single", lora_rank=lora_rank, precision=PROJECT_BF16)  # ddp's layout
        assert ddp.buffers_bytes == 0 and ddp.model_states_bytes == single.model_states_bytes
        assert ddp.grads_held_bytes == ddp.grads_bytes and single.grads_held_bytes == 0
        assert ddp.forward_bytes == single.forward_bytes + ddp.grads_bytes
        # with two micro-batches the single process holds the first one's gradients too
        assert estimate("qwen3-0.6b", "single", lora_rank=lora_rank, grad_accum=2,
                        precision=PROJECT_BF16).total_bytes == ddp.total_bytes
        for grad_accum in (1, 2):
            masters = estimate("qwen3-0.6b", "ddp", 2, lora_rank=lora_rank, grad_accum=grad_accum)
            alone = estimate("qwen3-0.6b", "single", lora_rank=lora_rank, grad_accum=grad_accum)
            buckets = alone.grads_bytes / 4 * 2
            assert masters.buffers_bytes == 0 and masters.grads_bytes == alone.grads_bytes + buckets
            assert masters.grads_held_bytes == alone.grads_held_bytes + buckets
            assert masters.forward_bytes == alone.forward_bytes + buckets and masters.step_bytes == alone.step_bytes


def test_fsdp_units_and_gradients_by_hand():
    # Qwen3-4B over 2 ranks, bf16: FSDP2 gathers the root (embedding E + final norm d, never resharded before
    # backward) and 2 layers in bf16. Each unit's gradients arrive in bf16 and are copied into an fp32
    # reduce-scatter input; the root's bf16 gradient (LM-head half first) lives until the embedding's half arrives
    # at the end of backward: max(2 R + 6 L, 6 R).
    shape = model_shape("qwen3-4b")
    root, layer = shape.embedding_parameters + 2560, shape.layer_parameters
    assert root == 388_958_720 and layer == 100_930_816
    gathered = (root + 2 * layer) * 2
    fsdp = estimate(shape, "fsdp", 2)
    assert fsdp.buffers_bytes == gathered + max(2 * root + 6 * layer, 6 * root) == gathered + 6 * root
    assert (fsdp.weights_bytes, fsdp.grads_bytes, fsdp.optimizer_bytes, fsdp.master_bytes) == (
        QWEN3_4B_PARAMETERS * 4 / 2, QWEN3_4B_PARAMETERS * 4 / 2, QWEN3_4B_PARAMETERS * 8 / 2, 0)
    # fsdp-ft with --grad-accum 4 reduce-scatters only in the last micro-batch: every unit's unsharded gradient,
    # upcast to fp32 to accumulate, is alive until then (16 GB for 4B), plus one layer's reduce-scatter.
    accumulating = estimate(shape, "fsdp", 2, grad_accum=4)
    assert accumulating.buffers_bytes == gathered + QWEN3_4B_PARAMETERS * 4 + 6 * layer
    # DDP's buckets and DeepSpeed's flat buffers hold the gradients whatever the micro-batch count: no change;
    # tensor parallelism holds its gradients between micro-batches like one process does
    for strategy in ("ddp", "zero-2", "zero-3"):
        precision = PROJECT_BF16 if strategy == "ddp" else "bf16"  # fp32 DDP buckets (bf16: see above)
        assert estimate(shape, strategy, 2, grad_accum=4, precision=precision) == estimate(shape, strategy, 2,
                                                                                          precision=precision)
    tp, tp_accumulating = estimate(shape, "tp", 2), estimate(shape, "tp", 2, grad_accum=4)
    assert tp_accumulating.forward_bytes == tp.forward_bytes + tp.grads_bytes
    # --no-reshard-after-forward (and the gather-once setting) keeps every layer gathered until its backward
    kept = estimate(shape, "fsdp", 2, reshard_after_forward=False)
    assert kept.buffers_bytes == (root + 36 * layer) * 2 + 6 * root
    # fsdp-offload keeps the same units on the GPU and every sharded state on the host
    offload = estimate(shape, "fsdp-offload", 2)
    assert offload.model_states_bytes == 0 and offload.buffers_bytes == fsdp.buffers_bytes
    assert offload.cpu_bytes == fsdp.model_states_bytes


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed, as zero-ft runs it
@pytest.mark.parametrize("devices", [2, 8])
def test_deepspeed_model_states_by_stage(devices):
    """Bytes per parameter read off DeepSpeed 0.19.8 (module docstring, section 1), for Qwen3-0.6B, full SFT."""
    P, N, c = 596_049_920, devices, 2
    states = {(stage, dtype): estimate("qwen3-0.6b", f"zero-{stage}", N, precision=dtype)
              for stage in (1, 2, 3) for dtype in ("bf16", "fp32")}

    def per_param(e):
        return (e.weights_bytes / P, e.grads_bytes / P, e.master_bytes / P, e.optimizer_bytes / P)

    # zero-1 bf16 is BF16_Optimizer: bf16 weights, the bf16 gradients autograd writes + a full fp32 gradient buffer
    assert per_param(states[1, "bf16"]) == pytest.approx((2, c + 4, 4 / N, 8 / N))
    assert per_param(states[1, "fp32"]) == pytest.approx((4, 4, 4 / N, 8 / N))  # the master is a separate clone
    assert per_param(states[2, "bf16"]) == pytest.approx((2, 4 / N, 4 / N, 8 / N))
    assert per_param(states[2, "fp32"]) == pytest.approx((4, 4 / N, 4 / N, 8 / N))
    persistent = 65_536 / P  # the norms, gathered beside their partition
    assert per_param(states[3, "bf16"]) == pytest.approx((2 / N + 2 * persistent, 4 / N, 4 / N, 8 / N))
    assert per_param(states[3, "fp32"]) == pytest.approx((4 / N + 4 * persistent, 4 / N, 4 / N, 8 / N))
    for (stage, _), e in states.items():
        assert e.compute_copy_bytes == 0  # no autocast under DeepSpeed


def test_deepspeed_buffers_by_hand():
    shape, B = model_shape("qwen3-4b"), DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    E = shape.embedding_parameters
    assert largest_trainable_parameter(shape) == E and largest_trainable_parameter(shape, 16) == 16 * 9728
    # zero-1 bf16 (BF16_Optimizer) all-reduces its fp32 gradient buffer in place: 4B's matrices exceed one
    # all-reduce bucket (5e8 elements). qwen3-tiny's do not, and its two param groups are flattened into one copy.
    assert estimate(shape, "zero-1", 8).buffers_bytes == 0
    tiny = model_shape(Qwen3Config(**PRESETS["qwen3-tiny"], **PRESET_COMMON))
    assert estimate(tiny, "zero-1", 2).buffers_bytes == tiny.total_parameters * 4
    assert estimate(tiny, "zero-1", 2, lora_rank=8).buffers_bytes == 0  # one param group (adapters): in place
    # Stages 1 (fp32) and 2: the bucket in the module's dtype, allocated whole, + the fp32 tensor the collective
    # reduces; stage 2 also the largest gradient (the tied embedding) in bf16. The same for any N, and for LoRA.
    assert estimate(shape, "zero-1", 8, precision="fp32").buffers_bytes == B * 4 + B * 4
    for devices in (2, 8):
        assert estimate(shape, "zero-2", devices).buffers_bytes == B * 2 + B * 4 + E * 2
    assert estimate(shape, "zero-2", 2, lora_rank=16).buffers_bytes == B * 2 + shape.lora_parameters(16) * 4 \
        + 16 * 9728 * 2
    # Stage 3: an fp32 bucket, its flattened copy, the largest gradient and the gathered parameters
    gathered = zero3_gathered_elements(shape)
    assert estimate(shape, "zero-3", 8).buffers_bytes == B * 4 + B * 4 + E * 2 + gathered * 2
    # one rank gathers nothing: its parameters are views of its whole partition
    assert estimate(shape, "zero-3", 1).buffers_bytes == B * 4 + B * 4 + E * 2
    assert estimate(shape, "zero-3", 1).weights_bytes == QWEN3_4B_PARAMETERS * 2


def test_zero3_gathers_what_its_coordinator_keeps():
    # stage3_max_reuse_distance = 1e9 elements: a parameter used again within the next 1e9 elements of the step's
    # module order stays gathered. All of Qwen3-0.6B (5.96e8 elements) fits in that window, so after the first
    # step every parameter stays gathered: the whole model, less the persistent norms counted apart.
    small = model_shape("qwen3-0.6b")
    assert zero3_gathered_elements(small) == small.total_parameters - zero3_persistent_parameters(small)
    # Qwen3-4B (4.0e9) does not fit: prefetching (5e7 at a time) runs ahead until stage3_max_live_parameters (1e9)
    # are gathered, overshooting by at most one parameter (the embedding, 3.9e8) and the module being run.
    large = model_shape("qwen3-4b")
    gathered = zero3_gathered_elements(large)
    assert 1e9 <= gathered <= 1e9 + large.embedding_parameters + large.layer_parameters
    assert gathered > large.embedding_parameters + 2 * large.layer_parameters  # more than FSDP2's root + 2 layers
    # Persistence: below 1e5 elements, the norms; with LoRA r16 on 0.6B, every adapter matrix as well
    assert zero3_persistent_parameters(small, 16) == 65_536 + small.lora_parameters(16)
    assert all(n < DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD for n in (16 * 3072, 3072 * 16))


def test_offload_keeps_on_the_gpu_only_what_deepspeed_leaves_there():
    shape, P, N = model_shape("qwen3-4b"), QWEN3_4B_PARAMETERS, 2
    E, B = shape.embedding_parameters, DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    zero2 = estimate(shape, "zero-2-offload", N)
    # GPU: the bf16 weights; the zero-2 buffers and a staging buffer for one gradient
    assert (zero2.weights_bytes, zero2.grads_bytes, zero2.optimizer_bytes, zero2.master_bytes) == (2 * P, 0, 0, 0)
    assert zero2.buffers_bytes == estimate(shape, "zero-2", N).buffers_bytes + E * 2
    # host: fp32 master, fp32 gradient partition, AdamW m and v, + a bf16 copy of the partition and one gradient
    assert zero2.cpu_bytes - zero2.cpu_buffers_bytes == pytest.approx(16 * P / N)
    assert zero2.cpu_buffers_bytes == pytest.approx(2 * P / N + 2 * E)
    zero3 = estimate(shape, "zero-3-offload", N)
    assert zero3.model_states_bytes == pytest.approx(2 * P / N + 2 * zero3_persistent_parameters(shape))
    assert zero3.cpu_bytes == pytest.approx(16 * P / N) and zero3.cpu_buffers_bytes == 0
    assert zero3.buffers_bytes == estimate(shape, "zero-3", N).buffers_bytes == B * 8 + E * 2 + \
        zero3_gathered_elements(shape) * 2


# ---------------------------------------------------------------------------------------------------------------
# Against DeepSpeed's own estimators, called for real. Shared assumptions: full SFT (every parameter trainable),
# bf16 weights with an fp32 master copy and fp32 AdamW m and v, N GPUs on one node, model states only (DeepSpeed
# counts no activations, logits or buffers). P and the largest layer are counted as DeepSpeed counts them
# (test_deepspeed_counts_parameters_as_the_model_does). Known differences, each named where it is reconciled:
# - ZeRO-2: DeepSpeed's 18 P / N includes 2 bytes of 16-bit gradients that stage 2 does not keep (this model: 16);
# - ZeRO-3: DeepSpeed's 4 x largest layer is that layer gathered (2) with its gradient (2); this model keeps the
#   gradient half, counts what the coordinator really keeps gathered instead, and the persistent parameters;
# - buckets and the largest gradient: this model only;
# - host memory: DeepSpeed's additional_buffer_factor 1.5 and 4 P per GPU for loading the model; this model's
#   staging copies.
def _deepspeed_estimators():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import; no GPU probing
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def test_deepspeed_counts_parameters_as_the_model_does():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import model_to_params

    config = Qwen3Config(**PRESETS["qwen3-tiny"], **PRESET_COMMON)
    total, largest_layer = model_to_params(AutoModelForCausalLM.from_config(config))  # the tied head counted once
    shape = model_shape(config)
    assert (total, largest_layer) == (shape.total_parameters, shape.embedding_parameters)


MODELS_AND_GPUS = [(model, gpus) for model in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b") for gpus in (1, 2, 4, 8)]


@pytest.mark.parametrize("model,gpus", MODELS_AND_GPUS)
def test_zero2_against_deepspeeds_estimator(model, gpus):
    zero2_estimator, _ = _deepspeed_estimators()
    shape = model_shape(model)
    P, E, N, B = shape.total_parameters, shape.embedding_parameters, gpus, DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    host, gpu = zero2_estimator(P, num_gpus_per_node=N, cpu_offload=False)
    ours = estimate(shape, "zero-2", N)
    # DeepSpeed: 2 P + int(18 P / N). This model: 2 P + 16 P / N, + the 2 P / N of 16-bit gradients DeepSpeed
    # counts: term by term, equal to the byte (DeepSpeed rounds down).
    sixteen_bit_gradients = 2 * P / N
    assert gpu == pytest.approx(ours.model_states_bytes + sixteen_bit_gradients, abs=1)
    assert ours.weights_bytes == 2 * P and ours.grads_bytes + ours.master_bytes + ours.optimizer_bytes == \
        pytest.approx(16 * P / N)
    # ... and what DeepSpeed leaves out: the bucket, its fp32 copy, the embedding's bf16 gradient
    assert ours.buffers_bytes == 2 * B + 4 * min(B, P) + 2 * E
    # Host memory without offload: DeepSpeed's 4 P per GPU x 1.5 for loading the model; not modelled here.
    assert host == int(P * 4 * N * 1.5) and ours.cpu_bytes == 0


@pytest.mark.parametrize("model,gpus", MODELS_AND_GPUS)
def test_zero3_against_deepspeeds_estimator(model, gpus):
    _, zero3_estimator = _deepspeed_estimators()
    shape = model_shape(model)
    P, E, N, B = shape.total_parameters, shape.embedding_parameters, gpus, DEEPSPEED_REDUCE_BUCKET_ELEMENTS
    _, gpu, largest_layer_memory = zero3_estimator(P, E, num_gpus_per_node=N, cpu_offload=False)
    ours = estimate(shape, "zero-3", N)
    persistent = 2 * zero3_persistent_parameters(shape) if N > 1 else 0  # gathered beside the partition
    assert ours.model_states_bytes - persistent == pytest.approx(18 * P / N)  # DeepSpeed's 18 P / N, exactly
    # DeepSpeed's 4 x largest layer = that layer gathered in bf16 (2 E) + its bf16 gradient (2 E)
    gathered_largest_layer, largest_gradient = 2 * E, 2 * E
    assert largest_layer_memory == gathered_largest_layer + largest_gradient
    assert gpu == pytest.approx(ours.model_states_bytes - persistent + gathered_largest_layer + largest_gradient,
                                abs=1)
    # This model keeps the gradient half and, instead of the largest layer, everything the coordinator keeps
    # gathered (none on one rank), and adds the fp32 bucket with its copy.
    gathered = zero3_gathered_elements(shape) if N > 1 else 0
    assert ours.buffers_bytes == largest_gradient + 2 * gathered + 4 * B + 4 * min(B, P)
    if N > 1:
        assert gathered >= E


@pytest.mark.parametrize("model,gpus", MODELS_AND_GPUS)
def test_offload_against_deepspeeds_estimators(model, gpus):
    zero2_estimator, zero3_estimator = _deepspeed_estimators()
    shape = model_shape(model)
    P, E, N = shape.total_parameters, shape.embedding_parameters, gpus
    # ZeRO-Offload: DeepSpeed's GPU 2 P is this model's bf16 weights, to the byte.
    host, gpu = zero2_estimator(P, num_gpus_per_node=N, cpu_offload=True)
    zero2 = estimate(shape, "zero-2-offload", N)
    assert gpu == zero2.model_states_bytes == 2 * P
    # Host, per node: 1.5 x the larger of the optimizer's states (this model's, summed over the N ranks: 16 P)
    # and 4 P per GPU for loading the model. This model adds its staging copies (2 P / N + 2 E per rank).
    states_on_host = (zero2.cpu_bytes - zero2.cpu_buffers_bytes) * N
    assert states_on_host == pytest.approx(16 * P)
    assert host == pytest.approx(1.5 * max(4 * P * N, states_on_host), abs=1)
    assert zero2.cpu_buffers_bytes * N == pytest.approx(2 * P + 2 * E * N)
    # ZeRO-3, optimizer offloaded, parameters on the GPU: DeepSpeed's GPU 4 x largest layer + 2 P / N.
    for zero_init in (True, False):
        host, gpu, largest_layer_memory = zero3_estimator(P, E, num_gpus_per_node=N, cpu_offload=True,
                                                          cpu_offload_params=False, zero_init=zero_init)
        zero3 = estimate(shape, "zero-3-offload", N)
        persistent = 2 * zero3_persistent_parameters(shape) if N > 1 else 0
        assert gpu == pytest.approx(zero3.model_states_bytes - persistent + largest_layer_memory, abs=1)
        # Host: 1.5 x 16 P with zero.Init (this model's states, summed), or 1.5 x the larger of that and 4 P per GPU
        # when each process loads the whole model first (zero-ft builds a preset so; a start-up peak, not modelled).
        assert zero3.cpu_bytes * N == pytest.approx(16 * P)
        loading = 0 if zero_init else 4 * P * N
        assert host == pytest.approx(1.5 * max(loading, zero3.cpu_bytes * N), rel=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# A live DeepSpeed engine holds what the model says (one process, CPU): DeepSpeed's allocations for zero-ft's config
CENSUS_BUCKET = 2**22  # a reduce bucket smaller than DeepSpeed's 5e8 elements, larger than qwen3-tiny's embedding


def _held_bytes(engine) -> dict[str, int]:
    """Bytes of the tensors an engine holds, by dtype: its module's parameters, gradients, buffers and ZeRO
    partitions, and everything its optimizer objects (DeepSpeed's and the AdamW inside) keep. Storages count once."""
    storages, visited, pending = {}, set(), [engine.module, engine.optimizer]
    while pending:
        obj = pending.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not obj.is_meta:  # DeepSpeed keeps meta-device shapes of the parameters: no memory
                storages[obj.untyped_storage().data_ptr()] = (obj.untyped_storage().nbytes(), str(obj.dtype))
            pending += [t for t in (obj.grad, getattr(obj, "ds_tensor", None)) if t is not None]
        elif isinstance(obj, torch.nn.Module):
            pending += [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, dict):
            pending += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            pending += list(obj)
        elif type(obj).__module__.startswith(("deepspeed.runtime", "torch.optim")):
            pending += list(vars(obj).values())
    totals = {}
    for nbytes, dtype in storages.values():
        totals[dtype] = totals.get(dtype, 0) + nbytes
    return totals


def _census(runs: list[tuple[int, str, int]]) -> dict:
    """Build zero-ft's DeepSpeed engine on qwen3-tiny for each (stage, dtype, LoRA rank), run one optimizer step of
    two micro-batches and the first micro-batch of the next (the state section 1 prices: gradients of an earlier
    micro-batch held), and count what the engine holds then."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from common.ds_engine import act_as_launcher_if_alone

    act_as_launcher_if_alone()
    import logging

    import deepspeed
    from conftest import load_experiment

    deepspeed.utils.logger.setLevel(logging.ERROR)
    zero_ft = load_experiment("zero-ft")
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # not built: as zero-ft on CPU (see there)
    deepspeed.init_distributed(dist_backend="gloo")
    counted = {}
    for stage, dtype, lora_rank in runs:
        config = zero_ft.Config(model="qwen3-tiny", zero_stage=stage, dtype=dtype, grad_accum=2, lora_rank=lora_rank)
        ds_config = zero_ft.deepspeed_config(config, 1)
        ds_config["zero_optimization"]["reduce_bucket_size"] = CENSUS_BUCKET
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(**PRESETS["qwen3-tiny"], **PRESET_COMMON),
                                                 attn_implementation="sdpa")
        if lora_rank:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=lora_rank, lora_dropout=0.0, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        if stage == 3:  # as zero-ft builds a preset for stage 3: parameters cast first, then partitioned
            for param in model.parameters():
                param.data = param.data.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
            deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)
        trainable = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in trainable if len(getattr(p, "ds_shape", p.shape)) >= 2], "weight_decay": 0.01},
                  {"params": [p for p in trainable if len(getattr(p, "ds_shape", p.shape)) < 2], "weight_decay": 0.0}]
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups), config=ds_config)
        ids = torch.randint(0, 8000, (1, 32))
        for _ in range(3):
            engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
            engine.step()
        counted[f"{stage}-{dtype}-{lora_rank}"] = _held_bytes(engine)
        engine.destroy()
    return counted


@pytest.mark.slow
def test_a_live_deepspeed_engine_holds_the_modelled_states():
    runs = [(1, "bf16", 0), (2, "bf16", 8), (3, "bf16", 0), (2, "fp32", 0)]
    result = subprocess.run([sys.executable, __file__, "census", json.dumps(runs)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    counted = json.loads(result.stdout.strip().splitlines()[-1])
    shape = model_shape(Qwen3Config(**PRESETS["qwen3-tiny"], **PRESET_COMMON))
    for stage, dtype, lora_rank in runs:
        e = estimate(shape, f"zero-{stage}", 1, precision=dtype, lora_rank=lora_rank)
        trainable = shape.lora_parameters(lora_rank) if lora_rank else shape.total_parameters
        bf16_gradients = trainable * 2 if (stage, dtype) == (1, "bf16") else 0  # BF16_Optimizer's module gradients
        fp32_states = e.grads_bytes - bf16_gradients + e.master_bytes + e.optimizer_bytes
        bucket = CENSUS_BUCKET * 4 if stage == 3 else 0  # stage 3 keeps its fp32 bucket; stages 1-2 free theirs
        expected = {"torch.bfloat16": e.weights_bytes + bf16_gradients, "torch.float32": fp32_states + bucket} \
            if dtype == "bf16" else {"torch.float32": e.weights_bytes + fp32_states + bucket}
        held = counted[f"{stage}-{dtype}-{lora_rank}"]
        for key, value in expected.items():  # besides: AdamW's step counters, DeepSpeed's alignment padding
            assert 0 <= held.get(key, 0) - value <= 1024, (stage, dtype, lora_rank, key, held)


# ---------------------------------------------------------------------------------------------------------------
# Decisions, checked by hand (90% of a GPU usable, and a rung fits when its peak plus ERROR_BAND of it, 15%, is within
# that; zero-ft priced as DeepSpeed's bf16: 18 bytes per parameter). Unless
# a test says otherwise the recommender takes 8 rows of 1,024 tokens per replica per step, the speed flags each
# experiment takes (varlen attention without grouped K/V heads repeated, the chunked loss of 1,024 tokens, compiled
# layers) and the largest micro-batch that fits.
QWEN3_4B_NORMS = 36 * (2 * 2560 + 2 * 128) + 2560  # every RMSNorm weight: the parameters no matrix multiply reads


def test_qwen3_4b_on_one_80gb_gpu_peaks_at_the_optimizer_step():
    # Full SFT of 4B on one 80 GB GPU (72 GiB usable). Without checkpointing even one micro-batch is too much once
    # gradients accumulate over 8 of them (4 P of fp32 gradients held at every backward after the first), and 8 rows
    # in one micro-batch keep 31.8 GiB of activations. With checkpointing, 8 rows in one micro-batch: no gradient
    # exists at the start of backward, and the peak is the optimizer step, every model state at once: 16 P bytes (the
    # fp32 masters, gradients and AdamW moments; single-ft frees its bf16 weights for the step, common/precision.py).
    advice = recommend("qwen3-4b", 1, 80, kv_expanded=False)
    assert (advice.strategy, advice.activation_checkpointing, advice.rung.micro_batch_size) == ("single", True, 8)
    assert advice.choice.peak_phase == "optimizer step"
    assert advice.choice.total_bytes == 16 * QWEN3_4B_PARAMETERS
    start = advice.choice
    assert start.forward_bytes == (2 + 4 + 8) * QWEN3_4B_PARAMETERS \
        + start.activations_bytes + start.logits_bytes  # bf16 weights, fp32 masters, AdamW: no gradient yet
    # the fused loss: one chunk of logits, the loss tokens' hidden states (bf16, its cast, its gradient), the head's
    # fp32 weight gradient
    assert start.logits_bytes == 1024 * 151_936 * (2 + 2) + 8 * 1024 * 2560 * (2 + 2 * 2) + 151_936 * 2560 * 4
    assert not estimate("qwen3-4b", "single", micro_batch_size=1, grad_accum=8, attention="flash",
                        loss_chunk_tokens=1024, compile=True).fits(80)


def test_qwen3_4b_on_two_80gb_gpus_the_margin_refuses_ddp_and_fsdp_fits():
    # ddp-ft under --dtype bf16 (common/precision.py): bf16 weights 2, fp32 masters 4, AdamW 8 and DDP's bf16 buckets
    # 2, held from the first backward on: 16 P = 59.9 GiB before any activation, and from a step's second
    # micro-batch on the masters' fp32 gradients too (4 P more): 2 rows x 4 micro-batches with checkpointing peak
    # beyond the 72.0 usable on 2 x 80 GiB. One micro-batch of 8 rows peaks at 64.45 GiB: within the usable share,
    # but not with the model's 15% margin, so FSDP, which shards the states, is the answer. On two H100 NVL
    # (93.6 GiB), 8 rows of DDP in one micro-batch with checkpointing fit with their margin (4 x 2 would not), and
    # DDP's flag is tried before FSDP.
    states_and_buckets = (2 + 4 + 8 + 2) * QWEN3_4B_PARAMETERS
    assert states_and_buckets / GIB == pytest.approx(59.94, abs=0.01)
    fast = dict(activation_checkpointing=True, attention="flash", loss_chunk_tokens=1024, compile=True)
    ddp_2 = estimate("qwen3-4b", "ddp", 2, micro_batch_size=2, grad_accum=4, **fast)
    assert ddp_2.grads_held_bytes == (2 + 4) * QWEN3_4B_PARAMETERS and ddp_2.total_gib > 80 * USABLE_FRACTION
    ddp_8 = estimate("qwen3-4b", "ddp", 2, micro_batch_size=8, grad_accum=1, **fast)
    assert ddp_8.grads_held_bytes == 2 * QWEN3_4B_PARAMETERS
    assert ddp_8.total_gib <= 80 * USABLE_FRACTION < ddp_8.needed_gib and not ddp_8.fits(80)
    advice = recommend("qwen3-4b", 2, 80, kv_expanded=False, model="Qwen/Qwen3-4B-Base")
    assert (advice.strategy, advice.activation_checkpointing, advice.rung.micro_batch_size) == ("fsdp", False, 8)
    assert "the leanest option tried before, ddp + activation checkpointing, micro-batch 8, needs " in advice.reason
    assert "GiB per GPU with its margin (64.45 predicted) of 72.00 usable" in advice.reason  # 8 rows x 1
    nvl = recommend("qwen3-4b", 2, GPU_MEMORY_GIB["H100 NVL"], kv_expanded=False, model="Qwen/Qwen3-4B-Base")
    assert (nvl.strategy, nvl.activation_checkpointing) == ("ddp", True)
    assert (nvl.rung.micro_batch_size, nvl.rung.grad_accum) == (8, 1)
    assert not estimate("qwen3-4b", "ddp", 2, micro_batch_size=4, grad_accum=2, **fast).fits(GPU_MEMORY_GIB["H100 NVL"])
    assert nvl.command() == (
        "uv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --model Qwen/Qwen3-4B-Base --seq-len 1024 "
        "--micro-batch-size 8 --grad-accum 1 --attn varlen --loss-chunk-tokens 1024 --compile "
        "--activation-checkpointing --dtype bf16")


def test_qwen3_4b_on_one_and_two_24gb_gpus_offloads_the_optimizer():
    # Nothing keeps full SFT of 4B on 24 GB GPUs (16 P / 2 = 30 GiB of model states per GPU on two). ZeRO-Offload
    # leaves 2 P = 7.5 GiB of bf16 weights on each GPU (DeepSpeed's estimator: the same 7.49 GiB) beside its
    # buckets, largest gradient and staging: it fits, before FSDP's offload (which would move the weights over PCIe
    # too), says how much host memory it needs, and names LoRA on the GPUs as the faster way out.
    for gpus, host_gib in ((1, 68.2), (2, 68.9)):
        advice = recommend("qwen3-4b", gpus, 24, kv_expanded=False)
        assert (advice.strategy, advice.lora_rank) == ("zero-2-offload", 0)
        assert advice.choice.weights_bytes == 2 * QWEN3_4B_PARAMETERS and advice.choice.grads_bytes == 0
        assert f"{host_gib} GiB of host memory" in advice.reason and "LoRA" in advice.reason
        assert "experiments/zero-ft/train.py --zero-stage 2 --cpu-offload" in advice.command()
        assert not {"single", "ddp", "zero-2", "zero-3", "fsdp", "tp", "tp-sp", "pp"} & set(advice.fitting)


def test_qwen3_4b_on_eight_24gb_gpus_is_fsdp_with_checkpointing():
    # 8 x 24 GB: FSDP holds 16 P / 8 = 7.5 GiB of states per GPU, ZeRO-2 under DeepSpeed's bf16 2 P + 16 P / 8 =
    # 15.0: FSDP comes first and holds less. Its 8 rows fit in one micro-batch with checkpointing (no unsharded
    # gradients to accumulate, GA 1); without it, no micro-batch does.
    advice = recommend("qwen3-4b", 8, 24, kv_expanded=False)
    assert (advice.strategy, advice.activation_checkpointing, advice.rung.micro_batch_size) == ("fsdp", True, 8)
    assert advice.rung.flags == () and advice.rung.plain_micro_batch_size == 0
    assert advice.choice.model_states_bytes == pytest.approx(16 * QWEN3_4B_PARAMETERS / 8)
    zero2 = estimate("qwen3-4b", "zero-2", 8, activation_checkpointing=True, micro_batch_size=8, attention="flash",
                     loss_chunk_tokens=1024, compile=True)
    assert zero2.model_states_bytes == pytest.approx((2 + 16 / 8) * QWEN3_4B_PARAMETERS)
    assert zero2.total_bytes > advice.choice.total_bytes


@pytest.mark.parametrize("gpus,gpu_mem_gib,expected", [(1, 24, "single"), (1, 80, "single"), (2, 24, "ddp"),
                                                      (2, 32, "ddp"), (2, 80, "ddp")])
def test_qwen3_0_6b_fits_a_replica(gpus, gpu_mem_gib, expected):
    # 0.6B: 8.9 GiB of states + 1.1 of copies + activations and one loss chunk: a replica fits 24 GB
    advice = recommend("qwen3-0.6b", gpus, gpu_mem_gib)
    assert (advice.strategy, advice.activation_checkpointing, advice.lora_rank) == (expected, False, 0)


def test_the_micro_batch_is_the_largest_that_fits():
    # One 27 GiB GPU (24.3 usable): 8 rows of Qwen3-0.6B in one micro-batch (20.6 GiB, 23.7 with the margin: no
    # gradient held, GA 1). Two: DDP holds its 1.1 GiB of bf16 buckets at every backward, and the masters' fp32
    # gradients only from a step's second micro-batch on: 8 rows in one micro-batch still fit (19.8 GiB, 22.8 with
    # the margin), where two micro-batches of 4 would hold those gradients too.
    one, two = recommend("qwen3-0.6b", 1, 27), recommend("qwen3-0.6b", 2, 27)
    assert (one.rung.micro_batch_size, one.rung.grad_accum) == (8, 1)
    assert (two.rung.micro_batch_size, two.rung.grad_accum) == (8, 1)
    assert two.choice.grads_held_bytes == 2 * 596_049_920
    fixed = recommend("qwen3-0.6b", 2, 24, micro_batch_size=2, grad_accum=3, fast=False)
    assert (fixed.rung.micro_batch_size, fixed.rung.grad_accum, fixed.rung.fast) == (2, 3, (False, False, False))
    assert "--micro-batch-size 2 --grad-accum 3" in fixed.command() and "--attn" not in fixed.command()


def test_nothing_fits_says_so():
    advice = recommend("qwen3-4b", 1, 2)  # the logits of one chunk alone need 2.0 GiB
    assert advice.strategy is None and "nothing fits" in advice.reason and advice.command() == ""


def test_lora_when_full_sft_fits_nowhere():
    # Qwen3-4B on one 5 GiB GPU (4.5 GiB usable: a peak up to 3.9 fits with its 15% margin), one micro-batch of 1,024
    # tokens, no speed flags. Full SFT at its leanest (FSDP's CPU offload + checkpointing): logits 1024 x 151,936 x 14 B
    # = 2.03 GiB, activations 0.37, gathered bf16 root + 2 layers (389.0M + 2 x 100.9M) x 2 B = 1.10, the root's
    # unsharded gradient in bf16 and fp32 (389.0M x 6 B) = 2.17: 5.67 GiB. ZeRO-Offload keeps the 7.5 GiB of bf16
    # weights on the GPU. LoRA drops the root's gradient (the embedding is frozen): 3.48 GiB. QLoRA in one process
    # (tried before LoRA offloaded) keeps the fp32 embedding (1.45 GiB) and the 4-bit layers (1.75 GiB) beside the same
    # logits: too much.
    advice = recommend("qwen3-4b", 1, 5, micro_batch_size=1, grad_accum=1, fast=False)
    assert (advice.strategy, advice.lora_rank, advice.activation_checkpointing) == ("fsdp-offload", 16, True)
    assert advice.reason.startswith("full SFT fits nowhere")
    assert advice.choice.total_gib == pytest.approx(3.48, abs=0.01)
    assert estimate("qwen3-4b", "fsdp-offload", 1, activation_checkpointing=True).total_gib == pytest.approx(
        5.67, abs=0.01)
    assert not estimate("qwen3-4b", "single", lora_rank=16, qlora=True, activation_checkpointing=True).fits(5)
    # 3.48 GiB is within 4 GiB's 3.6 usable, but not with its margin: on 4 GiB nothing fits.
    assert recommend("qwen3-4b", 1, 4, micro_batch_size=1, grad_accum=1, fast=False).strategy is None


def test_qlora_when_lora_fits_nowhere_on_the_gpu():
    # One 9 GiB GPU: LoRA on a bf16 base holds 2 P = 7.5 GiB of weights alone; QLoRA's 4-bit layers and fp32
    # embedding (3.2 GiB) leave room for the activations and the margin.
    advice = recommend("qwen3-4b", 1, 9)
    assert (advice.strategy, advice.lora_rank, advice.rung.qlora) == ("single", 16, True)
    assert advice.command().startswith("uv run python experiments/single-ft/train.py")
    assert "--qlora --lora-rank 16" in advice.command()
    asked = recommend("qwen3-4b", 1, 10, qlora=True)
    assert (asked.strategy, asked.rung.qlora) == ("single", True)
    assert set(e.strategy for e in recommend("qwen3-4b", 2, 24, qlora=True).estimates) == {"single", "ddp"}


def test_a_given_lora_rank_walks_the_ladder():
    # On 2 x 24 GB with LoRA r16 DDP's replica keeps the frozen base in bf16 (2 P = 7.5 GiB), the adapters in bf16
    # with fp32 masters:
    # DDP, the first rung, fits. Without checkpointing only 2 rows fit in one micro-batch (2,048 tokens, where the
    # GPU step is host-bound); with it, all 8: checkpointing it is.
    advice = recommend("qwen3-4b", 2, 24, lora_rank=16, kv_expanded=False, model="Qwen/Qwen3-4B-Base")
    adapters = model_shape("qwen3-4b").lora_parameters(16)
    assert (advice.strategy, advice.lora_rank, advice.activation_checkpointing) == ("ddp", 16, True)
    assert (advice.rung.micro_batch_size, advice.rung.plain_micro_batch_size) == (8, 2)
    assert advice.choice.weights_bytes == 2 * QWEN3_4B_PARAMETERS + 2 * adapters
    assert advice.choice.master_bytes == 4 * adapters
    assert advice.command().endswith("--model Qwen/Qwen3-4B-Base --seq-len 1024 --micro-batch-size 8 --grad-accum 1 "
                                     "--attn varlen --loss-chunk-tokens 1024 --compile --activation-checkpointing "
                                     "--lora-rank 16 --lora-fused --dtype bf16")


def test_fsdp_reduces_every_micro_batch_before_the_strategy_changes():
    # Qwen3-1.7B, full SFT, 2 x 23 GiB (20.7 GiB usable: a peak up to 18.0 with its margin), micro-batches of one
    # 1,024-token row fixed, 8 per step, no speed flags. Accumulating 8 micro-batches, fsdp-ft keeps every unsharded
    # gradient in fp32 (4 P = 6.4 GiB), with or without checkpointing too much; reducing every micro-batch it keeps one
    # layer's: that is fsdp's own flag, taken before a pipeline. (On 25 GiB, checkpointing is enough and comes first: it
    # costs compute, the flag 8 reduce-scatters instead of one.)
    advice = recommend("qwen3-1.7b", 2, 23, micro_batch_size=1, grad_accum=8, fast=False)
    assert (advice.strategy, advice.rung.flags, advice.activation_checkpointing) == (
        "fsdp", ("--reduce-every-micro-batch",), False)
    assert advice.command().endswith("--micro-batch-size 1 --grad-accum 8 --reduce-every-micro-batch --dtype bf16")
    for checkpointing in (False, True):
        assert not estimate("qwen3-1.7b", "fsdp", 2, grad_accum=8, activation_checkpointing=checkpointing).fits(23)
    assert estimate("qwen3-1.7b", "fsdp", 2, grad_accum=1).fits(23)
    assert recommend("qwen3-1.7b", 2, 25, micro_batch_size=1, grad_accum=8, fast=False).rung.flags == ()
    # With memory to spare the answer names fsdp-ft's gather-once setting, priced with every layer gathered.
    roomy = recommend("qwen3-1.7b", 2, 32, micro_batch_size=1, grad_accum=8)
    once = estimate("qwen3-1.7b", "fsdp", 2, grad_accum=8, reshard_after_forward=False, attention="flash",
                    loss_chunk_tokens=1024, compile=True)
    assert roomy.strategy == "fsdp" and f"gathers each unit once per step instead of twice per micro-batch " \
        f"({once.total_gib:.1f} GiB per GPU)" in roomy.reason


# ---------------------------------------------------------------------------------------------------------------
# API for the experiments, and the command line
def test_raw_counts_give_the_preset():
    raw = dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936)
    assert model_shape(raw).total_parameters == model_shape("qwen3-0.6b").total_parameters == 596_049_920


def test_cli_prints_the_table_and_the_recommendation(capsys):
    main(["--model", "qwen3-0.6b", "--gpus", "2", "--gpu-mem-gib", "32", "--seq-len", "1024", "--no-fast",
          "--micro-batch-size", "1", "--grad-accum", "1"])
    out = capsys.readouterr().out
    assert "recommendation: ddp" in out and "experiments/ddp-ft/train.py" in out
    # ddp computes without autocast (bf16 weights, common/precision.py): the by-hand terms above, bf16 throughout
    no_autocast = sum(layer_activation_terms(model_shape("qwen3-0.6b"), compute_bytes=2, autocast=False,
                                             seq_len=1024).values())
    assert no_autocast < 88_232 and f"= {no_autocast:,} bytes/token" in out
    assert "activations per layer of ddp (no autocast, sdpa-packed)" in out
    # which rows use which bytes per parameter
    assert "master-bf16" in out and "deepspeed-bf16" in out and "project-bf16" in out
    main(["--model", "qwen3-4b", "--gpus", "2", "--gpu", "RTX 4090"])
    out = capsys.readouterr().out
    assert "on 2 x 23.99 GiB" in out and "zero-2-offload" in out and "GiB in CPU memory per rank" in out
    assert "run: uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 2 --cpu-offload " \
           "--model Qwen/Qwen3-4B-Base" in out
    assert "(the preset qwen3-4b has the same geometry at random init, without a download)" in out
    main(["--model", "qwen3-4b", "--gpus", "8", "--dtype", "fp32", "--micro-batch-size", "1", "--grad-accum", "4"])
    out = capsys.readouterr().out
    (run,) = [line for line in out.splitlines() if line.startswith("run: ")]
    assert "deepspeed-fp32" in out and "--micro-batch-size 1 --grad-accum 4" in run and run.endswith("--dtype fp32")
    main(["--model", "qwen3-4b", "--gpus", "8", "--precision", "zero-paper"])
    assert "precision zero-paper for every strategy" in capsys.readouterr().out
    main(["--zero-paper"])
    out = capsys.readouterr().out
    assert "31.406" in out and "1.875" in out


def test_the_lora_answer_for_4b_on_two_24gb_gpus(capsys):
    """The question a user asks: LoRA of Qwen3-4B on 2 x 24 GB. The frozen base is priced at 2 bytes per weight
    (the adapters too, beside their fp32 masters), and the answer is a command that names the model."""
    main(["--model", "qwen3-4b", "--gpus", "2", "--gpu-mem-gib", "24", "--lora-rank", "16"])
    out = capsys.readouterr().out
    adapters = model_shape("qwen3-4b").lora_parameters(16)
    (ddp_row,) = [line for line in out.splitlines() if line.startswith("ddp ")]
    assert float(ddp_row.split()[2]) == pytest.approx((2 * QWEN3_4B_PARAMETERS + 2 * adapters) / GIB, abs=0.005)
    (run,) = [line for line in out.splitlines() if line.startswith("run: ")]
    assert "experiments/ddp-ft/train.py --model Qwen/Qwen3-4B-Base" in run and "--lora-rank 16" in run
    assert "predicted peak: " in out


@pytest.mark.parametrize("argv,message", [
    (["--model", "qwen3-4b", "--gpu", "RTX 9090"], "--gpu 'RTX 9090' is not in the table"),
    (["--model", "qwen3-4b", "--gpu-mem-gib", "2"], "cannot hold even qwen3-4b's weights in 4 bits"),
    (["--model", "qwen3-4b", "--qlora", "--dtype", "fp32"], "--qlora computes in bf16"),
    (["--model", "qwen3-4b", "--gpu-mem-gib", "-3"], "--gpu-mem-gib must be > 0"),
    (["--model", "qwen3-4b", "--gpu-mem-gib", "80", "--gpu", "RTX-4090"],
     "--gpu RTX-4090 and --gpu-mem-gib 80 both give the GPU's memory: give one"),
    (["--model", "qwen3-4b", "--gpus", "0"], "--gpus must be >= 1"),
    (["--model", "qwen3-4b", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["--model", "/no/such/folder"], "no folder /no/such/folder"),
])
def test_cli_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("python -m common.memory: error: ")


def test_cli_nothing_fits_exits_1(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--model", "qwen3-4b", "--gpu-mem-gib", "4", "--seq-len", "8192", "--rows-per-gpu", "1"])
    assert stop.value.code == 1 and "recommendation: none" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--model", "qwen3-4b", "--gpus", "2"], ["--model", "qwen3-1.7b", "--gpus", "1"],
                                  ["--model", "qwen3-0.6b", "--gpus", "4", "--seq-len", "4096"],
                                  ["--model", "qwen3-4b", "--gpus", "1", "--lora-rank", "16"],
                                  ["--model", "qwen3-30b-a3b", "--gpus", "8"]])
def test_the_ladders_first_fit_is_the_recommendation_for_any_memory(argv, capsys):
    """--json prints the whole ladder of a question; for every GPU memory, the first rung within its usable share is
    what recommend() answers (what the site's calculator relies on, without a second implementation)."""
    from common.models import PRESET_HUB_IDS

    main([*argv, "--json"])
    ladder = json.loads(capsys.readouterr().out)
    flags = dict(zip(argv[::2], argv[1::2]))
    for gpu_mem_gib in (4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 141, 192):
        advice = recommend(flags["--model"], int(flags["--gpus"]), gpu_mem_gib,
                           seq_len=int(flags.get("--seq-len", 1024)), lora_rank=int(flags.get("--lora-rank", 0)),
                           model=PRESET_HUB_IDS[flags["--model"]])
        usable = gpu_mem_gib * ladder["usable_fraction"]
        first = next((rung for rung in ladder["rungs"] if rung["peak_gib"] * (1 + ladder["error_band"]) <= usable),
                     None)
        if advice.rung is None:
            assert first is None, gpu_mem_gib
            continue
        assert first is not None and first["command"] == advice.command(), gpu_mem_gib
        assert first["peak_gib"] == pytest.approx(advice.choice.total_gib), gpu_mem_gib


@pytest.mark.slow
def test_the_recommended_command_runs_what_was_priced(small_data, tmp_path):
    """The command the CLI prints, run as printed (one step, on the small data): the prediction for its summary.json
    (predict_run, from the flags the run resolved), is the peak the CLI printed."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    answer = subprocess.run([sys.executable, "-m", "common.memory", "--model", "qwen3-tiny", "--gpus", "1",
                             "--gpu-mem-gib", "24", "--seq-len", "128", "--rows-per-gpu", "2"],
                            capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300)
    assert answer.returncode == 0, answer.stderr
    lines = answer.stdout.splitlines()
    (run,) = [line.removeprefix("run: uv run ") for line in lines if line.startswith("run: ")]
    (peak,) = [float(line.split()[2]) for line in lines if line.startswith("predicted peak: ")]
    argv = run.split()
    assert argv[:2] == ["python", "experiments/single-ft/train.py"] and "--compile" in argv
    assert argv[argv.index("--micro-batch-size") + 1] == "2"
    trained = subprocess.run([sys.executable, *argv[1:], "--steps", "1", "--eval-fraction", "0", "--data",
                              str(small_data), "--out-dir", str(tmp_path / "run")],
                             capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600)
    assert trained.returncode == 0, trained.stderr[-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert round(predict_run(summary).total_gib, 2) == peak


def test_multi_node_layouts_shard_inside_a_node_first(capsys):
    layouts = multi_node_layouts("qwen3-4b", 2, 8, seq_len=1024)
    assert [layout.name for layout in layouts] == ["hsdp", "fsdp", "fsdp-tp"]
    hsdp, fsdp, fsdp_tp = (layout.estimate for layout in layouts)
    # HSDP holds what FSDP over one node's 8 GPUs holds; FSDP over all 16 less; TP inside a node splits the layers too.
    assert hsdp.total_bytes == estimate("qwen3-4b", "fsdp", 8, seq_len=1024).total_bytes
    assert fsdp.world_size == 16 and fsdp.model_states_bytes < hsdp.model_states_bytes
    assert fsdp_tp.total_bytes == estimate("qwen3-4b", "fsdp-tp", 16, seq_len=1024, tensor_parallel=8).total_bytes
    assert fsdp_tp.activations_bytes < fsdp.activations_bytes
    main(["--model", "qwen3-4b", "--gpus", "16", "--nodes", "2", "--gpu-mem-gib", "24"])
    out = capsys.readouterr().out
    assert "on 2 nodes: hsdp: uv run torchrun --nnodes=2 --nproc-per-node=8" in out
    assert "experiments/fsdp-ft/train.py --replicate-degree 2" in out
    # On 20 GiB GPUs HSDP's copy per node no longer fits with its margin, FSDP over every GPU does.
    main(["--model", "qwen3-4b", "--gpus", "16", "--nodes", "2", "--gpu-mem-gib", "20"])
    assert "on 2 nodes: fsdp: " in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "qwen3-4b", "--gpus", "6", "--nodes", "4"])


# ---------------------------------------------------------------------------------------------------------------
# Mixtures of experts (section 7): single and ep, as single-ft and ep-ft hold and keep them
def _tiny_moe(layers: int = 4) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**MOE_PRESETS["qwen3-moe-tiny"], "num_hidden_layers": layers},
                          **{**PRESET_COMMON, **MOE_COMMON})


def test_moe_counts_are_the_models():
    config = model_config("qwen3-moe-tiny")
    model = AutoModelForCausalLM.from_config(config)
    shape = model_shape(config)
    assert (shape.experts, shape.experts_per_token, shape.expert_intermediate) == (8, 2, 128)
    real = sum(p.numel() for p in model.parameters())
    assert shape.total_parameters == count_parameters(config)["total"] == real == 8_137_216
    assert shape.layers * shape.layer_expert_parameters == count_parameters(config)["experts"] == sum(
        p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert shape.router_parameters == model.model.layers[0].mlp.gate.weight.numel()
    embedding, layers, tail = leaf_modules(shape)
    listed = {name: n for module in (embedding, *(m for layer in layers for m in layer), *tail)
              for name, n, _ in module}
    assert sum(listed.values()) == real
    assert listed["layers.0.mlp.experts.gate_up_proj"] == model.model.layers[0].mlp.experts.gate_up_proj.numel()
    # Qwen3-30B-A3B's published size: 30.5B parameters, 3.3B active per token
    large = model_shape("qwen3-30b-a3b")
    assert large.total_parameters == 30_532_122_624 and large.experts == 128


def test_dense_strategies_refuse_a_mixture_of_experts():
    for strategy in ("ddp", "zero-2", "fsdp", "tp", "pp", "zero-2-offload"):
        with pytest.raises(ValueError, match="mixture of experts.*single or ep"):
            estimate("qwen3-moe-tiny", strategy, 2)
    with pytest.raises(ValueError, match="is dense"):
        estimate("qwen3-0.6b", "ep", 2)
    with pytest.raises(ValueError, match="do not split evenly"):
        estimate("qwen3-moe-tiny", "ep", 3)
    with pytest.raises(ValueError, match="LoRA"):
        estimate("qwen3-moe-tiny", "single", lora_rank=8)
    # recommend() and the multi-node layouts only offer what prices it; a dense model never gets an ep row
    assert {e.strategy for e in recommend("qwen3-moe-tiny", 2, 24).estimates} == {"single", "ep"}
    assert "ep" not in {e.strategy for e in recommend("qwen3-0.6b", 2, 24).estimates}
    assert [layout.name for layout in multi_node_layouts("qwen3-30b-a3b", 2, 8)] == ["ep"]
    assert recommend("qwen3-moe-tiny", 3, 24).strategy is None  # 8 experts over 3 GPUs: nothing to run


def test_ep_model_states_by_hand():
    # Qwen3-30B-A3B over 8 ranks: each holds the 1.54B dense parameters and 1/8 of the 29.0B expert ones, 16 bytes
    # each in ep-ft's runs from before its bf16 weights (fp32 weights, gradients, AdamW m and v, autocast:
    # PROJECT_BF16); one rank holds what single does.
    shape = model_shape("qwen3-30b-a3b")
    experts = 48 * 128 * 3 * 2048 * 768
    dense = shape.total_parameters - experts
    assert dense == 1_541_093_376
    ep = estimate(shape, "ep", 8, precision=PROJECT_BF16)
    held = dense + experts // 8
    assert (ep.weights_bytes, ep.grads_bytes, ep.optimizer_bytes, ep.master_bytes) == (4 * held, 4 * held,
                                                                                      8 * held, 0)
    one = estimate(shape, "ep", 1, precision=PROJECT_BF16)
    assert one.model_states_bytes == 16 * shape.total_parameters
    assert estimate(shape, "single").model_states_bytes == 18 * shape.total_parameters  # bf16 weights, fp32 masters
    # bf16 copies: autocast's of the attention, routers and LM head; ep-ft's own of its experts, every layer's
    # (one layer's with checkpointing). single computes in its bf16 weights (common/precision.py): no copies.
    attention_and_router = 48 * (2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2048 * 128)
    lm_head = 151_936 * 2048
    assert estimate(shape, "single").compute_copy_bytes == 0
    assert ep.compute_copy_bytes == 2 * (attention_and_router + lm_head + experts // 8)
    assert estimate(shape, "ep", 8, activation_checkpointing=True, precision=PROJECT_BF16).compute_copy_bytes == 2 * (
        attention_and_router + lm_head + experts // 8 // 48)
    # the dispatch: sorted, received and regrouped rows, fp32 under autocast, k = 8 per token
    assert ep.buffers_bytes == 1024 * 3 * 4 * 8 * 2048
    # ep-ft's --dtype bf16 today: bf16 weights (its experts too) with fp32 masters, 18 bytes per held parameter, no
    # copies; the dispatched rows in bf16
    masters = estimate(shape, "ep", 8)
    assert masters.precision is MASTER_BF16
    assert (masters.weights_bytes, masters.grads_bytes, masters.optimizer_bytes, masters.master_bytes) == (
        2 * held, 4 * held, 8 * held, 4 * held)
    assert masters.compute_copy_bytes == 0 and masters.buffers_bytes == 1024 * 3 * 2 * 8 * 2048
    assert estimate(shape, "ep", 8, precision="fp32").precision is PROJECT_FP32


def _moe_saved_bytes_per_token(layers: int, autocast: bool, packed: bool, expert_parallel: bool,
                               seq_len: int = 96, bf16_weights: bool = False) -> float:
    """As _saved_bytes_per_token (each storage held while counting), for qwen3-moe-tiny with common.moe's
    load-balancing loss; `expert_parallel`: ep-ft's expert block on a one-rank group (needs torch.distributed
    initialised); `bf16_weights`: the model in bf16, as common/precision.py leaves it (no autocast). The
    load-balancing loss saves each layer's top-k expert ids for a topk backward that the loss never uses: they are
    freed layer by layer, their address reused by the next layer's softmax output."""
    from common.moe import RouterStats

    torch.manual_seed(0)
    config = _tiny_moe(layers)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if bf16_weights:
        model.to(torch.bfloat16)
    if expert_parallel:
        from torch.distributed.device_mesh import init_device_mesh

        sys.path.insert(0, str(REPO_ROOT / "tests"))
        from conftest import load_experiment

        load_experiment("ep-ft").shard_experts(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    model.train()
    stats = RouterStats(model, config.num_experts, config.num_experts_per_tok)
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    parameters = {p.untyped_storage().data_ptr() for p in local}
    weight_shapes = {shape for p in local for shape in (tuple(p.shape), tuple(p.shape[::-1]), (*p.shape[:1],
                                                                                               *p.shape[:0:-1]))}
    saved: list[torch.Tensor] = []

    def keep(tensor):
        # The tensor itself is kept, not its address: a saved tensor of a graph branch freed during the forward
        # (the aux loss's) would otherwise hand its storage to a later tensor, which would then count once for two.
        is_weight_copy = tensor.dtype == torch.bfloat16 and tuple(tensor.shape) in weight_shapes
        if tensor.untyped_storage().data_ptr() not in parameters and not is_weight_copy:
            saved.append(tensor)
        return tensor

    half = seq_len // 2
    position_ids = torch.cat([torch.arange(half), torch.arange(seq_len - half)]) if packed else torch.arange(seq_len)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        stats.begin()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=torch.randint(0, 8000, (1, seq_len)), position_ids=position_ids[None],
                  attention_mask=None, use_cache=False)
        stats.end()  # the load-balancing loss, as single-ft and ep-ft add it
    return _unique_bytes(saved) / seq_len


def _moe_activation_check(autocast: bool, packed: bool, expert_parallel: bool, bf16_weights: bool = False) -> None:
    shape = model_shape(_tiny_moe())
    seq_len, compute_bytes = 96, 2 if autocast or bf16_weights else 4
    terms = layer_activation_terms(shape, compute_bytes=compute_bytes, autocast=autocast, seq_len=seq_len,
                                   attention="sdpa-packed" if packed else "sdpa", expert_parallel=expert_parallel,
                                   weight_bytes=2 if bf16_weights else 4)
    two, three = (_moe_saved_bytes_per_token(n, autocast, packed, expert_parallel, bf16_weights=bf16_weights)
                  for n in (2, 3))
    # Besides the formula: the grouped products' int32 offsets, one per expert (E here, E / W in ep-ft) per layer
    offsets = 4 * shape.experts / seq_len
    assert three - two == pytest.approx(sum(terms.values()) + offsets, abs=1e-9)
    outside = outside_layers_bytes_per_token(shape, compute_bytes=compute_bytes, autocast=autocast)
    # + the input ids (8 per token) and the aux loss's product of two [E] fp32 vectors (once per forward)
    assert two - 2 * (three - two) == pytest.approx(outside + 8 + offsets, abs=1e-9)


@pytest.mark.parametrize("autocast,packed", [(False, False), (True, True)])
def test_moe_activation_formula_matches_what_autograd_keeps(autocast, packed):
    """single-ft's MoE layer (transformers' grouped_mm experts), by hand for qwen3-moe-tiny under autocast
    (d 256, E 8, k 2, I_e 128; c 2, r 4, and e 4: the experts compute in the fp32 weights' dtype)."""
    if autocast:
        terms = layer_activation_terms(model_shape(_tiny_moe()), compute_bytes=2, autocast=True, seq_len=96)
        assert (terms["router"], terms["aux_loss"], terms["experts"]) == (
            4 * 8 + 8 * 2 + 4 * 2 + 4, 2 * 8 + 8 * 2, 2 * (2 * 4 * 256 + 4 * 4 * 128 + 2 + 24))
        assert "mlp" not in terms and terms["linear_inputs"] == 4 * 2 * 256
    _moe_activation_check(autocast, packed, expert_parallel=False)


def _ep_block(out_dir: str) -> dict:
    """In a one-rank group: ep-ft's expert block against the activation formula (fp32, and bf16 weights as
    common/precision.py leaves them; its runs under autocast kept the formula's autocast terms), then what a
    rank of ep-ft holds after a step (dense parameters, its experts as DTensors, AdamW as ep-ft groups it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from common.metrics import state_bytes

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _moe_activation_check(False, False, expert_parallel=True)
    _moe_activation_check(False, True, expert_parallel=True, bf16_weights=True)
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from conftest import load_experiment

    ep_ft = load_experiment("ep-ft")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_moe(), attn_implementation="sdpa")
    blocks = ep_ft.shard_experts(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
    experts = [p for block in blocks for p in block.parameters()]
    optimizer = _ep_optimizer(model, experts)
    ids = torch.randint(0, 8000, (1, 32))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        held = state_bytes(model.parameters(), optimizer)  # as ep-ft measures it: after backward, before the step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    return dict(held=held, tensors=len(list(model.parameters())))


def _ep_optimizer(model, experts) -> torch.optim.AdamW:
    """ep-ft's AdamW groups: dense matrices, dense vectors, experts."""
    expert_ids = {id(p) for p in experts}
    dense = [p for p in model.parameters() if id(p) not in expert_ids]
    groups = [{"params": [p for p in dense if p.ndim >= 2], "weight_decay": 0.01},
              {"params": [p for p in dense if p.ndim < 2], "weight_decay": 0.0},
              {"params": experts, "weight_decay": 0.01}]
    return torch.optim.AdamW(groups, lr=1e-3)


@pytest.mark.slow
def test_ep_ft_block_and_states_on_one_rank(tmp_path):
    """ep-ft's own expert block on a one-rank group (it holds every expert): its saved tensors are the formula's,
    and a rank's model states after a step are estimate(..., "ep", 1).state_bytes() to the byte, AdamW's step
    counters (one fp32 scalar per parameter tensor) aside, as for the other experiments."""
    result = subprocess.run([sys.executable, __file__, "ep", str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    predicted = estimate(_tiny_moe(), "ep", 1, precision=PROJECT_BF16).state_bytes()  # fp32 weights, autocast
    assert measured["held"] == {**predicted, "optimizer": predicted["optimizer"] + 4 * measured["tensors"]}


@pytest.mark.parametrize("world_size", [2, 4])  # one rank: test_ep_ft_block_and_states_on_one_rank
def test_an_ep_rank_holds_the_predicted_states(world_size):
    """Rank 0 of ep-ft on W ranks, emulated in one process: the dense parameters whole and experts
    [0, E / W) of every layer (the rows ep-ft's ExpertParallelExperts keeps), with their gradients from a real
    backward and AdamW's state after one step, grouped as ep-ft groups them."""
    from common.metrics import state_bytes

    torch.manual_seed(0)
    config = _tiny_moe()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, 8000, (1, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    local = config.num_experts // world_size
    experts = []
    for layer in model.model.layers:
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(layer.mlp.experts, name)
            rows = torch.nn.Parameter(whole.detach()[:local].clone())
            rows.grad = whole.grad[:local].clone()
            experts.append(rows)
    expert_names = {name for name, _ in model.named_parameters() if ".mlp.experts." in name}
    dense = [p for name, p in model.named_parameters() if name not in expert_names]
    held = [*dense, *experts]
    optimizer = _ep_optimizer(torch.nn.ParameterList(held), experts)
    optimizer.step()
    measured = state_bytes(held, optimizer)
    predicted = estimate(config, "ep", world_size, precision=PROJECT_BF16).state_bytes()  # fp32 weights, autocast
    assert measured == {**predicted, "optimizer": predicted["optimizer"] + 4 * len(held)}
    shape = model_shape(config)
    assert measured["weights"] == 4 * (shape.total_parameters - shape.layers * shape.layer_expert_parameters
                                       * (1 - 1 / world_size))


def test_cli_prints_the_ep_row_for_qwen3_30b_a3b(capsys):
    main(["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-mem-gib", "141", "--activation-checkpointing",
          "--no-fast", "--micro-batch-size", "1", "--grad-accum", "1"])
    out = capsys.readouterr().out
    (ep_line,) = [line for line in out.splitlines() if line.startswith("ep ")]
    (single_line,) = [line for line in out.splitlines() if line.startswith("single ")]
    ep = estimate("qwen3-30b-a3b", "ep", 8, activation_checkpointing=True)
    assert float(ep_line.split()[10]) == pytest.approx(ep.total_gib, abs=0.005) and ep_line.split()[11] == "yes"
    assert single_line.split()[11] == "no"
    assert "128 experts x 768 (8 per token" in out
    assert "recommendation: ep + activation checkpointing" in out and "does not fit one GPU" in out
    assert "run: uv run torchrun --nproc_per_node=8 experiments/ep-ft/train.py --model Qwen/Qwen3-30B-A3B-Base " \
           "--seq-len 1024 --micro-batch-size 1 --grad-accum 1 --activation-checkpointing" in out
    with pytest.raises(SystemExit) as stop:  # nothing fits: exit code 1
        main(["--model", "qwen3-30b-a3b", "--gpus", "2", "--gpu-mem-gib", "80"])
    assert stop.value.code == 1
    out = capsys.readouterr().out
    assert "recommendation: none" in out and any(line.startswith("ep ") for line in out.splitlines())
    main(["--model", "qwen3-30b-a3b", "--gpus", "16", "--nodes", "2", "--gpu-mem-gib", "80"])
    assert "experiments/ep-ft/train.py" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--model", "qwen3-30b-a3b", "--lora-rank", "16"])


if __name__ == "__main__" and sys.argv[1:2] == ["census"]:
    print(json.dumps(_census([tuple(run) for run in json.loads(sys.argv[2])])))
if __name__ == "__main__" and sys.argv[1:2] == ["ep"]:
    print(json.dumps(_ep_block(sys.argv[2])))


def test_attention_kind_of_each_backend():
    """How k and v reach the kernel decides the attention term: FlexAttention takes grouped heads and keeps a block
    mask of a few kilobytes (priced as a flash kernel: the H100 flex rung, 2026-11-27, held 1.8 GiB less than the
    varlen rung whose kernel took K/V repeated to every head), SDPA over packed rows a dense mask per layer."""
    from common.memory.activations import attention_kind

    assert attention_kind({"impl": "flex"}, packing=True) == "flash"
    assert attention_kind({"impl": "varlen", "expands_kv": True}, packing=True) == "flash-expanded-kv"
    assert attention_kind({"impl": "varlen", "expands_kv": False}, packing=True) == "flash"
    assert attention_kind({"impl": "sdpa"}, packing=True) == "sdpa-packed"
    assert attention_kind({"impl": "sdpa"}, packing=False) == "sdpa"


def test_lora_fused_names_exactly_the_experiments_that_take_the_flag():
    """The recommender puts --lora-fused in a command only where the script's Config has it."""
    from common.cli import config_flags
    from common.memory import RUN_WITH

    for strategy, command in RUN_WITH.items():
        flags = {flag.name for flag in config_flags(REPO_ROOT / command.split()[0])[1]}
        assert ("lora_fused" in flags) == (strategy in LORA_FUSED), strategy


def test_a_lora_command_fuses_the_adapters_where_its_experiment_can():
    """--lora-fused is one of LoRA's speed flags: priced (fewer casts kept) and in the command, where the experiment
    takes it (single, ddp, fsdp, pp); tp-ft's DTensor adapters do not, so its rungs go without."""
    advice = recommend("qwen3-4b", 1, 9)  # QLoRA on one GPU (test above)
    assert advice.rung.lora_fused and "--lora-rank 16 --lora-fused" in advice.command()
    ladder = Ladder("qwen3-4b", 2)
    for strategy in ("single", "ddp", "fsdp", "pp", "tp", "tp-sp", "zero-2"):
        world = 1 if strategy == "single" else 2
        fused = ladder.price(strategy, False, 16, False, 4, 1)
        assert fused.lora_fused == (strategy in LORA_FUSED)
        assert not ladder.price(strategy, False, 0, False, 4, 1).lora_fused  # full fine-tuning: nothing to fuse
        unfused = estimate("qwen3-4b", strategy, world, micro_batch_size=4, lora_rank=16, attention="flash",
                           loss_chunk_tokens=LOSS_CHUNK_TOKENS if FAST_FLAGS[strategy][1] else 0,
                           compile=FAST_FLAGS[strategy][2])  # the rung's own speed flags
        # Fewer casts kept where autocast casts (FSDP computes in bf16 without it: nothing to save there)
        saves = strategy in LORA_FUSED and uses_autocast(strategy, strategy_precision(strategy, "bf16"))
        assert (fused.estimate.activations_bytes < unfused.activations_bytes) == saves, strategy
        assert fused.estimate.activations_bytes <= unfused.activations_bytes


def test_cli_json_holds_the_gpu_memory_the_rungs_that_fit_and_the_choice(capsys):
    main(["--model", "qwen3-4b", "--gpu-mem-gib", "9", "--json"])
    answer_json = json.loads(capsys.readouterr().out)
    assert (answer_json["gpu_mem_gib"], answer_json["usable_gib"]) == (9.0, pytest.approx(8.1))
    assert answer_json["error_band"] == ERROR_BAND
    rungs = answer_json["rungs"]
    assert [rung["fits"] for rung in rungs] == [rung["peak_gib"] * (1 + ERROR_BAND) <= 8.1 for rung in rungs]
    assert any(rung["peak_gib"] <= 8.1 and not rung["fits"] for rung in rungs)  # the margin decides some rungs
    # recommend()'s answer is the first rung that fits, and the JSON says which one it is.
    assert answer_json["choice"] == next(i for i, rung in enumerate(rungs) if rung["fits"])
    main(["--model", "qwen3-4b", "--gpu-mem-gib", "9"])
    (run_line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run: ")]
    assert run_line == f"run: {answer_json['recommendation']}" == f"run: {rungs[answer_json['choice']]['command']}"
    assert answer_json["full_fine_tuning_fits"] is False and rungs[answer_json["choice"]]["qlora"]


def test_cli_says_in_words_when_only_adapters_fit_and_prices_qlora_in_4_bits(capsys):
    main(["--model", "qwen3-4b", "--gpu-mem-gib", "9"])
    out = capsys.readouterr().out
    assert ("full fine-tuning fits nowhere on 1 x 9 GiB: the rows below train only QLoRA adapters of rank 16 on a "
            "4-bit base (33,030,144 parameters), not every weight") in out
    (row,) = [line for line in out.splitlines() if line.startswith("single ")]
    assert row.endswith("QLoRA r16 (4-bit base), checkpointing")
    (header,) = [line for line in out.splitlines() if line.startswith("bytes per trainable parameter")]
    assert header.startswith("bytes per trainable parameter under QLoRA (single): --qlora: ") and "NF4" in header
    assert "frozen (LoRA base) weight 2" not in out
    main(["--model", "qwen3-4b", "--gpu-mem-gib", "80"])  # full fine-tuning fits: no such line, no adapters in the rows
    out = capsys.readouterr().out
    assert "fits nowhere" not in out and "LoRA r" not in out.split("recommendation:")[0]


def test_predict_run_prices_single_ft_by_the_layout_its_run_had():
    """summary.json's `master_weights` names single-ft's bf16 weights with fp32 masters (common/precision.py); a run
    without it ran fp32 weights under autocast (the committed GPU runs) and is priced so."""
    run = json.loads((REPO_ROOT / "devlog" / "data" / "2026-11-26-gpu-suite-nvidia-h200" /
                      "single-ft-s1024-full-5-micro8" / "summary.json").read_text())
    assert "master_weights" not in run and run["config"]["dtype"] == "bf16"
    before = predict_run(run)
    assert before.precision is PROJECT_BF16 and before.compute_copy_bytes > 0
    masters = {"compute_dtype": "bfloat16", "master_dtype": "float32"}
    after = predict_run({**run, "master_weights": masters})
    assert after.precision is MASTER_BF16 and after.compute_copy_bytes == 0
    assert after.activations_bytes < before.activations_bytes  # a bf16 residual stream, no autocast casts saved
    assert after.step_bytes == before.step_bytes  # the bf16 weights are freed for the step: 16 bytes either way
    # ddp-ft likewise: a committed run from before its bf16 weights is priced by its fp32 weights under autocast.
    ddp = json.loads((REPO_ROOT / "devlog" / "data" / "2026-11-27-bf16-bytes" / "ddp-ft-ga1" /
                      "summary.json").read_text())
    assert "master_weights" not in ddp and ddp["config"]["dtype"] == "bf16"
    assert predict_run(ddp).precision is PROJECT_BF16
    assert predict_run({**ddp, "master_weights": masters}).precision is MASTER_BF16


def test_predict_run_prices_pp_ft_by_the_layout_its_run_had():
    """pp-ft's bf16 stages with fp32 masters (MASTER_BF16) where summary.json names them, per rank too; a committed
    bf16 run without `master_weights` ran fp32 weights under autocast and keeps that price (PROJECT_BF16)."""
    run = json.loads((REPO_ROOT / "devlog" / "data" / "2026-11-23-memory-0.6b" / "pp-ft" / "summary.json").read_text())
    assert "master_weights" not in run and run["config"]["dtype"] == "bf16"
    masters = {**run, "master_weights": {"compute_dtype": "bfloat16", "master_dtype": "float32"}}
    before, after = predict_run(run), predict_run(masters)
    assert before.precision is PROJECT_BF16 and after.precision is MASTER_BF16
    assert after.compute_copy_bytes == 0 < before.compute_copy_bytes
    assert after.activations_bytes < before.activations_bytes  # a bf16 residual stream
    old, new = predict_state_bytes(run), predict_state_bytes(masters)
    for measured, predicted in zip(run["state_bytes_per_rank"], old):  # what the committed run measured
        assert {key: measured[key] for key in ("weights", "grads", "master")} == \
            {key: predicted[key] for key in ("weights", "grads", "master")}
    assert [rank["weights"] for rank in new] == [rank["weights"] // 2 for rank in old]
    assert [rank["master"] for rank in new] == [rank["grads"] for rank in old]


def test_predict_run_prices_ep_ft_by_the_layout_its_run_had():
    """ep-ft's bf16 weights with fp32 masters (MASTER_BF16) where summary.json names them; a bf16 run without
    `master_weights` ran fp32 weights under autocast and keeps that price (PROJECT_BF16), its own expert casts too."""
    run = json.loads((REPO_ROOT / "devlog" / "data" / "2026-11-26-moe" / "ep-ft" / "summary.json").read_text())
    autocast = {**run, "config": {**run["config"], "dtype": "bf16"}}
    masters = {**autocast, "master_weights": {"compute_dtype": "bfloat16", "master_dtype": "float32"}}
    before, after = predict_run(autocast), predict_run(masters)
    assert before.precision is PROJECT_BF16 and after.precision is MASTER_BF16
    assert after.compute_copy_bytes == 0 < before.compute_copy_bytes
    assert after.buffers_bytes == before.buffers_bytes / 2  # the dispatched rows in bf16, not fp32
    assert after.activations_bytes < before.activations_bytes  # a bf16 residual stream
    old, new = predict_state_bytes(autocast), predict_state_bytes(masters)
    assert [rank["weights"] for rank in new] == [rank["weights"] // 2 for rank in old]
    assert [rank["master"] for rank in new] == [rank["grads"] for rank in old]
