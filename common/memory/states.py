"""The byte model: bytes per parameter, the model's geometry, the model states of one device, and what DeepSpeed's
ZeRO-3 keeps gathered. (common/memory/__init__.py says how the parts fit together.)

1. Model states: bytes per parameter are a named choice (`BytesPerParam`), never a hidden constant.
   - ZERO_PAPER: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
     section 3.1 and Figure 1: fp16 weights 2 + fp16 gradients 2 + K = 12 bytes of optimizer state (fp32 master
     weights 4, Adam momentum 4, variance 4): 16 bytes per parameter. Sharded over N_d data-parallel devices:
         baseline (DDP)        (2 + 2 + K) Psi
         P_os     (ZeRO-1)     2 Psi + 2 Psi + K Psi / N_d
         P_os+g   (ZeRO-2)     2 Psi + (2 + K) Psi / N_d
         P_os+g+p (ZeRO-3)     (2 + 2 + K) Psi / N_d
     For Psi = 7.5e9 and N_d = 64 that is 120 GB, 31.4 GB, 16.6 GB and 1.9 GB (GB = 1e9 bytes), the paper's numbers.
   - BF16_RULE_OF_THUMB: bf16 weights 2 + bf16 gradients 2 + fp32 AdamW moments 8 = 12 bytes per parameter, no
     master copy (the usual back-of-envelope figure: a 7B model needs 84 GB before activations).
   - PROJECT_BF16: what ep, fsdp and fsdp-tp do under `--dtype bf16`: the weights stay fp32 and
     are the master copy (4), fp32 gradients (4), fp32 AdamW m and v (8): 16 bytes per parameter. The bf16 copies
     the matrix multiplies read are made by torch.autocast (ep), which caches the cast of every
     trainable weight for the whole forward, or by FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
     reduce_dtype=fp32) (fsdp), which all-gathers each layer in bf16 just before it runs. PROJECT_FP32
     (`--dtype fp32`): 4 + 4 + 8, no copies.
   - MASTER_BF16: what single, ddp, tp, tp-sp and pp do under `--dtype bf16` (common/precision.py): the weights
     themselves are bf16 (2) and the forward reads them without autocast, AdamW updates a separate fp32 master copy
     (4), gradients accumulate in fp32 (4), AdamW m and v (8): 18 bytes per parameter, DeepSpeed's bf16 bytes (ddp
     adds DDP's bf16 buckets, 2, estimate.py). A summary.json of theirs without `master_weights` is of a run from
     before this layout (fp32 weights under autocast): predict_run prices it PROJECT_BF16.
   - DEEPSPEED_BF16: what zero-ft does under `--dtype bf16`, DeepSpeed's own bf16 mode (no autocast): the module
     itself is bf16 (2), gradients accumulate in fp32 (4, data_types.grad_accum_dtype), the optimizer keeps an fp32
     master copy (4) and AdamW m and v (8): 18 bytes per parameter. DEEPSPEED_FP32 (`--dtype fp32`): the module
     stays fp32 (4) and ZeRO still clones this rank's partition into a separate fp32 master copy (4), + 4 + 8 = 20.
   strategy_precision() is the one place that says which strategy keeps which: the command line (--dtype),
   recommend() and predict_run() take it from there; a BytesPerParam given instead
   (--precision zero-paper) prices every strategy with that one convention.
   With LoRA only the adapter's parameters have gradients and optimizer state; a frozen weight costs `frozen` bytes:
   2 under --dtype bf16 (the experiments load a LoRA base in bf16, common.models.weights_dtype: it needs no master
   copy, and autocast has nothing to cast), 4 under --dtype fp32; DeepSpeed's bf16 mode casts every parameter of
   the module, the adapters too, to bf16.
   QLoRA (single-ft and ddp-ft --qlora): the decoder layers' linear weights are bitsandbytes' 4-bit NF4 with double
   quantization (Dettmers et al. 2023, "QLoRA", section 2): 4 bits per weight, one 8-bit absmax per block of 64
   weights and one fp32 scale per 256 absmaxes, NF4_BYTES_PER_WEIGHT = 0.5 + 1/64 + 4/16384 = 0.5159 bytes (the
   paper's 4.127 bits); the embedding (tied LM head) and the norms are frozen in fp32, where peft's
   prepare_model_for_kbit_training puts every parameter it did not quantize; the adapters are fp32 and trained
   (QLORA). Per tensor, bitsandbytes also keeps its 256-entry fp32 code book and an offset (about 1 KiB), not
   counted.
   What DeepSpeed 0.19.8 allocates for these states (runtime/bf16_optimizer.py, zero/stage_1_and_2.py,
   zero/stage3.py), in bytes per parameter, P parameters sharded over N ranks:
       zero-1, bf16   BF16_Optimizer (DeepSpeed's choice for stage 1 with bf16 weights and fp32 accumulation):
                      bf16 weights 2 + the bf16 gradients autograd writes 2 + a full fp32 gradient buffer 4
                      + (fp32 master 4 + AdamW 8) / N  =  8 + 12/N
       zero-1, fp32   fp32 weights 4 + full fp32 gradients 4 (reduced only at the last micro-batch) + (4 + 8) / N
       zero-2         bf16: 2 + (fp32 gradient partition 4 + master 4 + AdamW 8) / N = 2 + 16/N; fp32: 4 + 16/N
       zero-3         bf16: (2 + 4 + 4 + 8) / N = 18/N; fp32: 20/N; and parameters of fewer than
                      stage3_param_persistence_threshold = 1e5 elements (the norms, most LoRA adapters) are
                      gathered once and never released: every rank keeps them whole beside their partition (+2)


2. Where this model and DeepSpeed's estimators differ, and why. DeepSpeed prints per-GPU and per-node estimates of
   model states (deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold,
   zero.stage3.estimate_zero3_model_states_mem_needs_all_cold). Both sides assume full SFT (every parameter
   trainable), bf16 weights with an fp32 master copy and fp32 AdamW m and v, N GPUs on one node, and they agree on
   those states: ZeRO-3's 18 P / N is this model's (2 + 4 + 4 + 8) P / N, the offloaded optimizer's 16 P is this
   model's (4 + 4 + 8) P / N summed over the ranks, and ZeRO-Offload's GPU 2 P is this model's bf16 weights.
   They differ where DeepSpeed's formulas simplify (tests/test_memory.py reconciles them term by term):
   - ZeRO-2 gradients: DeepSpeed counts 2 + 18 P / N, its 18 being 16-bit gradients 2 + fp32 gradients 4 + fp32
     master 4 + AdamW 8. Stage 2 keeps no 16-bit gradient partition (each bf16 gradient is staged in the reduce
     bucket and reduced into the fp32 partition), so this model has 2 + 16 P / N: 2 P / N less.
   - Buffers: DeepSpeed's estimators leave out the reduce bucket and its flattened fp32 copy (w B + 4 B: 2.8 GiB
     in bf16 stages 1-2, 3.7 GiB in stage 3, whatever N) and the gradient of the largest parameter (c E: 0.72 GiB
     for Qwen3-4B's embedding), which this model counts.
   - ZeRO-3 working set: DeepSpeed adds 4 bytes x largest_layer_params, the largest module gathered in 16 bits (2)
     with its 16-bit gradient (2). This model keeps the gradient half (c E) but replaces the gathered half by what
     the coordinator really keeps gathered, w x zero3_gathered_elements() (1.39e9 elements rather than 3.9e8 for
     Qwen3-4B), adds the persistent parameters, whole on every rank, and the bucket above.
   - ZeRO-1 has no estimator of its own; zero-ft's bf16 ZeRO-1 (BF16_Optimizer) keeps 8 + 12 P / N.
   - Host memory: DeepSpeed's per-node estimates multiply by additional_buffer_factor = 1.5, a margin, and take the
     larger of the optimizer's 16 P and 4 P per GPU for each process loading the fp32 model into host memory
     (ZeRO-2 offload, ZeRO-3 without zero.Init; zero-ft builds a preset whole on the host before DeepSpeed takes
     it, which is a peak at start-up, not during training). This model counts neither, and adds DeepSpeed's host
     staging copies (w T / N + w E per rank for ZeRO-Offload). Without offload DeepSpeed prints 4 P x N x 1.5 of
     host memory for loading the model; this model counts no host memory there.
   - Outside model states DeepSpeed counts nothing: no activations, logits or autocast copies (activations.py).

"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from transformers import PretrainedConfig

from common.models import count_parameters, is_moe, model_config

GIB = 2**30
GB = 1e9  # the ZeRO paper's unit
# Share of a GPU's memory a run can fill: the rest goes to the CUDA/HIP context, cuBLAS and NCCL workspaces and
# allocator fragmentation. Memory is in GiB throughout, as the driver reports it (an RTX 4090 has 24,564 MiB, 23.99
# GiB; an "H100 80GB" 79.6 GiB): the makers' "24 GB" and "80GB" are rounded GiB, not 1e9 bytes.
USABLE_FRACTION = 0.90
# The model's own error: a rung fits when its prediction times (1 + ERROR_BAND) is within the usable share. The band
# is the largest under-prediction, measured max_memory_reserved / predicted - 1, over the committed GPU runs
# (devlog/data, device_kind cuda or rocm) measured at PEAK_TESTED_FROM_GIB or more, rounded up to a whole percent and
# never below ERROR_BAND_FLOOR. common.memory.error_band() recomputes it; tests/test_memory.py fails when it is stale.
# Stored, not computed at run time: the CLI and a copied common/ work without devlog/.
ERROR_BAND = 0.15  # fsdp-ft on one H200 rank: 13.70 GiB reserved, 11.94 predicted (2026-11-26-gpu-suite-nvidia-h200)
ERROR_BAND_FLOOR = 0.05  # the least margin, whatever the runs say: the allocator's fragmentation varies by run
# Below this measured peak, per-process allocations the model does not price (cuBLAS's workspace, up to 32 MiB per
# handle and stream on Hopper; the allocator's 2 MiB blocks) are too large a share for a run to test the model: the
# MoE preset's GPU run (0.23 GiB reserved, 0.14 predicted) is the one such run. Neither the band nor the tests use them.
PEAK_TESTED_FROM_GIB = 1.0
FP32_BYTES = 4
LORA_PROJECTIONS = 7  # q, k, v, o, gate, up, down: every linear of a decoder layer, as the experiments adapt
# bitsandbytes' NF4 with double quantization (bnb_4bit_use_double_quant, as common.models.load_model_4bit sets it):
# 4 bits per weight, an 8-bit absmax per block of 64 weights, an fp32 scale per block of 256 absmaxes.
NF4_BLOCK = 64
NF4_ABSMAX_BLOCK = 256
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / NF4_BLOCK + FP32_BYTES / (NF4_BLOCK * NF4_ABSMAX_BLOCK)
# DeepSpeed's defaults, which zero-ft leaves as they are (deepspeed/runtime/zero/config.py, runtime/engine.py)
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000  # zero_optimization.reduce_bucket_size
DEEPSPEED_ALLREDUCE_BUCKET_ELEMENTS = 500_000_000  # the engine's all-reduce bucket (MEMORY_OPT_ALLREDUCE_SIZE)
DEEPSPEED_PREFETCH_BUCKET_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size
DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold: smaller ones stay gathered
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters (bounds prefetching only)
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance, in parameter elements

STRATEGIES = ("single", "ddp", "zero-1", "zero-2", "zero-3", "fsdp", "tp", "tp-sp", "pp",
              "zero-2-offload", "zero-3-offload", "fsdp-offload", "ep")
# What prices a mixture of experts (estimate.py, section 3): single-ft and ep-ft train one, every other experiment
# refuses it.
MOE_STRATEGIES = ("single", "ep")
# Layouts on a 2-D mesh, which take a tensor-parallel degree beside the world size: estimate() prices them, the
# table and recommend() do not list them (they compare the strategies of one GPU count, one dimension).
MESH_STRATEGIES = ("fsdp-tp",)
# Which model states a strategy divides by the data-parallel world size: (weights, gradients, optimizer + master).
DATA_PARALLEL_SHARDING = {
    "single": (False, False, False), "ddp": (False, False, False),
    "zero-1": (False, False, True), "zero-2": (False, True, True), "zero-2-offload": (False, True, True),
    "zero-3": (True, True, True), "zero-3-offload": (True, True, True),
    "fsdp": (True, True, True), "fsdp-offload": (True, True, True),
    "tp": (False, False, False), "tp-sp": (False, False, False), "pp": (False, False, False),
    "fsdp-tp": (True, True, True),  # divided by dp = world / t, on top of the tensor-parallel split by t
    "ep": (False, False, False),  # the experts are split by device_slices; the dense part is replicated
}
DEEPSPEED_STRATEGIES = ("zero-1", "zero-2", "zero-3", "zero-2-offload", "zero-3-offload")  # zero-ft
ZERO3_STRATEGIES = ("zero-3", "zero-3-offload")  # DeepSpeed gathers each module's parameters as it runs
FSDP_STRATEGIES = ("fsdp", "fsdp-offload", "fsdp-tp")  # FSDP2 gathers one unit (decoder layer, root) at a time
UNIT_SHARDED = ZERO3_STRATEGIES + FSDP_STRATEGIES  # weights sharded, gathered in the compute dtype to run
# The model states each offloading strategy keeps in host memory instead of on the GPU.
OFFLOADED_STATES = {"zero-2-offload": ("grads", "optimizer", "master"),
                    "zero-3-offload": ("grads", "optimizer", "master"),
                    "fsdp-offload": ("weights", "grads", "optimizer", "master")}
DTYPES = ("bf16", "fp32")  # the experiments' --dtype


# ---------------------------------------------------------------------------------------------------------------
# Bytes per parameter
@dataclass(frozen=True)
class BytesPerParam:
    name: str
    weights: int  # a trainable weight as kept between steps
    grads: int  # gradient of a trainable parameter
    optimizer: int  # AdamW's first and second moments
    master: int  # a separate fp32 copy of the weights; 0 when the weights themselves are fp32
    compute: int  # one element of the activations, and of the weights as the matrix multiplies read them
    frozen: int  # a frozen weight (LoRA's base): no gradient, no optimizer state, no master copy
    description: str = ""

    @property
    def trainable(self) -> int:
        """Model-state bytes of one trainable parameter."""
        return self.weights + self.grads + self.optimizer + self.master

    @property
    def zero_k(self) -> int:
        """The ZeRO paper's K: optimizer-state bytes per parameter, master copy included."""
        return self.optimizer + self.master


