"""Memory per device for fine-tuning a Qwen3 decoder under each strategy, and which strategy to try first.

    uv run python -m common.memory --model qwen3-0.6b --gpus 2 --gpu-mem-gb 32 --seq-len 1024
    uv run python -m common.memory --model qwen3-4b --gpus 1 --gpu-mem-gb 24 --activation-checkpointing --lora-rank 16
    uv run python -m common.memory --model qwen3-4b --gpus 8 --gpu-mem-gb 24 --dtype fp32 --grad-accum 4
    uv run python -m common.memory --zero-paper          # reproduce Figure 1 of the ZeRO paper

The peak of one device is taken as the sum of everything below. That is what happens once a step holds the
gradients of an earlier micro-batch (--grad-accum > 1) while the next forward's activations are alive; with one
micro-batch and `zero_grad(set_to_none=True)` the gradients grow while the activations shrink, so the true peak
is somewhat lower. Not counted: the CUDA context and
NCCL's own buffers (outside `max_memory_reserved`, hence USABLE_FRACTION), allocator fragmentation, the
gradients of activations inside one layer's backward, the input ids and labels.

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
   - PROJECT_BF16: what single, ddp, tp, tp-sp, pp, fsdp and fsdp-tp do under `--dtype bf16`: the weights stay fp32 and
     are the master copy (4), fp32 gradients (4), fp32 AdamW m and v (8): 16 bytes per parameter. The bf16 copies
     the matrix multiplies read are made by torch.autocast (single, ddp, tp, pp), which caches the cast of every
     trainable weight for the whole forward, or by FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
     reduce_dtype=fp32) (fsdp), which all-gathers each layer in bf16 just before it runs. PROJECT_FP32
     (`--dtype fp32`): 4 + 4 + 8, no copies.
   - DEEPSPEED_BF16: what zero-ft does under `--dtype bf16`, DeepSpeed's own bf16 mode (no autocast): the module
     itself is bf16 (2), gradients accumulate in fp32 (4, data_types.grad_accum_dtype), the optimizer keeps an fp32
     master copy (4) and AdamW m and v (8): 18 bytes per parameter. DEEPSPEED_FP32 (`--dtype fp32`): the module
     stays fp32 (4) and ZeRO still clones this rank's partition into a separate fp32 master copy (4), + 4 + 8 = 20.
   strategy_precision() is the one place that says which strategy keeps which: the command line (--dtype),
   recommend() and every experiment's predict_peak_gib() take it from there; a BytesPerParam given instead
   (--precision zero-paper) prices every strategy with that one convention.
   With LoRA only the adapter's parameters have gradients and optimizer state; the frozen base weights cost
   `weights` bytes each (bf16 ones under DeepSpeed, which casts every parameter of the module).
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

2. Activations, bytes per token saved for backward by one decoder layer. The method is that of Korthikanti et
   al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4 (list every tensor autograd
   keeps; their GPT layer keeps 34 s b h + 5 a s^2 b bytes in fp16), redone for transformers' Qwen3 layer (RMSNorm
   computed in fp32, QK-norm, GQA, RoPE, SwiGLU) and for fused attention kernels (flash, memory-efficient, cuDNN)
   that keep a per-head log-sum-exp instead of the s x s probabilities. Each term was checked against the tensors
   that torch.autograd.graph.saved_tensors_hooks records (tests/test_memory.py does it for qwen3-tiny).
   Symbols: d hidden, H query heads, G key/value heads, h head_dim, I MLP width, s sequence length, R LoRA rank;
   c bytes of a compute element (2 bf16, 4 fp32); r bytes of the residual stream: 4 under autocast, whose fp32
   weights keep the embedding output and the residual additions fp32, else c; H_kv heads at which k and v reach
   the kernel: G when it takes GQA natively (flash_attention_2, SDPA without a mask), H when transformers repeats
   them (SDPA with a mask, which packed rows always have).
       norms          2 x [4d (fp32 upcast of the input; the input itself when r = 4) + 4 (1 / rms)
                           + r d (the normalised input, kept for the norm weight's gradient; not with LoRA)]
       linear inputs  autocast: 5 c d (q, k, v, gate and up each save their own bf16 cast of the normed input)
                      otherwise: 2 r d (one tensor per norm, shared by the projections that read it)
       QK-norm        (H + G) h (4 + c) + 4 (H + G)   (fp32 upcast, normalised copy without LoRA, 1 / rms per head)
       attention      c h (H + 2 H_kv) [q, k, v as the kernel got them] + c H h [output = o_proj's input,
                      the kernels write it in (batch, seq, head) order so transformers' transpose copies nothing]
                      + 4 H [log-sum-exp]; + c H h with LoRA under autocast (peft re-casts o_proj's input)
       mask           c s: packed rows through SDPA: the block-diagonal mask, turned into an additive bias in the
                      compute dtype, one s x s matrix per row, saved by every layer
       MLP            4 c I  [gate output, SiLU output, up output, their product = down_proj's input]
       LoRA adapters  7 c R  [A x of the seven adapted projections]
   Outside the layers: the final norm (4d + 4, + r d without LoRA), the LM head's input (c d: autocast's cast of the
   norm's output, or that output itself) and RoPE's cos and sin (2 h r, shared by all layers). Activation checkpointing
   (one checkpoint per decoder layer, as transformers does it) keeps only each layer's input, r d, plus one
   layer's full set while it is recomputed.
   Tensor parallelism divides the QK-norm, attention and MLP terms by t; sequence parallelism divides the rest too
   (Korthikanti et al.'s s b h (10 + 24/t) and s b h 34/t), except the mask, which every rank needs whole.

3. Logits: micro_batch x seq x vocab elements, in the compute dtype (c) as the LM head writes them, plus three
   fp32 tensors alive together inside the cross-entropy backward (log-probabilities, their gradient, the logits'
   gradient): c + 12 bytes per element, at the very start of backward, when every activation is still alive.

4. Temporary buffers, in the `buffers` column (symbols: c compute bytes, w the weights' bytes, T trainable
   parameters, E elements of the largest trainable parameter, B = reduce_bucket_size = 5e8 elements):
   - ddp: none. ddp-ft passes gradient_as_bucket_view=True, so the gradients are views into the all-reduce buckets
     (the default, False, would copy every gradient into a second, bucketed copy).
   - zero-1 under bf16: BF16_Optimizer all-reduces its fp32 gradient buffer in place, one param group at a time;
     only when the group of matrices has at most 5e8 elements (the engine's all-reduce bucket) are both groups
     flattened into one copy first, 4 T (small models only).
   - zero-1 under fp32, zero-2, zero-3: the reduce bucket, allocated at its full B elements whatever the trainable
     count (a LoRA run pays it too), in the module's dtype for stages 1-2 (w B: 0.93 GiB in bf16) and in the fp32
     communication dtype for stage 3 (4 B), plus the fp32 tensor that the collective reduces, flattened from one
     full bucket (4 min(B, T): 1.86 GiB). Stages 2-3 also hold each gradient as autograd writes it (c bytes) until
     it is copied into the bucket; the largest, a tied embedding whose LM-head half arrives at the start of
     backward and embedding half at its end, is alive for all of it: c E.
   - zero-3: the gathered parameters, in the weights' dtype. zero3_gathered_elements() replays one step of
     DeepSpeed's parameter coordinator with zero-ft's defaults (prefetch 5e7, max live 1e9, reuse distance 1e9
     elements): 1.39e9 elements for Qwen3-4B (2.6 GiB in bf16), 1.31e9 for 1.7B, the whole 0.6B model (5.96e8).
     On one rank nothing is gathered: a parameter becomes a view of its (whole) partition.
   - fsdp: the unsharded units. FSDP2 never reshards the root module (embedding, final norm and, when untied, the
     LM head) between forward and backward, and it all-gathers the next layer while the current one runs: root +
     2 layers of weights in the compute dtype. A unit's gradients arrive in c bytes and are copied into an fp32
     reduce-scatter input (the reduce dtype); the root's reduce-scatter waits for the embedding's gradient at the
     end of backward: max(c root + (c + 4) layer, (c + 4) root) of trainable parameters. With --grad-accum > 1
     fsdp-ft reduce-scatters only in the last micro-batch: until then every unit keeps its unsharded gradients,
     upcast to fp32 to accumulate: 4 T + (c + 4) layer (estimate(grad_accum=...)).
   - tp, tp-sp, pp: none counted (their all-gather and send/receive buffers are a few hidden-state tensors).
   Tensor parallelism shards the decoder layers' linear weights and, as tp-ft and tp-sp-ft do, the embedding and
   the LM head over the vocabulary (tied or not: each rank holds V/t rows); the norms are replicated. With loss
   parallel (their default) each rank computes and keeps only its V/t columns of the logits.
   FSDP x TP (fsdp-tp, fsdp-tp-ft: a 2-D mesh of dp = N / t rows of t tensor-parallel ranks; estimate() takes t as
   `tensor_parallel`): each rank holds tp's slice, sharded again by FSDP over the dp ranks. The sharded parts, the
   split weights, their gradients and AdamW state, are divided by dp x t = N; the norms, replicated over t, by dp.
   The buffers are fsdp's (gathered root + 2 layers, unsharded gradients), of the TP slice; activations and logits
   are tp's.
   Pipeline parallelism (1F1B, at least as many micro-batches as stages) splits the layers evenly, puts the
   embedding on the first stage and the final norm and LM head on the last (a tied head becomes a second copy
   there, frozen under LoRA like the embedding); stage k keeps p - k micro-batches of activations in flight, so
   the first stage holds p.

5. CPU offload (`cpu_bytes`: host memory per rank; `cpu_buffers_bytes`: its staging buffers):
   - zero-2-offload (ZeRO-Offload, offload_optimizer device cpu): the GPU keeps the weights (w P) and the buffers
     of section 4 plus a staging buffer for one gradient (w E); the host keeps the fp32 master partition, the fp32
     gradient partition and AdamW's m and v, (4 + 4 + 8) T / N, and copies in the weights' dtype of this rank's
     partition (w T / N) and of the largest gradient (w E).
   - zero-3-offload (offload_optimizer device cpu, parameters on the GPU): the GPU keeps its partition of the
     weights (w P / N), the persistent parameters and the buffers of section 4; the host keeps (4 + 4 + 8) T / N.
   - fsdp-offload: the GPU keeps the units of section 4; the host keeps every sharded state, (4 + 4 + 8) P / N.

6. Where this model and DeepSpeed's estimators differ, and why. DeepSpeed prints per-GPU and per-node estimates of
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
   - Outside model states DeepSpeed counts nothing: no activations, logits or autocast copies (sections 2-3).

7. Mixtures of experts (Qwen3-MoE: every layer's MLP is E SwiGLU experts of width I_e, k per token, chosen by a
   linear router; transformers keeps each layer's experts as two 3-D weights, gate_up_proj [E, 2 I_e, d] and
   down_proj [E, d, I_e]). Two strategies price them, as the two experiments that train them run them: single
   (single-ft) and ep (ep-ft, expert parallelism over W ranks). Every other strategy refuses a mixture of experts
   (a ValueError: mixture of experts: single or ep), as its experiment does; so does LoRA, whose peft adapters on
   the experts' 3-D weights (ParamWrapper) this module does not model.
   - Model states. ep: each rank holds the dense part (embedding, LM head, attention, routers, norms) whole and E / W
     experts of every layer (DTensor Shard(0)), with their fp32 gradients and AdamW state: 16 bytes per held
     parameter under --dtype bf16 and fp32 alike, no reduce bucket counted (ep-ft all-reduces the dense gradients
     in 25 MiB flat copies, section 4's "none counted" for tp/pp). single: the whole model, as for a dense one.
   - Compute copies. Autocast caches its bf16 casts of the attention projections, the routers and the LM head, as
     for a dense model. torch's grouped_mm is not autocast-aware: transformers' experts (single) cast the tokens to
     the weights' dtype, so under --dtype bf16 single-ft's experts compute in fp32 and make no copy; ep-ft casts its
     rows and its E / W experts of each layer to bf16 itself, copies that backward keeps (the grouped product saves
     its weight) until the layer's backward: every layer's, or with checkpointing one layer's (the recomputed one).
   - Activations, per token of one sparse layer, in place of the dense MLP's 4 c I (symbols of section 2, and e the
     bytes of the weights, the dtype transformers' experts compute in):
       linear inputs  autocast: 4 c d (q, k, v and the router each save their cast); otherwise 2 r d, as dense
       router         4 E [fp32 probabilities] + 8 k [top-k ids] + 4 k + 4 [top-k probabilities, their sum]
       aux loss       c E + 8 k: common.moe's load-balancing loss, the softmax of the router logits and its top-k
       experts        single: k (2 e d + 4 e I_e + c + 24)  [its k rows gathered, gate_up out (2 I_e), SiLU out,
                      their product, down out, the routing weight, three int64 index vectors]
                      ep: k (2 c d + 4 c I_e + c + 40 + r d)  [the same rows as the experts received them, in c; five
                      index vectors; and the combine's index_add keeps its source, the weighted rows, in r]
   Each term was checked against saved_tensors_hooks for qwen3-moe-tiny (tests/test_memory.py), single and ep-ft's
   block; not counted: each grouped product's int32 offsets (4 E bytes per layer, not per token). ep's rows are
   those this rank receives: k per token when the load is even; the busiest rank receives more, by the imbalance
   factor that summary.json's expert_load reports, and its expert terms grow by as much.
   - Buffers (ep): the dispatch, inside one layer's expert block: the sorted rows, the received rows and their
     copy regrouped by expert, in r bytes, 3 r k d per token, counted once (one block runs at a time; backward's
     all-to-alls move gradients of the same size).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace

from transformers import PretrainedConfig

from common.models import count_parameters, is_moe, model_config, preset_for

GIB = 2**30
GB = 1e9  # the ZeRO paper's unit
# Share of a GPU's memory a run can fill: the rest goes to the CUDA/HIP context, cuBLAS and NCCL workspaces and
# allocator fragmentation. GPU makers' "24 GB" is 24 GiB of address space (an RTX 4090 has 24,564 MiB).
USABLE_FRACTION = 0.90
FP32_BYTES = 4
CROSS_ENTROPY_FP32_BUFFERS = 3  # log-probabilities, their gradient, the logits' gradient
LORA_PROJECTIONS = 7  # q, k, v, o, gate, up, down: every linear of a decoder layer, as the experiments adapt
DEFAULT_LORA_RANK = 16  # what the recommendation falls back to when full SFT fits nowhere
# DeepSpeed's defaults, which zero-ft leaves as they are (deepspeed/runtime/zero/config.py, runtime/engine.py)
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000  # zero_optimization.reduce_bucket_size
DEEPSPEED_ALLREDUCE_BUCKET_ELEMENTS = 500_000_000  # the engine's all-reduce bucket (MEMORY_OPT_ALLREDUCE_SIZE)
DEEPSPEED_PREFETCH_BUCKET_ELEMENTS = 50_000_000  # stage3_prefetch_bucket_size
DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD = 100_000  # stage3_param_persistence_threshold: smaller ones stay gathered
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000  # stage3_max_live_parameters (bounds prefetching only)
DEEPSPEED_MAX_REUSE_DISTANCE = 1_000_000_000  # stage3_max_reuse_distance, in parameter elements

STRATEGIES = ("single", "ddp", "zero-1", "zero-2", "zero-3", "fsdp", "tp", "tp-sp", "pp",
              "zero-2-offload", "zero-3-offload", "fsdp-offload", "ep")
# What prices a mixture of experts (section 7): single-ft and ep-ft train one, every other experiment refuses it.
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
ATTENTION_KINDS = ("sdpa-packed", "sdpa", "flash")
DTYPES = ("bf16", "fp32")  # the experiments' --dtype
# How to run each strategy in this repository (the README's experiments table).
RUN_WITH = {
    "single": "experiments/single-ft/train.py", "ddp": "experiments/ddp-ft/train.py",
    "zero-1": "experiments/zero-ft/train.py --zero-stage 1", "zero-2": "experiments/zero-ft/train.py --zero-stage 2",
    "zero-3": "experiments/zero-ft/train.py --zero-stage 3", "fsdp": "experiments/fsdp-ft/train.py",
    "tp": "experiments/tp-ft/train.py", "tp-sp": "experiments/tp-sp-ft/train.py", "pp": "experiments/pp-ft/train.py",
    "zero-2-offload": "experiments/zero-ft/train.py --zero-stage 2 --cpu-offload",
    "zero-3-offload": "experiments/zero-ft/train.py --zero-stage 3 --cpu-offload",
    "fsdp-offload": "experiments/fsdp-ft/train.py --cpu-offload",
    "fsdp-tp": "experiments/fsdp-tp-ft/train.py", "ep": "experiments/ep-ft/train.py",
}


# ---------------------------------------------------------------------------------------------------------------
# Bytes per parameter
@dataclass(frozen=True)
class BytesPerParam:
    name: str
    weights: int  # the weights as kept between steps (every parameter, frozen ones included)
    grads: int  # gradient of a trainable parameter
    optimizer: int  # AdamW's first and second moments
    master: int  # a separate fp32 copy of the weights; 0 when the weights themselves are fp32
    compute: int  # one element of the activations, and of the weights as the matrix multiplies read them
    description: str = ""

    @property
    def trainable(self) -> int:
        """Model-state bytes of one trainable parameter."""
        return self.weights + self.grads + self.optimizer + self.master

    @property
    def zero_k(self) -> int:
        """The ZeRO paper's K: optimizer-state bytes per parameter, master copy included."""
        return self.optimizer + self.master


