"""Memory per device for fine-tuning a Qwen3 decoder under each strategy, and which strategy to try first.

    uv run python -m common.memory --model qwen3-4b --gpus 2 --gpu RTX-4090
    uv run python -m common.memory --model qwen3-4b --gpus 1 --gpu-mem-gib 24 --lora-rank 16
    uv run python -m common.memory --zero-paper          # reproduce Figure 1 of the ZeRO paper

The model, in the order a reader needs it (each file's docstring derives its part):
- states.py, the byte model: bytes per parameter of each experiment (`BytesPerParam`: fp32 master weights, a bf16
  LoRA base, DeepSpeed's layouts, QLoRA's 4-bit weights), the model's geometry (`ModelShape`), the model states of
  one device under each sharding, and what DeepSpeed's ZeRO-3 keeps gathered.
- activations.py: what one decoder layer keeps for backward, per token, term by term (eager and compiled), and
  the loss's buffers (full logits, or one chunk of them).
- estimate.py: one device's share under a strategy, its buffers, and the peak: the larger of the start of backward
  and the optimizer step (`estimate`); for a recorded run, from its summary.json: `predict_run` (the peak) and
  `predict_state_bytes` (the model states of every rank), which no training run calls.
- recommend.py: the decision tree and the command that runs what it priced; the multi-node layouts.
- cli.py: `python -m common.memory`.
"""

from common.memory.activations import ATTENTION_KINDS, CROSS_ENTROPY_FP32_BUFFERS, TENSOR_PARALLEL_TERMS, \
    attention_kind, layer_activation_terms, loss_bytes, outside_layers_bytes_per_token
from common.memory.cli import GPU_MEMORY_GIB, AnswerError, Asked, ask, build_parser, describe_activations, \
    describe_precisions, format_table, format_zero_paper, main
from common.memory.estimate import EXPERIMENT_STRATEGY, DeviceSlice, MemoryEstimate, PeakCheck, device_slices, \
    error_band, estimate, estimate_stages, estimate_stages_per_rank, gpu_peak_checks, predict_run, \
    predict_state_bytes, run_model, uses_autocast, uses_bf16_optimizer
from common.memory.recommend import DEFAULT_LORA_RANK, DEFAULT_ROWS_PER_GPU, FAST_FLAGS, LORA_FUSED, LOSS_CHUNK_TOKENS, \
    OFFLOAD_LADDER, RUN_WITH, WHY, Ladder, NodeLayout, Recommendation, Rung, format_multi_node, \
    multi_node_layouts, recommend
from common.memory.states import BF16_RULE_OF_THUMB, DATA_PARALLEL_SHARDING, DEEPSPEED_ALLREDUCE_BUCKET_ELEMENTS, \
    DEEPSPEED_BF16, DEEPSPEED_FP32, DEEPSPEED_MAX_LIVE_PARAMETERS, DEEPSPEED_MAX_REUSE_DISTANCE, \
    DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD, DEEPSPEED_PREFETCH_BUCKET_ELEMENTS, DEEPSPEED_REDUCE_BUCKET_ELEMENTS, \
    DEEPSPEED_STRATEGIES, DTYPES, ERROR_BAND, ERROR_BAND_FLOOR, FP32_BYTES, FSDP_STRATEGIES, GB, GIB, \
    LORA_PROJECTIONS, MESH_STRATEGIES, MOE_STRATEGIES, NF4_BYTES_PER_WEIGHT, OFFLOADED_STATES, PEAK_TESTED_FROM_GIB, \
    MASTER_BF16, PRECISIONS, PROJECT_BF16, PROJECT_FP32, QLORA, \
    QLORA_STRATEGIES, STRATEGIES, UNIT_SHARDED, USABLE_FRACTION, ZERO3_STRATEGIES, ZERO_PAPER, BytesPerParam, \
    ModelShape, largest_trainable_parameter, leaf_modules, model_shape, model_state_bytes, resolve_precision, \
    strategy_precision, zero3_gathered_elements, zero3_persistent_parameters, zero_paper_figure1