ZERO_PAPER = BytesPerParam("zero-paper", weights=2, grads=2, optimizer=8, master=4, compute=2, frozen=2,
                           description="ZeRO paper: fp16 weights 2 + fp16 grads 2 + K=12 (fp32 master, m, v)")
BF16_RULE_OF_THUMB = BytesPerParam("bf16-rule-of-thumb", weights=2, grads=2, optimizer=8, master=0, compute=2,
                                   frozen=2, description="bf16 weights 2 + bf16 grads 2 + fp32 AdamW m, v 8")
PROJECT_BF16 = BytesPerParam("project-bf16", weights=4, grads=4, optimizer=8, master=0, compute=2, frozen=2,
                             description="--dtype bf16: fp32 weights 4 + grads 4 + AdamW m, v 8; bf16 compute; a "
                                         "frozen (LoRA base) weight 2")
PROJECT_FP32 = BytesPerParam("project-fp32", weights=4, grads=4, optimizer=8, master=0, compute=4, frozen=4,
                             description="--dtype fp32: fp32 weights 4 + grads 4 + AdamW m, v 8")
# DeepSpeed's own bf16 mode, as zero-ft and pp-ds-ft configure it: bf16 weights in the module 2, fp32 gradient
# accumulation 4 (data_types.grad_accum_dtype), fp32 master copy 4 and AdamW moments 8 in the optimizer.
DEEPSPEED_BF16 = BytesPerParam("deepspeed-bf16", weights=2, grads=4, optimizer=8, master=4, compute=2, frozen=2,
                               description="DeepSpeed bf16: bf16 weights 2 + fp32 grads 4 + fp32 master 4 + m, v 8")