ZERO_PAPER = BytesPerParam("zero-paper", weights=2, grads=2, optimizer=8, master=4, compute=2,
                           description="ZeRO paper: fp16 weights 2 + fp16 grads 2 + K=12 (fp32 master, m, v)")
BF16_RULE_OF_THUMB = BytesPerParam("bf16-rule-of-thumb", weights=2, grads=2, optimizer=8, master=0, compute=2,
                                   description="bf16 weights 2 + bf16 grads 2 + fp32 AdamW m, v 8")
PROJECT_BF16 = BytesPerParam("project-bf16", weights=4, grads=4, optimizer=8, master=0, compute=2,
                             description="--dtype bf16: fp32 weights 4 + grads 4 + AdamW m, v 8; bf16 compute")
PROJECT_FP32 = BytesPerParam("project-fp32", weights=4, grads=4, optimizer=8, master=0, compute=4,
                             description="--dtype fp32: fp32 weights 4 + grads 4 + AdamW m, v 8")
# DeepSpeed's own bf16 mode, as zero-ft and pp-ds-ft configure it: bf16 weights in the module 2, fp32 gradient
# accumulation 4 (data_types.grad_accum_dtype), fp32 master copy 4 and AdamW moments 8 in the optimizer.
DEEPSPEED_BF16 = BytesPerParam("deepspeed-bf16", weights=2, grads=4, optimizer=8, master=4, compute=2,
                               description="DeepSpeed bf16: bf16 weights 2 + fp32 grads 4 + fp32 master 4 + m, v 8")