# DeepSpeed without bf16 (zero-ft --dtype fp32): the module stays fp32, and ZeRO still clones this rank's partition
# of it into a separate fp32 master copy (stages 1-2: single_partition_of_fp32_groups; stage 3:
# fp32_partitioned_groups_flat), so the master costs 4 bytes more than the weights alone.
DEEPSPEED_FP32 = BytesPerParam("deepspeed-fp32", weights=4, grads=4, optimizer=8, master=4, compute=4, frozen=4,
                               description="DeepSpeed fp32: fp32 weights 4 + grads 4 + fp32 master copy 4 + m, v 8")
# QLoRA (--qlora, bf16 compute): fp32 adapters with fp32 gradients and AdamW state; the frozen parameters that are not
# quantized (embedding, norms) fp32, as prepare_model_for_kbit_training leaves them; the quantized linear weights
# cost NF4_BYTES_PER_WEIGHT each (model_state_bytes' `quantized`).
QLORA = BytesPerParam("qlora", weights=4, grads=4, optimizer=8, master=0, compute=2, frozen=4,
                      description="--qlora: fp32 adapters 4 + grads 4 + AdamW m, v 8; NF4 linear weights "
                                  f"{NF4_BYTES_PER_WEIGHT:.4f}, other frozen weights fp32 4")
# single-ft, ddp-ft, tp-ft, tp-sp-ft and pp-ft under --dtype bf16 (common/precision.py): bf16 weights read without
# autocast, fp32 gradients accumulated from the bf16 ones, an fp32 master copy that AdamW updates, AdamW m and v; a
# frozen (LoRA base) weight bf16.
MASTER_BF16 = BytesPerParam("master-bf16", weights=2, grads=4, optimizer=8, master=4, compute=2, frozen=2,
                            description="--dtype bf16, no autocast: bf16 weights 2 + fp32 grads 4 + fp32 master 4 "
                                        "+ AdamW m, v 8; a frozen (LoRA base) weight 2")
PRECISIONS = {p.name: p for p in (PROJECT_BF16, PROJECT_FP32, ZERO_PAPER, BF16_RULE_OF_THUMB, DEEPSPEED_BF16,
                                  DEEPSPEED_FP32, QLORA, MASTER_BF16)}
# Where QLoRA runs: the experiments that offer --qlora (fsdp-ft refuses it: fully_shard would have to shard
# bitsandbytes' packed weights).
QLORA_STRATEGIES = ("single", "ddp")
# Where --dtype bf16 computes in bf16 weights with fp32 masters (common/precision.py), not under autocast.
MASTER_WEIGHT_STRATEGIES = ("single", "ddp", "tp", "tp-sp", "pp", "ep")