# DeepSpeed without bf16 (zero-ft --dtype fp32): the module stays fp32, and ZeRO still clones this rank's partition
# of it into a separate fp32 master copy (stages 1-2: single_partition_of_fp32_groups; stage 3:
# fp32_partitioned_groups_flat), so the master costs 4 bytes more than the weights alone.
DEEPSPEED_FP32 = BytesPerParam("deepspeed-fp32", weights=4, grads=4, optimizer=8, master=4, compute=4,
                               description="DeepSpeed fp32: fp32 weights 4 + grads 4 + fp32 master copy 4 + m, v 8")
PRECISIONS = {p.name: p for p in (PROJECT_BF16, PROJECT_FP32, ZERO_PAPER, BF16_RULE_OF_THUMB, DEEPSPEED_BF16,
                                  DEEPSPEED_FP32)}


def strategy_precision(strategy: str, dtype: str = "bf16") -> BytesPerParam:
    """The bytes per parameter that the experiment running `strategy` keeps under `--dtype dtype`: DeepSpeed's own
    layouts for zero-ft (DeepSpeed's bf16 mode, no autocast), fp32 weights that are their own master copy for
    every other experiment (autocast or FSDP2's mixed-precision policy make the bf16 copies). The one place the
    command line, recommend() and the experiments' predict_peak_gib() take it from."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if strategy in DEEPSPEED_STRATEGIES:
        return DEEPSPEED_BF16 if dtype == "bf16" else DEEPSPEED_FP32
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

    def lora_parameters(self, rank: int) -> int:
        """Adapter parameters of rank `rank` on the seven projections: rank x (inputs + outputs) each."""
        if self.is_moe and rank:
            raise ValueError(f"LoRA on a mixture of experts is not priced ({self.name}): peft also wraps the "
                             f"experts' 3-D weights (ParamWrapper), which this module does not model")
        d, q, kv, inner = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + inner) + (inner + d)
        return rank * per_layer * self.layers


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
                      world_size: int) -> dict[str, float]:
    """Weights, gradients, optimizer state and master copy of one device holding `trainable` + `frozen`
    parameters (before data-parallel sharding), with the states `strategy` shards divided by `world_size`."""
    shard_weights, shard_grads, shard_optimizer = DATA_PARALLEL_SHARDING[strategy]
    weights_share = 1 / world_size if shard_weights else 1
    grads_share = 1 / world_size if shard_grads else 1
    optimizer_share = 1 / world_size if shard_optimizer else 1
    return dict(weights=(trainable + frozen) * precision.weights * weights_share,
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


# ---------------------------------------------------------------------------------------------------------------
# Activations
def layer_activation_terms(shape: ModelShape, *, compute_bytes: int, autocast: bool, seq_len: int,
                           attention: str = "sdpa-packed", lora_rank: int = 0, expert_parallel: bool = False,
                           weight_bytes: int = FP32_BYTES) -> dict[str, float]:
    """Bytes per token that one decoder layer keeps for backward, term by term (module docstring, section 2; a
    mixture of experts: section 7, with `expert_parallel` for ep-ft's expert block and `weight_bytes`, the dtype
    transformers' experts compute in, for single-ft's)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS} (eager and the math kernel also keep the "
                         f"s x s probabilities, which this model leaves out), got {attention!r}")
    c, r, f = compute_bytes, FP32_BYTES if autocast else compute_bytes, FP32_BYTES
    d, q_width, kv_width = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    saved_kv_width = q_width if attention == "sdpa-packed" else kv_width
    # With LoRA the norm weights are frozen, so autograd does not keep the normalised input for their gradient.
    keeps_normalised = lora_rank == 0
    # Under autocast each projection saves its own cast of the normed input: q, k, v and the dense MLP's gate and
    # up, or a sparse layer's router (its experts gather their rows themselves).
    casts = 4 if shape.is_moe else 5
    terms = dict(
        norms=2 * (f * d + f + (r * d if keeps_normalised else 0)),
        linear_inputs=casts * c * d if autocast else 2 * r * d,
        qk_norms=(q_width + kv_width) * (f + (c if keeps_normalised else 0)) + f * (shape.heads + shape.kv_heads),
        attention=c * (q_width + 2 * saved_kv_width) + c * q_width + f * shape.heads
                  + (c * q_width if lora_rank and autocast else 0),
        mask=c * seq_len if attention == "sdpa-packed" else 0,
    )
    if not shape.is_moe:
        return {**terms, "mlp": 4 * c * shape.intermediate, "lora_adapters": LORA_PROJECTIONS * c * lora_rank}
    E, k, inner = shape.experts, shape.experts_per_token, shape.expert_intermediate
    if expert_parallel:  # ep-ft's block: its rows in c, five index vectors, index_add keeping its source in r
        experts = k * (2 * c * d + 4 * c * inner + c + 5 * 8 + r * d)
    else:  # transformers' grouped_mm experts: rows in the weights' dtype, three index vectors
        e = weight_bytes
        experts = k * (2 * e * d + 4 * e * inner + c + 3 * 8)
    return {**terms, "router": f * E + 8 * k + f * k + f, "aux_loss": c * E + 8 * k, "experts": experts}


TENSOR_PARALLEL_TERMS = ("qk_norms", "attention", "mlp")  # split over heads or MLP columns


def outside_layers_bytes_per_token(shape: ModelShape, *, compute_bytes: int, autocast: bool,
                                   lora_rank: int = 0) -> float:
    """Final norm, the LM head's input and RoPE's cos/sin (module docstring, section 2)."""
    r = FP32_BYTES if autocast else compute_bytes
    final_norm = FP32_BYTES * shape.hidden + FP32_BYTES + (0 if lora_rank else r * shape.hidden)
    lm_head_input = compute_bytes * shape.hidden  # autocast's cast of the norm's output, or that output itself
    return final_norm + lm_head_input + 2 * shape.head_dim * r


# ---------------------------------------------------------------------------------------------------------------
# One device's share of the model under a strategy
@dataclass(frozen=True)
class DeviceSlice:
    layers: int  # decoder layers this device runs
    layer_trainable: float  # per layer on this device: parameters with gradients (all of them, or the adapters)
    layer_frozen: float  # per layer: parameters without (the base weights under LoRA)
    layer_matmul: float  # per layer: weights the matrix multiplies read (what autocast casts to bf16)
    root_trainable: float  # outside the layers (embedding, final norm, LM head), with gradients
    root_frozen: float
    root_matmul: float  # the LM head matrix, where this device computes the logits
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    micro_batches_in_flight: int = 1  # pipeline stages keep several micro-batches of activations
    computes_logits: bool = True
    vocab_share: float = 1.0  # the share of the logits' vocabulary this device computes (tensor parallel: 1/t)
    label: str = ""
    layer_experts_cast: float = 0.0  # per layer: expert weights cast to the compute dtype outside autocast (ep-ft)

    @property
    def trainable(self) -> float:
        return self.layers * self.layer_trainable + self.root_trainable

    @property
    def frozen(self) -> float:
        return self.layers * self.layer_frozen + self.root_frozen