def strategy_precision(strategy: str, dtype: str = "bf16") -> BytesPerParam:
    """The bytes per parameter that the experiment running `strategy` keeps under `--dtype dtype`: DeepSpeed's own
    layouts for zero-ft (DeepSpeed's bf16 mode, no autocast), bf16 weights with fp32 masters for single-ft, ddp-ft,
    tp-ft, tp-sp-ft, pp-ft and ep-ft (common/precision.py, no autocast), fp32 weights that are their own master copy
    for every other experiment (autocast or FSDP2's mixed-precision policy make the bf16 copies). The one place the
    command line, recommend() and predict_run() take it from."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if strategy in DEEPSPEED_STRATEGIES:
        return DEEPSPEED_BF16 if dtype == "bf16" else DEEPSPEED_FP32
    if strategy in MASTER_WEIGHT_STRATEGIES and dtype == "bf16":
        return MASTER_BF16
    return PROJECT_BF16 if dtype == "bf16" else PROJECT_FP32


def resolve_precision(strategy: str, precision: BytesPerParam | str) -> BytesPerParam:
    """`precision` as given (one convention for every strategy, e.g. ZERO_PAPER), or a --dtype ("bf16", "fp32")
    turned into what that strategy's experiment keeps (strategy_precision)."""
    return strategy_precision(strategy, precision) if isinstance(precision, str) else precision


# ---------------------------------------------------------------------------------------------------------------
# Model geometry
@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = True
    # A stated total (e.g. a model card's); default: counted from the geometry. Any difference is put outside the
    # decoder layers, where padded vocabularies and extra heads live.
    parameters: int | None = None
    # A mixture of experts (Qwen3-MoE, every layer sparse): E experts of width expert_intermediate, k of them per
    # token, and a router; `intermediate` then sizes nothing. 0: a dense model.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0

    def _config(self):
        return SimpleNamespace(hidden_size=self.hidden, num_hidden_layers=self.layers, vocab_size=self.vocab,
                               num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                               head_dim=self.head_dim, intermediate_size=self.intermediate,
                               tie_word_embeddings=self.tied_embeddings, num_experts=self.experts,
                               num_experts_per_tok=self.experts_per_token,
                               moe_intermediate_size=self.expert_intermediate)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def layer_parameters(self) -> int:
        return count_parameters(self._config())["per_layer"]

    @property
    def layer_expert_parameters(self) -> int:
        """All experts of one layer: gate_up_proj [E, 2 I_e, d] + down_proj [E, d, I_e] (0 for a dense model)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def router_parameters(self) -> int:
        return self.experts * self.hidden  # one layer's router, [E, d]

    @property
    def layer_norm_parameters(self) -> int:
        return 2 * self.hidden + 2 * self.head_dim  # input and post-attention RMSNorm, q_norm, k_norm

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_parameters(self) -> int:
        return self.parameters or count_parameters(self._config())["total"]

    @property
    def root_parameters(self) -> int:
        """What is not in a decoder layer: embedding, final norm, the LM head when untied."""
        return self.total_parameters - self.layers * self.layer_parameters

    def lora_parameters(self, rank: int, tensor_parallel: int = 1) -> int:
        """Adapter parameters of rank `rank` on the seven projections: rank x (inputs + outputs) each. Under tensor
        parallelism over t, one rank's share, as tp-ft's plan splits them (with_lora_adapters): a column-split
        projection (q, k, v, gate, up) keeps A (rank x inputs) whole and splits B's outputs; a row-split one (o,
        down) splits A's inputs and keeps B whole."""
        if self.is_moe and rank:
            raise ValueError(f"LoRA on a mixture of experts is not priced ({self.name}): peft also wraps the "
                             f"experts' 3-D weights (ParamWrapper), which this module does not model")
        d, q, kv, inner = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        t = tensor_parallel
        column_split = (d + q / t) + 2 * (d + kv / t) + 2 * (d + inner / t)  # A whole, B split
        row_split = (q / t + d) + (inner / t + d)  # A split, B whole
        per_layer = column_split + row_split
        return round(rank * per_layer * self.layers)  # whole: t divides every width it splits


def model_shape(config_like) -> ModelShape:
    """A preset or hub name (through common.models.model_config), a transformers config, a ModelShape, or a dict
    of raw counts: layers, hidden, heads, kv_heads, head_dim, intermediate, vocab (and optionally
    tied_embeddings, parameters, name)."""
    if isinstance(config_like, ModelShape):
        return config_like
    if isinstance(config_like, dict):
        return ModelShape(**{"name": "custom", **config_like})
    name = None
    if isinstance(config_like, str):
        name, config_like = config_like, model_config(config_like)
    if not isinstance(config_like, PretrainedConfig):
        raise TypeError(f"expected a model name, a transformers config, a ModelShape or a dict, got {config_like!r}")
    config = config_like
    if getattr(config, "attention_bias", False):
        raise ValueError("attention biases are not modelled; Qwen3 has none")
    experts = {}
    if is_moe(config):
        # Qwen3-MoE as the presets and Qwen3-30B-A3B build it: every layer sparse, top-k renormalised.
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise ValueError("dense MLP layers between the sparse ones (mlp_only_layers, decoder_sparse_step) are "
                             "not modelled; every layer of Qwen3-MoE is sparse")
        experts = dict(experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                       expert_intermediate=config.moe_intermediate_size)
    return ModelShape(
        name=name or getattr(config, "name_or_path", "") or config.model_type, layers=config.num_hidden_layers,
        hidden=config.hidden_size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        intermediate=config.intermediate_size, vocab=config.vocab_size,
        tied_embeddings=bool(config.tie_word_embeddings), **experts)