def device_slices(shape: ModelShape, strategy: str, world_size: int, lora_rank: int,
                  tensor_parallel: int = 1) -> list[DeviceSlice]:
    """What one device holds and runs (before data-parallel sharding); one slice per stage for pp. fsdp-tp: tp's
    slice over `tensor_parallel` ranks (model_state_bytes then shards it over the world / t data-parallel ranks)."""
    layer_norms = shape.layer_norm_parameters
    layer_linears = shape.layer_parameters - layer_norms
    adapters = shape.lora_parameters(lora_rank) / shape.layers
    lm_head = shape.embedding_parameters  # the LM head matrix, tied or not

    def piece(layers: int, root: float, root_matmul: float, linear_share: float = 1.0, **kwargs) -> DeviceSlice:
        linears, layer_adapters = layer_linears * linear_share, adapters * linear_share
        if lora_rank:
            trainable, frozen, root_trainable, root_frozen = layer_adapters, linears + layer_norms, 0.0, root
        else:
            trainable, frozen, root_trainable, root_frozen = linears + layer_norms, 0.0, root, 0.0
        return DeviceSlice(layers, trainable, frozen, linears + layer_adapters, root_trainable, root_frozen,
                           root_matmul, **kwargs)

    if shape.is_moe:
        # single: the whole model; ep: the dense part whole and E / W experts of every layer (section 7). Autocast
        # casts the attention projections, the routers and the LM head; ep-ft casts its experts itself.
        experts = shape.layer_expert_parameters / (world_size if strategy == "ep" else 1)
        dense = shape.layer_parameters - shape.layer_expert_parameters
        return [DeviceSlice(shape.layers, dense + experts, 0.0, dense - layer_norms, shape.root_parameters, 0.0,
                            lm_head, layer_experts_cast=experts if strategy == "ep" else 0.0)]
    if strategy in ("tp", "tp-sp", "fsdp-tp"):
        t = tensor_parallel if strategy == "fsdp-tp" else world_size
        if shape.heads % t or shape.kv_heads % t:
            raise ValueError(f"tensor parallelism over {t} needs the {shape.heads} heads and "
                             f"{shape.kv_heads} KV heads to divide by {t}")
        # tp-ft's plan (fsdp-tp-ft's too): every projection of a layer is split (LoRA adapters counted as split
        # with it, they are tiny), the embedding and the LM head are split over the vocabulary (V/t rows each; one
        # tensor when tied), the norms are replicated; loss parallel keeps each rank's V/t columns of the logits.
        replicated_norms = shape.root_parameters - shape.embedding_parameters * (1 if shape.tied_embeddings else 2)
        root = (shape.root_parameters - replicated_norms) / t + replicated_norms
        return [piece(shape.layers, root, lm_head / t, linear_share=1 / t,
                      tensor_parallel=t, sequence_parallel=strategy == "tp-sp", vocab_share=1 / t)]
    if strategy == "pp":
        if world_size > shape.layers:
            raise ValueError(f"{world_size} pipeline stages for {shape.layers} layers")
        stages = []
        for stage in range(world_size):
            first, last = stage == 0, stage == world_size - 1
            layers = shape.layers // world_size + (1 if stage < shape.layers % world_size else 0)
            # A tied LM head on another stage than the embedding is a second copy of that matrix, with its own
            # gradients and optimizer state; the two copies stay equal by summing their gradients (DeepSpeed's
            # TiedLayerSpec does this).
            head_copy = last and not (first and shape.tied_embeddings)
            root = (shape.embedding_parameters if first else 0) + (shape.hidden if last else 0) \
                + (lm_head if head_copy else 0)
            stages.append(piece(layers, root, lm_head if last else 0, micro_batches_in_flight=world_size - stage,
                                computes_logits=last, label=f"stage {stage} of {world_size}"))
        return stages
    return [piece(shape.layers, shape.root_parameters, lm_head)]


# ---------------------------------------------------------------------------------------------------------------
# The estimate
@dataclass(frozen=True)
class MemoryEstimate:
    strategy: str
    world_size: int
    precision: BytesPerParam
    activation_checkpointing: bool
    lora_rank: int
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    master_bytes: float
    compute_copy_bytes: float  # bf16 copies of fp32 weights made by autocast
    activations_bytes: float
    logits_bytes: float
    buffers_bytes: float  # communication buckets, gathered FSDP/ZeRO-3 parameters, unsharded gradients
    cpu_bytes: float = 0.0  # host memory of this rank: offloaded model states and the offload's staging buffers
    cpu_buffers_bytes: float = 0.0  # of which staging buffers (DeepSpeed's offload)
    note: str = ""  # e.g. which pipeline stage is the largest

    @property
    def model_states_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.master_bytes

    def state_bytes(self) -> dict[str, int]:
        """The model states by kind, in the shape the experiments write `state_bytes_per_rank` (common.metrics)."""
        return dict(weights=int(self.weights_bytes), grads=int(self.grads_bytes),
                    optimizer=int(self.optimizer_bytes), master=int(self.master_bytes))

    @property
    def total_bytes(self) -> float:
        return (self.model_states_bytes + self.compute_copy_bytes + self.activations_bytes + self.logits_bytes
                + self.buffers_bytes)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    def fits(self, gpu_mem_gb: float) -> bool:
        return self.total_gib <= gpu_mem_gb * USABLE_FRACTION


def estimate(config_like, strategy: str, world_size: int = 1, *, seq_len: int = 1024, micro_batch_size: int = 1,
             activation_checkpointing: bool = False, lora_rank: int = 0, precision: BytesPerParam | str = "bf16",
             attention: str = "sdpa-packed", grad_accum: int = 1, tensor_parallel: int = 2) -> MemoryEstimate:
    """Peak memory of one device (for pp: of the fullest stage), broken down as in the module docstring.
    `precision`: the experiments' --dtype ("bf16", "fp32"), priced as each strategy's experiment keeps it
    (strategy_precision), or one BytesPerParam for every strategy. `grad_accum`: micro-batches per optimizer step
    whose gradients are accumulated before they are reduced (it only changes fsdp, see section 4).
    `tensor_parallel`: fsdp-tp's t (fsdp-tp-ft's --tp-degree) among the `world_size` ranks; ignored otherwise."""
    stages = estimate_stages(config_like, strategy, world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                             activation_checkpointing=activation_checkpointing, lora_rank=lora_rank,
                             precision=precision, attention=attention, grad_accum=grad_accum,
                             tensor_parallel=tensor_parallel)
    return max(stages, key=lambda stage: stage.total_bytes)


def estimate_stages(config_like, strategy: str, world_size: int = 1, *, seq_len: int = 1024,
                    micro_batch_size: int = 1, activation_checkpointing: bool = False, lora_rank: int = 0,
                    precision: BytesPerParam | str = "bf16", attention: str = "sdpa-packed",
                    grad_accum: int = 1, tensor_parallel: int = 2) -> list[MemoryEstimate]:
    """The estimate of every distinct device: one per pipeline stage for pp (stage k on rank k), else one for all."""
    if strategy not in STRATEGIES + MESH_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES + MESH_STRATEGIES)}")
    if strategy == "fsdp-tp" and (tensor_parallel < 1 or world_size % tensor_parallel):
        raise ValueError(f"fsdp-tp: the tensor-parallel degree {tensor_parallel} must divide the world size "
                         f"{world_size}")
    if strategy == "single" and world_size != 1:
        raise ValueError("single runs on one device")
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    shape = model_shape(config_like)
    if shape.is_moe and strategy not in MOE_STRATEGIES:
        raise ValueError(f"{shape.name} is a mixture of experts ({shape.experts} experts): single or ep "
                         f"(experiments/single-ft, experiments/ep-ft); {strategy}'s experiment trains dense models")
    if strategy == "ep" and not shape.is_moe:
        raise ValueError(f"ep splits the experts of a mixture of experts; {shape.name} is dense")
    if strategy == "ep" and shape.experts % world_size:
        raise ValueError(f"ep: {shape.experts} experts do not split evenly over {world_size} ranks")
    if shape.is_moe and lora_rank:
        shape.lora_parameters(lora_rank)  # raises: LoRA on a mixture of experts is not priced
    precision = resolve_precision(strategy, precision)
    return [_estimate_slice(shape, piece, strategy, world_size, micro_batch_size, seq_len, activation_checkpointing,
                            lora_rank, precision, attention, grad_accum)
            for piece in device_slices(shape, strategy, world_size, lora_rank, tensor_parallel)]


def uses_autocast(strategy: str, precision: BytesPerParam) -> bool:
    """Autocast runs wherever the kept weights are wider than the compute dtype, except under FSDP/ZeRO-3, whose
    mixed-precision policy hands each layer its weights already in the compute dtype. (DeepSpeed's bf16 mode keeps
    the module itself in bf16: weights as wide as the compute dtype, no autocast.)"""
    return precision.weights > precision.compute and strategy not in UNIT_SHARDED


def uses_bf16_optimizer(strategy: str, precision: BytesPerParam) -> bool:
    """DeepSpeed runs ZeRO-1 with low-precision weights and wider gradient accumulation (zero-ft --zero-stage 1
    --dtype bf16) through its BF16_Optimizer, not the ZeRO stage 1-2 optimizer (engine._do_optimizer_sanity_check)."""
    return strategy == "zero-1" and precision.weights < precision.grads


def _estimate_slice(shape: ModelShape, piece: DeviceSlice, strategy: str, world_size: int, micro_batch_size: int,
                    seq_len: int, activation_checkpointing: bool, lora_rank: int, precision: BytesPerParam,
                    attention: str, grad_accum: int) -> MemoryEstimate:
    # fsdp-tp: FSDP shards the tensor-parallel slice over the data-parallel ranks only, world / t of them.
    data_parallel = world_size // piece.tensor_parallel if strategy == "fsdp-tp" else world_size
    states = model_state_bytes(piece.trainable, piece.frozen, precision, strategy, data_parallel)
    c, tokens = precision.compute, micro_batch_size * seq_len
    autocast = uses_autocast(strategy, precision)

    compute_copy = 0.0
    if autocast:
        # Autocast caches the cast of each trainable weight until the forward ends, checkpointing or not. Frozen
        # (LoRA) weights are re-cast at each use and kept only by the autograd graph, which checkpointing drops
        # after each layer: one layer's copies (during its recomputation) and the LM head's remain.
        layers_copied = 1 if lora_rank and activation_checkpointing else piece.layers
        compute_copy = (layers_copied * piece.layer_matmul + piece.root_matmul) * c
        # ep-ft's own casts of its experts, kept by the grouped products until the layer's backward: with
        # checkpointing only the recomputed layer's.
        compute_copy += (min(1, piece.layers) if activation_checkpointing else piece.layers) \
            * piece.layer_experts_cast * c

    terms = layer_activation_terms(shape, compute_bytes=c, autocast=autocast, seq_len=seq_len, attention=attention,
                                   lora_rank=lora_rank, expert_parallel=strategy == "ep",
                                   weight_bytes=precision.weights)
    tp = piece.tensor_parallel
    layer_per_token = sum(value / tp if name in TENSOR_PARALLEL_TERMS or (piece.sequence_parallel and name != "mask")
                          else value for name, value in terms.items())
    in_flight_layers = piece.micro_batches_in_flight * piece.layers
    if activation_checkpointing:
        residual_bytes = FP32_BYTES if autocast else c
        checkpoint_per_token = residual_bytes * shape.hidden / (tp if piece.sequence_parallel else 1)
        per_token = in_flight_layers * checkpoint_per_token + layer_per_token  # + the layer being recomputed
    else:
        per_token = in_flight_layers * layer_per_token
    logits = 0.0
    if piece.computes_logits:
        per_token += outside_layers_bytes_per_token(shape, compute_bytes=c, autocast=autocast, lora_rank=lora_rank)
        logits = tokens * shape.vocab * piece.vocab_share * (c + CROSS_ENTROPY_FP32_BUFFERS * FP32_BYTES)

    buffers = cpu_buffers = 0.0
    if strategy == "ep":
        # The dispatch inside one expert block: sorted rows, received rows, their copy regrouped by expert.
        buffers += tokens * 3 * (FP32_BYTES if autocast else c) * shape.experts_per_token * shape.hidden
    # ddp: gradient_as_bucket_view=True makes the gradients views into the all-reduce buckets: no second copy.
    if uses_bf16_optimizer(strategy, precision):
        # BF16_Optimizer keeps the bf16 gradients autograd writes in the module beside its own fp32 ones
        # (immediate_grad_update is off by default), and all-reduces the fp32 gradients of each param group in
        # place, unless groups small enough to share one all-reduce bucket are flattened into a copy first.
        states["grads"] += piece.trainable * c
        matrices = piece.trainable - (piece.layers * shape.layer_norm_parameters + shape.hidden
                                      if not lora_rank else 0)  # decay group; the norms are the other one
        if matrices < piece.trainable and matrices <= DEEPSPEED_ALLREDUCE_BUCKET_ELEMENTS:
            buffers += piece.trainable * precision.grads
    elif strategy in DEEPSPEED_STRATEGIES:
        # The reduce bucket, allocated at its full reduce_bucket_size whatever the trainable count (in the module's
        # dtype for stages 1-2, in the fp32 communication dtype for stage 3), plus the fp32 tensor that the
        # collective reduces, flattened from one full bucket.
        bucket_bytes = FP32_BYTES if strategy in ZERO3_STRATEGIES else precision.weights
        buffers += DEEPSPEED_REDUCE_BUCKET_ELEMENTS * bucket_bytes \
            + min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, piece.trainable) * FP32_BYTES
        if strategy != "zero-1":
            # Stages 2-3 reduce each gradient as autograd writes it (in the compute dtype), one parameter at a time;
            # a tied embedding's gradient waits for both uses, so the largest one is alive for the whole backward.
            buffers += largest_trainable_parameter(shape, lora_rank) * c
        if strategy == "zero-2-offload":
            # A GPU staging buffer and a host one, each as large as the largest parameter, for the gradient copies;
            # a host copy of this rank's partition in the weights' dtype, for the updated weights on their way back.
            buffers += largest_trainable_parameter(shape, lora_rank) * precision.weights
            cpu_buffers = (largest_trainable_parameter(shape, lora_rank) + piece.trainable / world_size) \
                * precision.weights
    if strategy in ZERO3_STRATEGIES and world_size > 1:  # one rank's "gather" is a view of its partition
        buffers += zero3_gathered_elements(shape, lora_rank, activation_checkpointing) * precision.weights
        # Persistent parameters (too small to be worth releasing) stay gathered, whole, beside their partition.
        states["weights"] += zero3_persistent_parameters(shape, lora_rank) * precision.weights
    elif strategy in FSDP_STRATEGIES:
        layer = piece.layer_trainable + piece.layer_frozen
        gathered_weights = (piece.root_trainable + piece.root_frozen + min(2, piece.layers) * layer) * c
        # Each unit's gradients arrive in the compute dtype and are copied into a reduce-scatter input in the fp32
        # reduce dtype. The root's reduce-scatter waits for the embedding's gradient at the end of backward, so
        # its gradient (the LM head's part arrives first) is alive beside each layer's.
        reduce_scatter = c + FP32_BYTES
        if grad_accum > 1:
            # fsdp-ft reduce-scatters only in the last micro-batch: before it, every unit keeps its unsharded
            # gradients, upcast to the fp32 reduce dtype to accumulate across backwards.
            unsharded_grads = piece.trainable * FP32_BYTES + piece.layer_trainable * reduce_scatter
        else:
            unsharded_grads = max(piece.root_trainable * c + piece.layer_trainable * reduce_scatter,
                                  piece.root_trainable * reduce_scatter)
        buffers += gathered_weights + unsharded_grads

    cpu = 0.0
    if strategy in OFFLOADED_STATES:
        for state in OFFLOADED_STATES[strategy]:
            cpu += states[state]
            states[state] = 0.0
    return MemoryEstimate(
        strategy=strategy, world_size=world_size, precision=precision,
        activation_checkpointing=activation_checkpointing, lora_rank=lora_rank,
        weights_bytes=states["weights"], grads_bytes=states["grads"],
        optimizer_bytes=states["optimizer"], master_bytes=states["master"], compute_copy_bytes=compute_copy,
        activations_bytes=tokens * per_token, logits_bytes=logits, buffers_bytes=buffers,
        cpu_bytes=cpu + cpu_buffers, cpu_buffers_bytes=cpu_buffers, note=piece.label)


def attention_kind(attn_implementation: str, packing: bool) -> str:
    """The ATTENTION_KINDS entry for an experiment's attention implementation and --packing setting."""
    if attn_implementation.startswith("flash") or attn_implementation == "varlen":
        return "flash"  # no [seq x seq] mask; varlen's kernels keep flash's memory
    return "sdpa-packed" if packing else "sdpa"


def predict_peak_gib(config_like, strategy: str, world_size: int = 1, *, seq_len: int, micro_batch_size: int = 1,
                     activation_checkpointing: bool = False, lora_rank: int = 0, dtype: str = "bf16",
                     attention: str = "sdpa-packed", precision: BytesPerParam | None = None,
                     grad_accum: int = 1) -> float:
    """Predicted peak GiB of one device, for an experiment's summary.json (`predicted_peak_mem_gib`), next to the
    measured `torch.cuda.max_memory_reserved()`. `strategy` is one of STRATEGIES (zero-ft: f"zero-{stage}", with
    --cpu-offload f"zero-{stage}-offload"; fsdp-ft --cpu-offload: "fsdp-offload"); `dtype` is the experiment's
    --dtype, priced as strategy_precision says that strategy's experiment keeps it (zero-ft: DeepSpeed's layouts);
    `precision` overrides it where an engine keeps other dtypes (pp-ds-ft's DeepSpeed bf16: DEEPSPEED_BF16);
    `attention` is "sdpa" for --no-packing and "flash" for --attn flash; `grad_accum` is the number of
    micro-batches whose gradients stay unreduced until the last one (fsdp-ft: --grad-accum, or 1 with
    --reduce-every-micro-batch)."""
    return estimate(config_like, strategy, world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                    activation_checkpointing=activation_checkpointing, lora_rank=lora_rank,
                    precision=precision or dtype, attention=attention, grad_accum=grad_accum).total_gib