# ---------------------------------------------------------------------------------------------------------------
# Model states
def model_state_bytes(trainable: float, frozen: float, precision: BytesPerParam, strategy: str,
                      world_size: int, quantized: float = 0.0) -> dict[str, float]:
    """Weights, gradients, optimizer state and master copy of one device holding `trainable` + `frozen` (+ `quantized`,
    QLoRA's 4-bit weights) parameters (before data-parallel sharding), with the states `strategy` shards divided by
    `world_size`."""
    shard_weights, shard_grads, shard_optimizer = DATA_PARALLEL_SHARDING[strategy]
    weights_share = 1 / world_size if shard_weights else 1
    grads_share = 1 / world_size if shard_grads else 1
    optimizer_share = 1 / world_size if shard_optimizer else 1
    weights = trainable * precision.weights + frozen * precision.frozen + quantized * NF4_BYTES_PER_WEIGHT
    return dict(weights=weights * weights_share,
                grads=trainable * precision.grads * grads_share,
                optimizer=trainable * precision.optimizer * optimizer_share,
                master=trainable * precision.master * optimizer_share)


def zero_paper_figure1(parameters: float = 7.5e9, devices: int = 64) -> list[tuple[str, str, float]]:
    """Rajbhandari et al. 2020, Figure 1: model-state memory per device for each ZeRO stage, in GB (1e9 bytes)."""
    rows = [("baseline", "ddp", "(2 + 2 + K) Psi"), ("P_os", "zero-1", "2 Psi + 2 Psi + K Psi / N_d"),
            ("P_os+g", "zero-2", "2 Psi + (2 + K) Psi / N_d"), ("P_os+g+p", "zero-3", "(2 + 2 + K) Psi / N_d")]
    return [(stage, formula, sum(model_state_bytes(parameters, 0, ZERO_PAPER, strategy, devices).values()) / GB)
            for stage, strategy, formula in rows]


# ---------------------------------------------------------------------------------------------------------------
# Parameters module by module: what DeepSpeed's ZeRO-3 keeps whole, gathers and releases
Module = tuple[tuple[str, int, bool], ...]  # one leaf module's own parameters: (name, elements, trainable)


def leaf_modules(shape: ModelShape, lora_rank: int = 0) -> tuple[Module, list[list[Module]], list[Module]]:
    """The embedding, the decoder layers' leaf modules and the final norm + LM head, each in the order the forward
    runs them (Qwen3: q_proj then q_norm, k_proj then k_norm, v_proj, o_proj; gate, up, down). peft's LoRA puts
    the base weight and the adapters' A and B in three modules of their own. A tied LM head is the embedding's
    parameter again; only the adapters are trainable under LoRA, everything is in full SFT. Counted from the
    geometry: the extra parameters of a stated total (ModelShape.parameters) are not listed."""
    d, q, kv, inner, h = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, \
        shape.intermediate, shape.head_dim
    full = lora_rank == 0

    def linear(name: str, inputs: int, outputs: int) -> list[Module]:
        base = ((name, inputs * outputs, full),)
        if full:
            return [base]
        return [base, ((f"{name}.lora_A", lora_rank * inputs, True),),
                ((f"{name}.lora_B", outputs * lora_rank, True),)]

    layers = []
    for index in range(shape.layers):
        p = f"layers.{index}."
        if shape.is_moe:  # the router, then one module holding every expert as two 3-D weights
            E, inner = shape.experts, shape.expert_intermediate
            mlp = [((p + "mlp.gate", shape.router_parameters, full),),
                   ((p + "mlp.experts.gate_up_proj", E * 2 * inner * d, full),
                    (p + "mlp.experts.down_proj", E * d * inner, full))]
        else:
            mlp = [*linear(p + "gate_proj", d, inner), *linear(p + "up_proj", d, inner),
                   *linear(p + "down_proj", inner, d)]
        layers.append([((p + "input_layernorm", d, full),), *linear(p + "q_proj", d, q), ((p + "q_norm", h, full),),
                       *linear(p + "k_proj", d, kv), ((p + "k_norm", h, full),), *linear(p + "v_proj", d, kv),
                       *linear(p + "o_proj", q, d), ((p + "post_attention_layernorm", d, full),), *mlp])
    embedding = (("embed_tokens", shape.embedding_parameters, full),)
    head = embedding if shape.tied_embeddings else (("lm_head", shape.embedding_parameters, full),)
    return embedding, layers, [(("norm", d, full),), head]