# ---------------------------------------------------------------------------------------------------------------
# Which strategy to try first
@dataclass(frozen=True)
class Recommendation:
    strategy: str | None  # None: nothing fits
    activation_checkpointing: bool
    lora_rank: int
    reason: str
    choice: MemoryEstimate | None
    estimates: list[MemoryEstimate]  # every strategy that applies to these GPUs, with the settings as given
    gpus: int
    gpu_mem_gb: float
    dtype: str | None = None  # the --dtype the estimates priced (None: a convention given for every strategy)
    grad_accum: int = 1

    @property
    def fitting(self) -> list[str]:
        return [e.strategy for e in self.estimates if e.fits(self.gpu_mem_gb)]

    def command(self) -> str:
        if self.strategy is None:
            return ""
        launcher = "python" if self.strategy == "single" else f"torchrun --nproc_per_node={self.gpus}"
        flags = " --activation-checkpointing" * self.activation_checkpointing
        flags += f" --lora-rank {self.lora_rank}" if self.lora_rank else ""
        flags += f" --grad-accum {self.grad_accum}" if self.grad_accum > 1 else ""
        flags += " --dtype fp32" if self.dtype == "fp32" else ""
        return f"uv run {launcher} {RUN_WITH[self.strategy]}{flags}"


WHY = {
    "single": "it fits on one GPU",
    "ddp": "a full replica fits on each GPU: DDP all-reduces only the gradients, the cheapest way to add GPUs "
           "for throughput",
    "zero-2": "ZeRO-2 shards gradients and AdamW state over the GPUs for the same traffic as DDP "
              "(a reduce-scatter plus an all-gather instead of an all-reduce)",
    "fsdp": "FSDP (ZeRO-3) also shards the weights and all-gathers one layer at a time, at 1.5x DDP's traffic",
    "tp-sp": "tensor + sequence parallelism splits every layer's weights and activations; it communicates inside "
             "every layer, so it wants fast links (NVLink, Infinity Fabric)",
    "tp": "tensor parallelism splits every layer's weights and most of its activations; it communicates inside "
          "every layer, so it wants fast links (NVLink, Infinity Fabric)",
    "pp": "pipeline parallelism splits the layers into stages and sends only hidden states between them, which "
          "suits PCIe links; the first stage keeps one micro-batch of activations per stage",
    "zero-2-offload": "ZeRO-Offload keeps the bf16 weights and the gradient buckets on the GPU and moves the fp32 "
                      "master weights, the gradient partitions and AdamW state to host memory, where AdamW runs on "
                      "the CPU: slower (every step sends the gradients to the host and the new weights back), but "
                      "the GPU holds 2 bytes per parameter of model states",
    "zero-3-offload": "ZeRO-3 with its optimizer offloaded keeps only its share of the bf16 weights and the "
                      "parameters being computed on the GPU; master weights, gradient partitions and AdamW state "
                      "live in host memory and AdamW runs on the CPU",
    "fsdp-offload": "CPU offload keeps weights, gradients and AdamW state in host memory (sharded across ranks) "
                    "and runs AdamW on the CPU: much slower, but only the layers being computed sit on the GPU",
    "ep": "expert parallelism gives each GPU the dense part (attention, routers, embedding, LM head) whole and an "
          "equal share of every layer's experts, and sends each token to its experts' GPU and back (two "
          "all-to-alls per layer in forward, two in backward); the dense gradients are all-reduced once per step",
}
# After every strategy that keeps its model states on the GPUs: the GPU keeps the whole bf16 model, then a 1/N share
# of it, then only the layers being computed.
OFFLOAD_LADDER = ("zero-2-offload", "zero-3-offload", "fsdp-offload")


def recommend(config_like, gpus: int, gpu_mem_gb: float, *, seq_len: int = 1024, micro_batch_size: int = 1,
              activation_checkpointing: bool = False, lora_rank: int = 0, precision: BytesPerParam | str = "bf16",
              attention: str = "sdpa-packed", interconnect: str = "pcie", grad_accum: int = 1) -> Recommendation:
    """The decision tree, first rung that fits wins:
    1. a replica fits one GPU: single (DDP with more GPUs, for throughput);
    2. its model states do not fit, but sharding gradients and AdamW state does: ZeRO-2, whose traffic is DDP's;
    3. activations do not fit: the same (DDP, then ZeRO-2) with activation checkpointing, which costs about a
       third more compute where ZeRO-2 cost no traffic, hence after it;
    4. still not: FSDP/ZeRO-3, then model parallelism, TP(+SP) first on fast links, PP first on PCIe (each
       without, then with checkpointing);
    5. nothing fits on the GPUs alone: CPU offload, ZeRO-Offload (zero-2-offload: the GPU keeps the whole bf16 model)
       before ZeRO-3 with its optimizer offloaded (a 1/N share) before FSDP's offload (only the layers being
       computed). Offload comes last because every step then runs AdamW on the CPU and moves gradients and weights
       over PCIe, several times slower than any strategy that keeps its states on the GPUs, and it needs about
       16-18 bytes per parameter of host memory;
    6. full SFT fits nowhere: LoRA (rank DEFAULT_LORA_RANK unless given), down the same ladder.
    `precision` is the --dtype ("bf16", "fp32"), each strategy priced as its experiment runs (strategy_precision),
    or one BytesPerParam for every strategy.
    """
    shape = model_shape(config_like)
    usable_gib = gpu_mem_gb * USABLE_FRACTION
    settings = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, precision=precision, attention=attention,
                    grad_accum=grad_accum)

    def attempt(strategy: str, checkpointing: bool, rank: int) -> MemoryEstimate | None:
        try:
            return estimate(shape, strategy, 1 if strategy == "single" else gpus, lora_rank=rank,
                            activation_checkpointing=checkpointing, **settings)
        except ValueError:  # e.g. heads that do not divide over the GPUs
            return None

    if shape.is_moe:  # section 7: single-ft on one GPU, ep-ft on several (the single row shown beside it)
        candidates = ("single",) if gpus == 1 else MOE_STRATEGIES
    else:
        candidates = ("single", *OFFLOAD_LADDER) if gpus == 1 else tuple(s for s in STRATEGIES[1:] if s != "ep")
    as_given = [e for e in (attempt(s, activation_checkpointing, lora_rank) for s in candidates) if e]
    model_parallel = ("tp-sp", "tp", "pp") if interconnect == "nvlink" else ("pp", "tp-sp", "tp")
    checkpointing_options = (True,) if activation_checkpointing else (False, True)
    replicas = ["single"] if gpus == 1 else ["ddp", "zero-2"]
    on_gpus = [(s, ac) for ac in checkpointing_options for s in replicas] + \
        [(s, ac) for s in ([] if gpus == 1 else ["fsdp", *model_parallel]) for ac in checkpointing_options]
    ladder = on_gpus + [(s, ac) for s in OFFLOAD_LADDER for ac in checkpointing_options]
    if shape.is_moe:
        # A mixture of experts: no sharding, model parallelism, offload or LoRA rung; its experiments are single-ft
        # and ep-ft, whose experts split over the GPUs (ep needs E to divide by them).
        ladder = on_gpus = [(s, ac) for ac in checkpointing_options for s in (["single"] if gpus == 1 else ["ep"])]
    dtype = precision if isinstance(precision, str) else None

    failures: list[MemoryEstimate] = []
    for rank in (lora_rank,) if lora_rank else (0, DEFAULT_LORA_RANK):
        for strategy, checkpointing in ladder:
            result = attempt(strategy, checkpointing, rank)
            if result is None:
                continue
            if not result.fits(gpu_mem_gb):
                failures.append(result)
                continue
            lora_alternative = None
            if strategy in OFFLOAD_LADDER and not rank:
                # Offloading full SFT is slow; LoRA on the GPUs alone is the usual way out, so name it too.
                lora_alternative = next((e for s, ac in on_gpus
                                         if (e := attempt(s, ac, DEFAULT_LORA_RANK)) and e.fits(gpu_mem_gb)), None)
            reason = _explain(result, failures, shape, usable_gib, lora_rank, activation_checkpointing,
                              lora_alternative)
            if strategy == "ep":
                reason = f"{_moe_split(shape, gpus, gpu_mem_gb, settings, checkpointing)}; {reason}"
            return Recommendation(strategy, checkpointing, rank, reason, result, as_given, gpus, gpu_mem_gb,
                                  dtype, grad_accum)
    if not failures:  # every rung refused these settings (a mixture of experts under LoRA, or E % gpus)
        reason = (f"no strategy takes these settings: a mixture of experts trains every parameter, in single-ft on "
                  f"one GPU or in ep-ft on a number of GPUs that divides its {shape.experts} experts"
                  if shape.is_moe else "no strategy takes these settings")
        return Recommendation(None, activation_checkpointing, lora_rank, reason, None, as_given, gpus, gpu_mem_gb,
                              dtype, grad_accum)
    smallest = min(failures, key=lambda e: e.total_bytes)
    reason = (f"nothing fits in {usable_gib:.1f} GiB per GPU; the smallest, {_label(smallest)}, needs "
              f"{smallest.total_gib:.1f} GiB: shorten --seq-len or --micro-batch-size, or add GPUs"
              + (" (ep-ft splits a mixture of experts' experts over them)" if shape.is_moe else ""))
    return Recommendation(None, activation_checkpointing, lora_rank, reason, None, as_given, gpus, gpu_mem_gb,
                          dtype, grad_accum)


def _moe_split(shape: ModelShape, gpus: int, gpu_mem_gb: float, settings: dict, checkpointing: bool) -> str:
    """Why a mixture of experts goes to ep-ft: what one GPU would need, and what each GPU holds instead."""
    single = estimate(shape, "single", activation_checkpointing=checkpointing, **settings)
    experts = shape.layers * shape.layer_expert_parameters
    verdict = "does not fit one GPU" if not single.fits(gpu_mem_gb) else "fits one GPU, and ep-ft adds throughput"
    return (f"the whole model ({shape.total_parameters / 1e9:.1f}B parameters, {experts / 1e9:.1f}B of them in "
            f"{shape.experts} experts per layer) {verdict} (single: {single.total_gib:.1f} GiB); ep-ft gives each "
            f"of the {gpus} GPUs {shape.experts // gpus} experts per layer and the "
            f"{(shape.total_parameters - experts) / 1e9:.2f}B dense parameters")


@dataclass
class NodeLayout:
    name: str
    estimate: MemoryEstimate | None  # None: the layout does not apply (heads that do not divide by the node's GPUs)
    flags: str  # the experiment and its flags
    why: str


def multi_node_layouts(config_like, nodes: int, gpus_per_node: int, **settings) -> list[NodeLayout]:
    """The decision map's rung for more than one node, in the order to try them; the first that fits wins:
    1. HSDP (fsdp-ft --replicate-degree <nodes>): FSDP over one node's G GPUs, replicated on every node. The per-layer
       all-gathers and reduce-scatters stay on a node's fast links; only the all-reduce of each rank's gradient shard
       (1/G of the model) crosses nodes, once per step. Its memory is fsdp's over G ranks.
    2. FSDP over all N x G GPUs: 1/(N G) of the model states per GPU, but every layer's all-gather and
       reduce-scatter crosses the nodes' link.
    3. FSDP x TP (fsdp-tp-ft --tp-degree G): a layer is split over the node's GPUs, so a layer too large for one GPU
       (its weights gathered, its activations) fits; TP's per-layer all-reduces stay in the node, FSDP's collectives
       cross nodes on G times fewer bytes.
    (Where one replica fits a GPU, ddp-ft is simpler still: its one all-reduce per step crosses the nodes too.)
    `settings`: estimate()'s keyword arguments."""
    world = nodes * gpus_per_node

    def attempt(strategy: str, world_size: int, **extra) -> MemoryEstimate | None:
        try:
            return estimate(config_like, strategy, world_size, **settings, **extra)
        except ValueError:
            return None

    if model_shape(config_like).is_moe:  # section 7: only ep-ft splits a mixture of experts
        return [NodeLayout("ep", attempt("ep", world), "experiments/ep-ft/train.py",
                           "experts split over every GPU, the dense part replicated: each layer's all-to-alls "
                           "cross nodes")]
    return [
        NodeLayout("hsdp", attempt("fsdp", gpus_per_node), f"experiments/fsdp-ft/train.py --replicate-degree {nodes}",
                   f"FSDP inside each node, {nodes} replicas: only one gradient all-reduce per step crosses nodes"),
        NodeLayout("fsdp", attempt("fsdp", world), "experiments/fsdp-ft/train.py",
                   "FSDP over every GPU: the least memory per GPU, every layer's collectives cross nodes"),
        NodeLayout("fsdp-tp", attempt("fsdp-tp", world, tensor_parallel=gpus_per_node),
                   f"experiments/fsdp-tp-ft/train.py --tp-degree {gpus_per_node}",
                   "TP inside each node, FSDP across: for layers too large for one GPU"),
    ]


def format_multi_node(layouts: list[NodeLayout], nodes: int, gpus_per_node: int, gpu_mem_gb: float) -> str:
    lines = [f"across {nodes} nodes x {gpus_per_node} GPUs (torchrun --nnodes={nodes} "
             f"--nproc-per-node={gpus_per_node}), GiB per GPU:"]
    for layout in layouts:
        size = "n/a" if layout.estimate is None else f"{layout.estimate.total_gib:.2f}"
        fits = "-" if layout.estimate is None else ("yes" if layout.estimate.fits(gpu_mem_gb) else "no")
        lines.append(f"  {layout.name:<8}{size:>8}  {fits:<4} {layout.why}")
    chosen = next((layout for layout in layouts if layout.estimate and layout.estimate.fits(gpu_mem_gb)), None)
    lines.append(f"on {nodes} nodes: {chosen.name}: uv run torchrun --nnodes={nodes} --nproc-per-node={gpus_per_node} "
                 f"--rdzv-backend=c10d --rdzv-endpoint=HOST:29500 {chosen.flags}" if chosen else
                 f"on {nodes} nodes: none of these fits; try --activation-checkpointing or --lora-rank")
    return "\n".join(lines)


def _label(e: MemoryEstimate) -> str:
    return (e.strategy + (" + activation checkpointing" if e.activation_checkpointing else "")
            + (f" + LoRA r{e.lora_rank}" if e.lora_rank else ""))


def _explain(choice: MemoryEstimate, failures: list[MemoryEstimate], shape: ModelShape, usable_gib: float,
             requested_rank: int, requested_checkpointing: bool, lora_alternative: MemoryEstimate | None) -> str:
    parts = []
    lora_fallback = choice.lora_rank and not requested_rank
    if failures:
        considered = [e for e in failures if not e.lora_rank] if lora_fallback else failures
        leanest = min(considered, key=lambda e: e.total_bytes)
        parts.append(f"{'full SFT fits nowhere: ' if lora_fallback else ''}the leanest option tried before, "
                     f"{_label(leanest)}, needs {leanest.total_gib:.2f} GiB per GPU of {usable_gib:.2f} usable")
    if lora_fallback:
        adapters = shape.lora_parameters(choice.lora_rank)
        parts.append(f"LoRA rank {choice.lora_rank} trains {adapters:,} parameters "
                     f"({adapters / shape.total_parameters:.2%}), so only the frozen weights remain a large state")
    parts.append(WHY[choice.strategy])
    if choice.activation_checkpointing and not requested_checkpointing:
        checkpointing = (f"with activation checkpointing, which keeps only each layer's input and recomputes the "
                         f"layer in backward (about a third more compute): {choice.activations_bytes / GIB:.1f} GiB "
                         f"of activations")
        if choice.model_states_bytes:
            checkpointing += f" beside {choice.model_states_bytes / GIB:.1f} GiB of model states"
        parts.append(checkpointing)
    if choice.cpu_bytes:
        parts.append(f"it needs {choice.cpu_bytes * choice.world_size / GIB:.1f} GiB of host memory in all")
    if lora_alternative:
        parts.append(f"faster, if training adapters instead of all weights is acceptable: {_label(lora_alternative)} "
                     f"({lora_alternative.total_gib:.1f} GiB per GPU)")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Command line
ZERO_PAPER_FIGURE1_GB = {"baseline": 120, "P_os": 31.4, "P_os+g": 16.6, "P_os+g+p": 1.9}  # as printed in the paper
COLUMNS = (("weights", "weights_bytes"), ("grads", "grads_bytes"), ("optim", "optimizer_bytes"),
           ("master", "master_bytes"), ("copies", "compute_copy_bytes"), ("activ", "activations_bytes"),
           ("logits", "logits_bytes"), ("buffers", "buffers_bytes"))


def format_zero_paper() -> str:
    lines = [f"ZeRO (Rajbhandari et al. 2020), Figure 1: Psi = 7.5B parameters, N_d = 64 devices, "
             f"K = {ZERO_PAPER.zero_k}, model states per device in GB (1e9 bytes)",
             f"{'stage':<10} {'formula':<28} {'computed':>9} {'paper':>6}"]
    for stage, formula, gb in zero_paper_figure1():
        lines.append(f"{stage:<10} {formula:<28} {gb:>9.3f} {ZERO_PAPER_FIGURE1_GB[stage]:>6}")
    return "\n".join(lines)