def zero3_persistent_parameters(shape: ModelShape, lora_rank: int = 0) -> int:
    """Elements of the parameters ZeRO-3 never releases once gathered (fewer than stage3_param_persistence_threshold
    elements each): every rank keeps them whole beside its partition. For Qwen3: the norms, most LoRA adapters."""
    embedding, layers, tail = leaf_modules(shape, lora_rank)
    unique = {name: elements for module in (embedding, *(m for layer in layers for m in layer), *tail)
              for name, elements, _ in module}
    return sum(n for n in unique.values() if n < DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD)


def largest_trainable_parameter(shape: ModelShape, lora_rank: int = 0) -> int:
    """Elements of the largest trainable parameter (the embedding in full SFT, an adapter matrix with LoRA)."""
    embedding, layers, tail = leaf_modules(shape, lora_rank)
    return max(n for module in (embedding, *layers[0], *tail) for _, n, trainable in module if trainable)


@lru_cache(maxsize=None)
def zero3_gathered_elements(shape: ModelShape, lora_rank: int = 0, activation_checkpointing: bool = False) -> int:
    """The most parameter elements ZeRO-3 holds gathered at once during one training step, under zero-ft's defaults.

    DeepSpeed's PartitionedParameterCoordinator replays the order of the first step: before a module runs it
    all-gathers the module's parameters and prefetches the next ones, up to stage3_prefetch_bucket_size elements
    (and while fewer than stage3_max_live_parameters are gathered); after it runs, it releases each parameter
    unless the same parameter is used again within the next stage3_max_reuse_distance elements of the order
    (deepspeed/runtime/zero/partitioned_param_coordinator.py, __params_to_release). Both keep far more than the
    module running: prefetching goes on, one bucket per module, until 1e9 elements are gathered, and a model
    smaller than the reuse window (Qwen3-0.6B, 5.96e8 elements) is never released at all. Parameters under
    stage3_param_persistence_threshold are never released either (zero3_persistent_parameters) and are not
    counted here. With activation checkpointing, backward runs each layer's forward again just before the
    layer's backward."""
    embedding, layers, tail = leaf_modules(shape, lora_rank)
    order = [embedding, *(module for layer in layers for module in layer), *tail, *reversed(tail)]
    for layer in reversed(layers):
        order += [*(layer if activation_checkpointing else []), *reversed(layer)]
    order.append(embedding)
    gathered = [[(name, n) for name, n, _ in module if n >= DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD]
                for module in order]
    # Elements traversed before each step (every parameter counts, persistent ones too), and where each gathered
    # parameter is used next.
    before = [0]
    for module in order:
        before.append(before[-1] + sum(n for _, n, _ in module))
    next_use, seen = [dict() for _ in order], {}
    for step in range(len(order) - 1, -1, -1):
        next_use[step] = {name: seen.get(name) for name, _ in gathered[step]}
        seen.update({name: step for name, _ in gathered[step]})
    queue = [(step, name, n) for step, module in enumerate(gathered) for name, n in module]  # the prefetch queue

    live: dict[str, int] = {}
    fetched_for: dict[str, int] = {}  # the latest step a parameter was fetched or prefetched for
    position = peak = 0
    for step, module in enumerate(gathered):
        for name, n in module:
            live[name] = n
        while position < len(queue) and queue[position][0] <= step:
            fetched_for[queue[position][1]] = max(fetched_for.get(queue[position][1], 0), queue[position][0])
            position += 1
        budget, prefetched = min(DEEPSPEED_MAX_LIVE_PARAMETERS - sum(live.values()),
                                 DEEPSPEED_PREFETCH_BUCKET_ELEMENTS), 0
        while position < len(queue) and prefetched < budget:
            for_step, name, n = queue[position]
            fetched_for[name] = max(fetched_for.get(name, 0), for_step)
            if name not in live:
                live[name] = n
                prefetched += n
            position += 1
        peak = max(peak, sum(live.values()))
        for name, _ in module:
            reused = next_use[step][name]
            # Kept: used again before the reuse window (the elements after this step) reaches its limit, or
            # prefetched for a later step.
            if (reused is not None and before[reused] - before[step + 1] < DEEPSPEED_MAX_REUSE_DISTANCE) \
                    or fetched_for.get(name, 0) > step:
                continue
            live.pop(name, None)
    return peak