def format_table(estimates: list[MemoryEstimate], gpu_mem_gb: float) -> str:
    header = f"{'strategy':<14}" + "".join(f"{title:>8}" for title, _ in COLUMNS) + f"{'total':>8}  fits  note"
    lines = [header]
    for e in estimates:
        cells = "".join(f"{getattr(e, field) / GIB:>8.2f}" for _, field in COLUMNS)
        note = ", ".join(filter(None, [e.note, f"+ {e.cpu_bytes / GIB:.1f} GiB in CPU memory per rank"
                                       if e.cpu_bytes else ""]))
        fits = "yes" if e.fits(gpu_mem_gb) else "no"
        lines.append(f"{e.strategy:<14}{cells}{e.total_gib:>8.2f}  {fits:<4}  {note}".rstrip())
    return "\n".join(lines)


def describe_precisions(strategies: list[str], precision: BytesPerParam | str) -> str:
    """Which bytes per parameter the rows use: one convention, or each strategy's experiment under --dtype."""
    if not isinstance(precision, str):
        return (f"precision {precision.name} for every strategy: {precision.description} = {precision.trainable} "
                f"bytes per trainable parameter")
    groups: dict[BytesPerParam, list[str]] = {}
    for strategy in strategies:
        groups.setdefault(strategy_precision(strategy, precision), []).append(strategy)
    return f"bytes per trainable parameter under --dtype {precision}, as each experiment keeps them:\n" + "\n".join(
        f"  {layout.name}: {layout.description} = {layout.trainable} ({', '.join(members)})"
        for layout, members in groups.items())


def describe_activations(shape: ModelShape, precision: BytesPerParam, tokens: int, seq_len: int, attention: str,
                         lora_rank: int) -> str:
    """The per-layer activation terms for the single/ddp regime, in bytes per token and in MiB per micro-batch."""
    autocast = uses_autocast("single", precision)
    terms = layer_activation_terms(shape, compute_bytes=precision.compute, autocast=autocast, seq_len=seq_len,
                                   attention=attention, lora_rank=lora_rank, weight_bytes=precision.weights)
    total = sum(terms.values())
    listed = " + ".join(f"{name.replace('_', ' ')} {value:,.0f}" for name, value in terms.items() if value)
    checkpoint = (FP32_BYTES if autocast else precision.compute) * shape.hidden
    regime = "single" if shape.is_moe else "single/ddp"
    return (f"activations per layer of {regime} ({'autocast' if autocast else 'no autocast'}, {attention}): "
            f"{listed} = {total:,.0f} bytes/token -> {total * tokens / 2**20:.1f} MiB per layer per micro-batch; "
            f"checkpointed: {checkpoint:,} bytes/token (the layer's input)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m common.memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="preset, hub id or local folder (or give the raw counts below)")
    for flag in ("layers", "hidden", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        parser.add_argument(f"--{flag}", type=int, help="raw geometry, instead of --model")
    parser.add_argument("--untied", action="store_true", help="raw geometry: the LM head is not the embedding")
    for flag in ("experts", "experts-per-token", "expert-intermediate"):
        parser.add_argument(f"--{flag}", type=int, default=0, help="raw geometry of a mixture of experts")
    parser.add_argument("--parameters", type=float, help="raw geometry: a stated total parameter count")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs available")
    parser.add_argument("--gpu-mem-gb", type=float, default=24, help="memory of one GPU, as its maker states it")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step (fsdp-ft keeps their gradients unsharded until the "
                             "last)")
    parser.add_argument("--strategy", choices=STRATEGIES, help="show only this strategy")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="the experiments' --dtype; each strategy is priced as its experiment keeps it (zero-ft: "
                             "DeepSpeed's own bf16 or fp32 layout; the others: fp32 weights, autocast or FSDP2 casts)")
    parser.add_argument("--precision", choices=PRECISIONS,
                        help="instead of --dtype, one bytes-per-parameter convention for every strategy (e.g. "
                             "zero-paper, bf16-rule-of-thumb)")
    parser.add_argument("--attention", choices=ATTENTION_KINDS, default="sdpa-packed",
                        help="sdpa-packed: the experiments' default (packed rows through SDPA); sdpa: unpacked "
                             "rows; flash: flash_attention_2")
    parser.add_argument("--interconnect", choices=("pcie", "nvlink"), default="pcie",
                        help="links between the GPUs: decides TP before PP (nvlink) or PP before TP (pcie)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes the --gpus are spread over (evenly): also print the multi-node layouts (HSDP, "
                             "FSDP over all, FSDP x TP) and which to take")
    parser.add_argument("--zero-paper", action="store_true", help="print the ZeRO paper's Figure 1 and exit")
    args = parser.parse_args(argv)

    if args.zero_paper:
        print(format_zero_paper())
        return
    if args.model:
        name, note = preset_for(args.model)  # a Qwen3 hub id priced with its preset's (published) geometry
        if note:
            print(note)
        shape = model_shape(name)
    else:
        geometry = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                        head_dim=args.head_dim, intermediate=args.intermediate, vocab=args.vocab)
        missing = [name for name, value in geometry.items() if value is None]
        if missing:
            flags = ", ".join("--" + name.replace("_", "-") for name in missing)
            parser.error(f"give --model, or all of the raw counts (missing: {flags})")
        shape = ModelShape(name="custom", tied_embeddings=not args.untied,
                           parameters=int(args.parameters) if args.parameters else None, experts=args.experts,
                           experts_per_token=args.experts_per_token, expert_intermediate=args.expert_intermediate,
                           **geometry)
    if shape.is_moe and args.lora_rank:
        parser.error(f"{shape.name} is a mixture of experts: LoRA on its experts is not priced (full SFT only)")
    precision = PRECISIONS[args.precision] if args.precision else args.dtype
    advice = recommend(shape, args.gpus, args.gpu_mem_gb, seq_len=args.seq_len,
                       micro_batch_size=args.micro_batch_size, activation_checkpointing=args.activation_checkpointing,
                       lora_rank=args.lora_rank, precision=precision, attention=args.attention,
                       interconnect=args.interconnect, grad_accum=args.grad_accum)
    shown = [e for e in advice.estimates if args.strategy in (None, e.strategy)]
    if args.strategy and not shown:  # single on several GPUs, or a layout these GPUs cannot take
        world = 1 if args.strategy == "single" else args.gpus
        try:
            shown = [estimate(shape, args.strategy, world, seq_len=args.seq_len,
                              micro_batch_size=args.micro_batch_size, lora_rank=args.lora_rank,
                              activation_checkpointing=args.activation_checkpointing, precision=precision,
                              attention=args.attention, grad_accum=args.grad_accum)]
        except ValueError as error:
            parser.error(str(error))
    trainable = shape.lora_parameters(args.lora_rank) if args.lora_rank else shape.total_parameters
    mlp = (f"{shape.experts} experts x {shape.expert_intermediate} ({shape.experts_per_token} per token, "
           f"{shape.layers * shape.layer_expert_parameters:,} expert parameters)" if shape.is_moe
           else f"MLP {shape.intermediate}")
    print(f"model {shape.name}: {shape.total_parameters:,} parameters, {trainable:,} trainable | {shape.layers} "
          f"layers, hidden {shape.hidden}, {shape.heads}/{shape.kv_heads} heads x {shape.head_dim}, {mlp}, "
          f"vocab {shape.vocab:,}{'' if shape.tied_embeddings else ', untied LM head'}")
    print(describe_precisions([e.strategy for e in shown], precision))
    print(f"micro-batch {args.micro_batch_size} x {args.seq_len} tokens x {args.grad_accum} accumulated | activation "
          f"checkpointing {'on' if args.activation_checkpointing else 'off'}")
    print(describe_activations(shape, resolve_precision("single", precision), args.micro_batch_size * args.seq_len,
                               args.seq_len, args.attention, args.lora_rank))
    print(f"\nGiB per device on {args.gpus} x {args.gpu_mem_gb:g} GB ({args.gpu_mem_gb * USABLE_FRACTION:.1f} GiB "
          f"usable); copies = autocast's bf16 weight copies, buffers = reduce buckets, ep's dispatch, gathered "
          f"FSDP/ZeRO-3 parameters and unsharded gradients")
    print(format_table(shown, args.gpu_mem_gb))
    print()
    if advice.strategy is None:
        print(f"recommendation: none. {advice.reason}")
    else:
        print(f"recommendation: {_label(advice.choice)}. {advice.reason[0].upper()}{advice.reason[1:]}.")
        print(f"run: {advice.command()}")
    if args.nodes > 1:
        if args.gpus % args.nodes:
            parser.error(f"--gpus {args.gpus} must divide evenly over --nodes {args.nodes}")
        layouts = multi_node_layouts(shape, args.nodes, args.gpus // args.nodes, seq_len=args.seq_len,
                                     micro_batch_size=args.micro_batch_size, lora_rank=args.lora_rank,
                                     activation_checkpointing=args.activation_checkpointing, precision=precision,
                                     attention=args.attention, grad_accum=args.grad_accum)
        print()
        print(format_multi_node(layouts, args.nodes, args.gpus // args.nodes, args.gpu_mem_gb))


if __name__ == "__main__":
    main()
