"""zero-ft: fine-tune a Qwen3 decoder with DeepSpeed ZeRO (stage 1, 2 or 3) over data-parallel ranks.

    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 2         # 2 GPUs (or 2 CPU processes)
    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 3 --model Qwen/Qwen3-1.7B-Base
    uv run python experiments/zero-ft/train.py --zero-stage 3                               # one process (a world of 1)
    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 3 --steps 5 --seq-len 128  # CPU smoke
    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 2 --loss-chunk-tokens 1024 --compile

ZeRO keeps data parallelism (every rank runs the whole model on its own rows) but stops replicating the training
state: stage 1 shards the optimizer state (AdamW's two moments, and in bf16 the fp32 master weights) over the ranks,
stage 2 also the gradients (each rank receives only the sum of its own slice), stage 3 also the parameters (each
layer is all-gathered just before its forward and backward, then freed). The printed `peak memory per rank` line and
`peak_mem_gib_per_rank` in summary.json put the stages side by side with fsdp-ft.

One optimizer step consumes B = micro_batch_size x grad_accum x world_size packed rows (common/data.py) and is the
same computation as single-ft on that B: the loss is token-weighted over all ranks and micro-batches, and DeepSpeed's
own loss/gradient scaling is undone (see the training loop). tests/test_zero_ft.py holds every stage to single-ft.

Strategy flags: --zero-stage, --cpu-offload. --compile is refused at stage 3 (README.md says why).
"""

from __future__ import annotations

import json
import logging
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from common.cli import parse_config, plan_run, resolve_paths, run, stop_early

stop_early(__name__, __file__)  # --help and a flag mistake answer now, before torch and transformers load
import torch  # noqa: E402
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

# DeepSpeed picks its "accelerator" when it is imported; without a CUDA/ROCm GPU, name the CPU one instead of letting it
# probe (and warn). Must happen before `import deepspeed`.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

from common.attention import setup_attention  # noqa: E402
from common.checkpoint import load_deepspeed_checkpoint, save_deepspeed_checkpoint  # noqa: E402
from common.data import DataError, build_data, describe, evaluate, sample_text, token_loss_sum  # noqa: E402
from common.comm import as_backend, zero_collectives  # noqa: E402
from common.dist import act_as_launcher_if_alone, all_ranks, init_distributed, print0, \
    record_collectives_in, teardown  # noqa: E402
from common.generate import generate, sample_prompt  # noqa: E402
from common.loss import fused_linear_cross_entropy  # noqa: E402
from common.memory import STRATEGIES, attention_kind, estimate  # noqa: E402
from common.metrics import CollectiveTimer, MetricsLogger, Stopwatch, git_commit, hardware_info, launch_command, \
    memory_label, peak_memory_gib, state_bytes, storage_bytes, summary_table  # noqa: E402
from common.models import add_lora, count_parameters, flops_per_token, is_preset, load_model, load_tokenizer, \
    record_adapter_base, resolve_model_name  # noqa: E402

EXPERIMENT = "zero-ft"
SCRIPT_DIR = Path(__file__).resolve().parent  # a copy of this script runs from any folder (README)
deepspeed.utils.logger.setLevel(logging.WARNING)  # DeepSpeed logs every engine detail at INFO: keep the step lines


@dataclass
class Config:
    model: str = "auto"  # preset (README), hub id or folder; auto: Qwen/Qwen3-0.6B-Base on GPU, qwen3-tiny on CPU
    data: str = "assets/data/sft_en.jsonl"  # JSONL/JSON/parquet/CSV/arrow file or folder, save_to_disk folder or hub id
    data_split: str = "train"  # with a hub id or a saved DatasetDict: the split to train on
    data_config: str | None = None  # with a hub id: the dataset's configuration (subset)
    data_columns: str | None = None  # your column names for the expected ones, e.g. prompt=question,completion=answer
    train_empty_think: bool = False  # also train the empty <think></think> block Qwen3 puts before a plain answer
    show_sample: bool = False  # before training, print the first conversation with the text that carries loss marked
    seq_len: int | None = None  # tokens per packed row; default 256 for qwen3-tiny, 1024 otherwise
    micro_batch_size: int = 1  # rows per forward pass per rank
    grad_accum: int = 1  # micro-batches per optimizer step per rank
    steps: int = 300  # optimizer steps (0 = only evaluate / export); 300: a minute or two of qwen3-tiny on 2 CPU cores
    epochs: float | None = None  # instead of --steps: passes over the training rows (e.g. 2, 0.5), rounded up to steps
    lr: float | None = None  # peak learning rate; default 1e-3 for presets, 2e-5 for pretrained models (1e-4 with LoRA)
    warmup_steps: int = 10  # linear warm-up steps, then cosine decay to 0 at the last step
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices (not on norms)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = no clipping; the norm is still logged)
    seed: int = 0  # one seed for init, data order and held-out split
    dtype: Literal["bf16", "fp32"] | None = None  # bf16: bf16 weights, fp32 master weights (GPU default); fp32 (CPU)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward instead of storing activations
    loss_chunk_tokens: int = 0  # N > 0: the LM head and loss on loss tokens only, N at a time (common/loss.py)
    compile: bool = False  # torch.compile each decoder layer (GPU speed; on CPU it only costs compile time); ZeRO
        # stages 1 and 2 only (README)
    packing: bool = True  # pack conversations into rows (--no-packing: one padded conversation per row)
    lora_rank: int = 0  # 0 = full-parameter SFT; N = LoRA of rank N on every linear projection of the decoder layers
    lora_alpha: float | None = None  # LoRA scaling numerator; default 2 x rank
    merge_lora: bool = False  # with --save-hf and LoRA: write the merged full model instead of the adapter
    attn: Literal["auto", "sdpa", "eager", "flash", "varlen", "flex"] = "auto"  # attention kernel (common/attention.py)
    eval_fraction: float = 0.05  # share of conversations held out for the evaluation loss
    eval_every: int = 0  # also evaluate every N steps (0 = only at the end)
    log_every: int = 1  # print every N-th step line (the first and the last always); metrics.jsonl keeps every step
    sample_every: int = 0  # every N steps print a short greedy completion of a fixed held-out prompt (0 = never)
    timing_warmup_steps: int = 2  # first steps left out of summary.json's averages (allocator, caches, compilation)
    comm_profile_steps: int = 3  # steps profiled with torch.profiler for comm_ms (starting after the timing warm-up)
    out_dir: str | None = None  # default runs/zero-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never); DeepSpeed's sharded
        # format
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    zero_stage: int = 2  # ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters
    cpu_offload: bool = False  # ZeRO-Offload: keep the fp32 master partition and AdamW state in host memory and run the
        # update on the CPU (offload_optimizer: cpu); slower, for models whose optimizer state does not fit the GPUs


def resolve(config: Config) -> Config:
    """Fill the defaults that depend on the machine or the model; every other default lives in Config."""
    config.model, notice = resolve_model_name(config.model)
    if notice:
        print0(notice)
    if config.seq_len is None:
        config.seq_len = 256 if config.model == "qwen3-tiny" else 1024
    if config.dtype is None:
        config.dtype = "bf16" if torch.cuda.is_available() else "fp32"
    if config.lr is None:
        config.lr = 1e-3 if is_preset(config.model) else (1e-4 if config.lora_rank else 2e-5)
    if config.lora_alpha is None:
        config.lora_alpha = 2.0 * config.lora_rank
    resolve_paths(config, EXPERIMENT)  # --data found, --out-dir under the working directory, --resume
    if config.zero_stage not in (1, 2, 3):
        raise SystemExit(f"--zero-stage must be 1, 2 or 3, got {config.zero_stage} (stage 0 is plain DDP: see ddp-ft)")
    if config.compile and config.zero_stage == 3:
        raise SystemExit("--compile needs --zero-stage 1 or 2: ZeRO-3 gathers each projection's weight in hooks "
                         "that torch.compile must leave out of its graphs, so a compiled decoder layer falls apart "
                         "into small graphs between the gathers instead of one (see README.md)")
    return config


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up to the peak over `warmup_steps`, then cosine decay to 0 at the last step."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def deepspeed_config(config: Config, world_size: int) -> dict:
    """The DeepSpeed config. Every key that changes the numbers is written out, defaults included, so that nothing
    silently differs from single-ft; the rest (bucket sizes, prefetching, overlap) only moves time and memory."""
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum,
        "train_batch_size": config.micro_batch_size * config.grad_accum * world_size,
        # ZeRO-Offload (--cpu-offload): the fp32 master partition, its gradient and AdamW's state in host memory, the
        # update on the CPU. Pinned host memory speeds up the copies to and from a GPU; there is none to pin for on
        # a CPU-only machine.
        "zero_optimization": {"stage": config.zero_stage, **({"offload_optimizer": {
            "device": "cpu", "pin_memory": torch.cuda.is_available()}} if config.cpu_offload else {})},
        # With offload DeepSpeed insists on its own DeepSpeedCPUAdam unless told otherwise. Its C++ kernel (a build
        # step, and another order of operations) computes AdamW too, but not single-ft's arithmetic; torch's AdamW
        # on the host partition keeps the parity with single-ft, at the price of a slower update.
        "zero_force_ds_cpu_optimizer": False,
        # Clipping happens inside engine.step(), on the sharded gradients. DeepSpeed clips at 1.0 unless told
        # otherwise, whatever --max-grad-norm says; 0 turns it off (the norm is computed and logged either way).
        "gradient_clipping": config.max_grad_norm,
        # bf16: the module's weights and activations are bf16 and the optimizer keeps the fp32 master weights and
        # AdamW state (common.memory.DEEPSPEED_BF16). Unlike single-ft's autocast, every op, norms included, sees bf16
        # weights, so bf16 runs track single-ft to about 1%, as bf16 always does.
        "bf16": {"enabled": config.dtype == "bf16"},
        # fp16 off = no loss scaling at all (a static scale of 1.0); neither fp32 nor bf16 needs one.
        "fp16": {"enabled": False},
        # With bf16 DeepSpeed would accumulate micro-batch gradients and reduce them across ranks in bf16; single-ft
        # accumulates in fp32, so do both in fp32 (fp32 is already what happens in an fp32 run).
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        # The gradient reduction averages over ranks ("mean", the only op ZeRO-3 supports) with no pre-division and
        # no rescaling; the training loop cancels that mean exactly (see there).
        "gradient_allreduce_op": "mean",
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        # DeepSpeed only "tests" its own optimizers with ZeRO; torch.optim.AdamW is the optimizer single-ft uses, and
        # ZeRO hands it the flat fp32 shards, on which its element-wise update is the same arithmetic.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # we print our own step line
        "wall_clock_breakdown": False,
    }


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's real shape, also once ZeRO-3 has partitioned it (the module then holds an empty placeholder)."""
    return getattr(param, "ds_shape", param.shape)


def deepspeed_state_bytes(engine) -> dict[str, int]:
    """The model-state bytes this rank holds inside DeepSpeed after a step's last backward, before its update, in
    common.metrics.state_bytes' kinds (each storage counted once) plus `buffers`. Where each kind lives then:
    - weights: what the module holds. Stages 1 and 2: every parameter whole, as views of one flat buffer per
      parameter group (plus frozen parameters as they are). Stage 3: each parameter's partition (`ds_tensor`, views
      of one flat buffer), and whole copies of the "persistent" parameters (at most
      stage3_param_persistence_threshold elements), which stay gathered on every rank; the others are empty
      placeholders between uses.
    - grads: the reduced gradients DeepSpeed keeps for this rank. Stages 1 and 2: `averaged_gradients`, views of one
      buffer holding the whole gradient of every parameter that overlaps the rank's partition (stage 1 too: it
      accumulated full gradients in param.grad until this last backward, then reduced and released them); with
      --cpu-offload the fp32 partition's .grad in host memory. Stage 3: one flat buffer of every gradient's
      partition. Any param.grad still held is counted too. Stage 1 with bf16 weights is another optimizer
      (DeepSpeed picks its BF16_Optimizer for fp32 gradient accumulation): it keeps the whole fp32 gradient, one flat
      buffer per parameter group.
    - master: DeepSpeed's fp32 partition of the weights, which AdamW updates and the module's weights are copied
      from: a separate copy even in an fp32 run (host memory with --cpu-offload).
    - optimizer: the torch optimizer's state on that partition (AdamW's moments and step counters).
    - buffers: the gradient-reduction bucket (reduce_bucket_size elements) where one is allocated at this point:
      stage 3 keeps one for the whole run; stages 1 and 2 allocate theirs at each backward and have released it.
    """
    zero = engine.optimizer
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        weights = params + [p.ds_tensor for p in params]
        master = list(zero.fp32_partitioned_groups_flat)
        grads = [zero.grad_partitions_flat_buffer]
    elif isinstance(zero, BF16_Optimizer):
        weights = params
        master = list(zero.fp32_groups_flat_partition)
        grads = list(zero.fp32_groups_gradients_flat)
    else:
        weights = params
        master = list(zero.single_partition_of_fp32_groups)
        grads = [g for group in zero.averaged_gradients.values() if group is not None for g in group]
    grads += [p.grad for p in params] + [p.grad for p in master]
    buffers = [buffer for bucket in getattr(zero, "ipg_buckets", {}).values()
               for buffer in (bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer])]
    return dict(weights=storage_bytes(weights), grads=storage_bytes(grads),
                optimizer=state_bytes((), zero.optimizer)["optimizer"], master=storage_bytes(master),
                buffers=storage_bytes(buffers))



def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts

    # ---------------------------------------------------------------------------------------------------------
    # Processes and devices: one per GPU (or CPU process) under torchrun. DeepSpeed needs a process group and the
    # launcher's variables even for one process, so a plain `python train.py` plays a launcher with a world of one.
    act_as_launcher_if_alone()
    dist_info = init_distributed(config.collective_timeout_s)
    # On the CPU accelerator DeepSpeed's communication layer would first build, with g++, a shared-memory all-reduce op
    # (about a minute on 2 cores, once per machine) that only its inference tensor parallelism calls
    # (inference_all_reduce); training's collectives are gloo's either way. Marked unavailable, it is not built.
    if dist_info.device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed's communication layer wraps the group just created (zero.Init, used before the engine exists, needs it).
    deepspeed.init_distributed(dist_backend=dist_info.backend)
    device, rank, world_size = dist_info.device, dist_info.rank, dist_info.world_size
    config = resolve(config)
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)
    # No autocast: with bf16, DeepSpeed itself holds the module in bf16 (and the fp32 master copy in the optimizer).
    autocast = nullcontext

    # ---------------------------------------------------------------------------------------------------------
    # Data: every rank builds the same rows; rank r takes its own slice of each step's B rows.
    tokenizer = load_tokenizer(config.model)
    try:
        data = build_data(config.data, tokenizer, config.seq_len, packing=config.packing,
                          eval_fraction=config.eval_fraction, seed=config.seed, split=config.data_split,
                          subset=config.data_config, columns=config.data_columns,
                          train_empty_think=config.train_empty_think)
    except DataError as error:
        raise SystemExit(f"bad training data: {error}") from None
    print0(describe(data.stats, config.seq_len, config.packing))
    if config.show_sample:
        print0(sample_text(data, tokenizer))
    rows_per_step = config.micro_batch_size * config.grad_accum * world_size
    plan = plan_run(EXPERIMENT, config, data.stats, rows_per_step, print_fn=print0)  # --epochs; --resume checked
    if config.show_sample and config.steps == 0:  # --show-sample --steps 0: look at the data, then stop
        teardown()
        return {}

    # ---------------------------------------------------------------------------------------------------------
    # Model. Stages 1 and 2 keep the whole model on every rank: it is built as in single-ft. Stage 3 must never hold
    # it whole on a device (that is the point of sharding the parameters):
    # - a checkpoint (hub id, local folder) is loaded inside deepspeed.zero.Init, switched on by a live
    #   HfDeepSpeedConfig: transformers partitions each layer as soon as it is created, then fills in its shard.
    # - a preset is random-init, and zero.Init would draw its random numbers in another order than single-ft; so it is
    #   built whole in host memory from the same seed and partitioned onto the devices below, one tensor at a time.
    ds_config = deepspeed_config(config, world_size)
    zero3_checkpoint = config.zero_stage == 3 and not is_preset(config.model)
    zero3_preset = config.zero_stage == 3 and is_preset(config.model)
    hf_deepspeed_config = HfDeepSpeedConfig(ds_config) if zero3_checkpoint else None  # must stay alive while loading
    model = load_model(config.model, tokenizer, attention.impl, dtype=torch.float32,
                       device="cpu" if zero3_preset else device)
    if config.activation_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and is the variant PyTorch recommends.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if config.lora_rank:
        model = add_lora(model, config.lora_rank, config.lora_alpha)  # DeepSpeed's bf16 mode casts the module to bf16
    if config.compile:
        # One compiled graph per decoder layer, not one for the whole model (as torchtitan does): compile time stays
        # bounded, and a graph break stays inside its layer. Module.compile() compiles in place, so parameter names
        # (checkpoints, --save-hf) do not change. Stages 1 and 2 put no hook inside a layer (their gradient hooks
        # are on the parameters' accumulators, outside the graph): one graph per layer, as in single-ft.
        for layer in model.get_decoder().layers:
            layer.compile()
    if config.zero_stage == 3 and config.dtype == "bf16":
        # For stages 1 and 2 the engine casts the parameters to bf16 (buffers such as RoPE's stay fp32); under ZeRO-3
        # it expects them in bf16 already, as zero.Init builds them. So cast what zero.Init did not build: a preset,
        # peft's adapters (ZeRO-3 parameters carry a ds_id).
        for param in model.parameters():
            if not hasattr(param, "ds_id"):
                param.data = param.data.to(torch.bfloat16)
    if zero3_preset:
        deepspeed.zero.Init(module=model, config_dict_or_path=ds_config)  # moves and partitions one tensor at a time
        model.to(device)  # what is left to move: buffers (RoPE's inv_freq); the parameters are shards there already
    model.train()
    n_params = count_parameters(model.config)["total"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(full_shape(p).numel() for p in trainable)
    model_flops_per_token = flops_per_token(model.config, config.seq_len, config.lora_rank)
    print0(f"model: {config.model} | {n_params:,} parameters, {n_trainable:,} trainable | "
           f"{model_flops_per_token / 1e9:.3f} GFLOP/token (training) | dtype {config.dtype} | ZeRO stage "
           f"{config.zero_stage} over {world_size} rank(s)")
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} x {world_size} ranks = {rows_per_step} rows of "
           f"{config.seq_len} -> T_eff = {rows_per_step * config.seq_len:,} token slots per optimizer step")

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: single-ft's AdamW and schedule, handed to DeepSpeed. ZeRO replaces each param group's parameters by
    # this rank's flat fp32 shard, so every rank's AdamW only updates (and only holds state for) its 1/world_size.
    # DeepSpeed's own Adam (FusedAdam on GPU, DeepSpeedCPUAdam on CPU) computes the same update with its own kernels,
    # in another order (so with other rounding), and needs a C++/CUDA build; torch's AdamW is what single-ft runs, so
    # the two scripts differ only by what ZeRO does.
    decay = [p for p in trainable if len(full_shape(p)) >= 2]
    no_decay = [p for p in trainable if len(full_shape(p)) < 2]
    # With --cpu-offload it updates host tensors: the fused kernel is for the GPU ones.
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, fused=device.type == "cuda" and not config.cpu_offload)
    # Passed as a function: DeepSpeed builds the schedule on the optimizer it wrapped, and steps it in engine.step()
    # at each accumulation boundary, once per optimizer step as in single-ft.
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        lr_scheduler=lambda wrapped: torch.optim.lr_scheduler.LambdaLR(
            wrapped, lambda step: lr_factor(step, config.warmup_steps, config.steps)))
    # --loss-chunk-tokens applies the LM head itself, on the final hidden states the model returns; the model's own
    # head then runs on no position (logits_to_keep takes an index of the positions to keep).
    lm_head, no_positions = model.get_output_embeddings(), torch.empty(0, dtype=torch.long, device=device)
    gather_head = config.loss_chunk_tokens > 0 and config.zero_stage == 3

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    metrics = MetricsLogger(out_dir=config.out_dir, total_steps=config.steps,
                            warmup_steps=min(config.timing_warmup_steps, max(0, config.steps - 1)),
                            model_config=model.config, lora_rank=config.lora_rank, device=device, world_size=world_size,
                            is_main=dist_info.is_main, report_to=config.report_to,
                            log_every=config.log_every, steps_per_epoch=plan.steps_per_epoch, resume=config.resume)
    comm_timer = CollectiveTimer(device, first_step=config.timing_warmup_steps, n_steps=config.comm_profile_steps)
    stopwatch = Stopwatch(device)
    eval_losses = []
    sample_messages = sample_prompt(data)  # --sample-every: the turns before the first held-out answer
    # The step count is the whole data position: step k always consumes the same rows.
    start_step = load_deepspeed_checkpoint(config.resume, engine) if config.resume else 0
    if config.resume:
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Model-state bytes are counted once, on the second step, after its last backward and before its update: the
    # gradients exist, and so does AdamW's state, created by the first update.
    state_step = min(start_step + 1, config.steps - 1)
    measured_state = None
    for step in range(start_step, config.steps):
        micro_batches = data.micro_batches(step, config.micro_batch_size, config.grad_accum, rank, world_size)
        loss_tokens = data.step_loss_tokens(step, rows_per_step)  # the whole step's, all ranks: counted locally
        # The same, as a device tensor: the fused loss scales its gradients by it without reading anything back.
        step_scale = torch.full((), 1.0 / max(loss_tokens, 1), device=device)
        lr = scheduler.get_last_lr()[0]

        stopwatch.reset()
        comm_timer.start(step)
        step_loss = torch.zeros((), device=device)
        for index, host_batch in enumerate(micro_batches):
            batch = {key: value.to(device, non_blocking=True) for key, value in host_batch.items()}
            # --attn varlen: the documents' boundaries, from the host copy of position_ids ({} otherwise).
            packed = attention.forward_kwargs(host_batch["position_ids"], device)
            with autocast():
                # attention_mask=None + restarted position_ids + use_cache=False: packed conversations stay
                # isolated (transformers builds a block-diagonal causal mask from the position_ids; varlen needs
                # none). Under ZeRO-3 the engine's hooks all-gather each layer's parameters just before it runs.
                if config.loss_chunk_tokens:
                    # Unlike single-ft, the decoder body is not called on its own: the engine's forward hooks its
                    # outputs for DeepSpeed's backward and, under ZeRO-3, gathers the embedding. So the whole model
                    # runs, asked for its hidden states (the last one after the final norm; backward keeps the others
                    # anyway) and for logits at no position.
                    hidden = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                    attention_mask=None, use_cache=False, output_hidden_states=True,
                                    logits_to_keep=no_positions, **packed).hidden_states[-1]
                else:
                    logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                    attention_mask=None, use_cache=False, **packed).logits
            # ZeRO-3 gathers a weight only around the forward and backward of the modules that own it; the fused
            # loss uses the LM head's weight outside them (after the model's forward), so it is gathered here, from
            # the loss until the end of backward (where the loss hands its weight gradient to ZeRO-3's hook, like
            # the plain path's), and partitioned again on leaving.
            with deepspeed.zero.GatheredParameters([lm_head.weight], enabled=gather_head):
                # Both losses are divided by the whole step's loss tokens, not this micro-batch's: summing the
                # micro-batch gradients of all ranks then gives exactly the gradient of the token-weighted step loss.
                if config.loss_chunk_tokens:
                    # The LM head and the loss on loss tokens only, chunk by chunk, their gradients computed on the
                    # way; the labels' host copy picks those tokens without waiting for the device.
                    loss = fused_linear_cross_entropy(hidden, lm_head.weight, host_batch["labels"],
                                                      config.loss_chunk_tokens, step_scale)
                else:
                    loss = token_loss_sum(logits, batch["labels"]) / loss_tokens
                # DeepSpeed assumes a per-micro-batch mean loss: engine.backward divides it by grad_accum, and the
                # gradient reduction over ranks (in every stage) divides the sum by world_size. Our loss is already
                # a share of the global step loss, so the gradients must simply be summed: scale_wrt_gas=False skips
                # the first division and the factor world_size cancels the second (exact for a power-of-2 world).
                engine.backward(loss * world_size, scale_wrt_gas=False)
            if step == state_step and index == len(micro_batches) - 1:
                measured_state = deepspeed_state_bytes(engine)  # the update runs in the engine.step() below
            # At the last micro-batch (the accumulation boundary): reduce, clip, AdamW on the shards, LR schedule;
            # before it, only counts micro-batches.
            engine.step()
            step_loss += loss.detach()
        # Each rank holds the loss of its own rows over the global denominator: their sum is the step loss.
        dist.all_reduce(step_loss)
        grad_norm = engine.get_global_grad_norm()  # before clipping, over all shards; a tensor or a float
        # The one host-device synchronisation of the step (of this loop's own code; DeepSpeed's step has its own):
        # the step line's loss and gradient norm, read together.
        step_loss_value, grad_norm_value = torch.stack(
            [step_loss, torch.as_tensor(grad_norm, dtype=torch.float32, device=device)]).tolist()
        step_ms = stopwatch.elapsed_ms()
        comm_ms = comm_timer.stop(step)

        metrics.log_step(step + 1, step_loss_value, lr, grad_norm_value, data.step_real_tokens(step, rows_per_step),
                         loss_tokens, step_ms, comm_ms, print_fn=print0,
                         documents=data.step_documents(step, rows_per_step))
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            eval_losses.append((step + 1, evaluate(engine, data, config.micro_batch_size, device, autocast)))
            print0(f"eval step {step + 1}: loss {eval_losses[-1][1]:.4f}")
            metrics.log_eval(*eval_losses[-1])
        if config.sample_every and (step + 1) % config.sample_every == 0 and sample_messages:
            # Generated on every rank, in step (synced_gpus): at stage 3 each forward gathers the weights; rank 0 prints.
            completion = generate(engine.module, tokenizer, sample_messages, device, autocast=autocast,
                                  synced_gpus=config.zero_stage == 3 and world_size > 1)
            print0(f"sample step {step + 1}: {completion!r}")
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            # DeepSpeed's own sharded format (its optimizer objects are opaque to torch.distributed.checkpoint),
            # published atomically by common/checkpoint.py: written to step-<k>.tmp/, renamed once all ranks are done.
            saved = save_deepspeed_checkpoint(config.out_dir, step + 1, engine, run=plan.identity,
                                              keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export. Every rank evaluates the whole held-out split: under ZeRO-3 each forward is a
    # collective (all ranks gather the same layers), so they cannot split it without also splitting the gathers.
    eval_loss = evaluate(engine, data, config.micro_batch_size, device, autocast)
    metrics.log_eval(config.steps, eval_loss)
    print0(f"eval: loss {eval_loss:.4f} over {data.stats['n_eval_conversations']} held-out conversations"
           if eval_loss is not None else "eval: no held-out conversations (--eval-fraction 0)")
    # The point of this experiment: what each rank held at its peak. Gathered so that rank 0 can print and store it,
    # next to common/memory's prediction for one device (comparable on a GPU, where both mean max_memory_reserved;
    # on CPU the measure is the whole process, interpreter and libraries included).
    peak_mem_gib_per_rank = [None] * world_size
    dist.all_gather_object(peak_mem_gib_per_rank, peak_memory_gib(device))
    # common/memory names ZeRO-Offload runs "zero-<stage>-offload" and predicts the offloaded states in host
    # memory (cpu_bytes), the device's share in predicted_state_bytes; where it has no such strategy, the prediction
    # is that of the same stage without offload. summary.json says which.
    strategy = f"zero-{config.zero_stage}" + ("-offload" if config.cpu_offload else "")
    predicted_note = None
    if strategy not in STRATEGIES:
        predicted_note = (f"common.memory has no {strategy}: predicted as zero-{config.zero_stage}, with the master "
                          f"partition and AdamW state on the device instead of in host memory")
        strategy = f"zero-{config.zero_stage}"
    elif config.cpu_offload:
        predicted_note = (f"{strategy}: common.memory predicts the offloaded states in host memory "
                          f"(predicted_cpu_bytes); predicted_state_bytes is what stays on the device")
    prediction = estimate(
        model.config, strategy, world_size, seq_len=config.seq_len, micro_batch_size=config.micro_batch_size,
        activation_checkpointing=config.activation_checkpointing, lora_rank=config.lora_rank,
        precision=config.dtype, attention=attention_kind(attention, config.packing), grad_accum=config.grad_accum,
        loss_chunk_tokens=config.loss_chunk_tokens, compile=config.compile)
    predicted_peak_mem_gib = prediction.total_gib
    # common/comm.py's formula for what the profiled steps measured. Gradients are reduced in the optimizer's group
    # order at the boundary (stage 1) or as backward produces them (stages 2 and 3: the reverse of the parameters'
    # order). ZeRO-Offload runs the same collectives (checked for stage 2). Not covered: a world of one, whose
    # collectives are not modelled; LoRA, and offload with stages 1 and 3, whose paths through DeepSpeed are not
    # checked against a measurement; and what zero_collectives leaves out (ZeRO-3 models larger than one prefetch
    # bucket, ZeRO-1 under bf16).
    groups = [group for group in (decay, no_decay) if group]
    reduction_order = [p for group in groups for p in group] if config.zero_stage == 1 else list(reversed(trainable))
    formula = None
    if world_size > 1 and not config.lora_rank and (not config.cpu_offload or config.zero_stage == 2):
        formula = zero_collectives(
            config.zero_stage, group_numels=[sum(full_shape(p).numel() for p in group) for group in groups],
            reduction_numels=[full_shape(p).numel() for p in reduction_order],
            parameter_numels=[full_shape(p).numel() for p in model.parameters()], world_size=world_size,
            grad_accum=config.grad_accum, bf16=config.dtype == "bf16")
        formula = formula and as_backend(formula, dist.get_backend())
    print0(f"peak memory per rank ({memory_label(device)}), ZeRO stage {config.zero_stage}: "
           + ", ".join(f"rank {r} {gib:.2f} GiB" for r, gib in enumerate(peak_mem_gib_per_rank))
           + f" | predicted by common/memory: {predicted_peak_mem_gib:.2f} GiB per device")
    summary = metrics.write_summary(
        comm_timer=comm_timer,  # comm_ms, collective counts and bytes: torch.profiler over the profiled steps
        experiment=EXPERIMENT, command=launch_command(), commit=git_commit(SCRIPT_DIR), config=asdict(config),
        hardware=hardware_info(device, world_size=world_size), attention=asdict(attention),
        model=dict(name=config.model, parameters=n_params, trainable_parameters=n_trainable,
                   flops_per_token=model_flops_per_token),
        t_eff=rows_per_step * config.seq_len, eval_loss=eval_loss, eval_history=eval_losses,
        packing_efficiency=data.stats["packing_efficiency"], n_conversations=data.stats["n_conversations"],
        n_truncated=data.stats["n_truncated"], data=data.stats, zero_stage=config.zero_stage,
        peak_mem_gib_per_rank=peak_mem_gib_per_rank, predicted_peak_mem_gib=predicted_peak_mem_gib,
        state_bytes_per_rank=None if measured_state is None else all_ranks(measured_state),
        state_bytes_step=None if measured_state is None else state_step + 1,  # 1-based, as in metrics.jsonl
        predicted_state_bytes=prediction.state_bytes(),
        predicted_cpu_bytes=int(prediction.cpu_bytes), predicted_note=predicted_note,
        collective_bytes_formula=formula,
        deepspeed=dict(version=deepspeed.__version__, config=ds_config))
    print0(f"\nsummary ({summary['measured_steps']} measured steps, {summary['warmup_steps_excluded']} warm-up "
           f"excluded; memory: {summary['memory_measure']}) -> {config.out_dir}\n{summary_table(summary)}")

    if config.save_hf:
        del hf_deepspeed_config  # transformers needed it only to build the model; a whole copy must not be partitioned
        save_hf(config, engine, tokenizer)
    engine.destroy()  # removes ZeRO's hooks, so that a next run in the same process (the tests) starts clean
    teardown()
    return summary


# -------------------------------------------------------------------------------------------------------------
# Export: the full fp32 weights, assembled on rank 0. Trainable parameters are read from the optimizer's fp32 master
# copy, which is sharded in every stage (safe_get_full_fp32_param all-gathers it); frozen ones (LoRA's base weights)
# have no master copy and come from the module, gathered first under ZeRO-3. Every rank must take part.


def gather_fp32_state_dict(engine, zero_stage: int) -> dict[str, torch.Tensor]:
    state = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            full = safe_get_full_fp32_param(param)
        else:
            with deepspeed.zero.GatheredParameters([param], enabled=zero_stage == 3):
                full = param.detach().float().clone()
        if dist.get_rank() == 0:
            state[name] = full.cpu()
    return state


def save_hf(config: Config, engine, tokenizer) -> None:
    state = gather_fp32_state_dict(engine, config.zero_stage)
    if dist.get_rank() == 0:
        save_dir = Path(config.save_hf)
        model = engine.module
        if config.lora_rank and config.merge_lora:
            # peft merges in place, which ZeRO-3's empty placeholders do not allow: merge on a whole fp32 copy.
            from peft import get_peft_model

            whole = AutoModelForCausalLM.from_config(model.get_base_model().config, dtype=torch.float32)
            whole = get_peft_model(whole, model.peft_config["default"])
            result = whole.load_state_dict(state, strict=False)  # the tied LM head is no entry of its own
            if result.unexpected_keys or any(not key.endswith("lm_head.weight") for key in result.missing_keys):
                raise RuntimeError(f"gathered weights do not fit the model: {result}")
            model, state = whole.merge_and_unload(), None
        # With a state_dict given, save_pretrained writes those tensors (a peft model: only its adapter's).
        model.save_pretrained(save_dir, state_dict=state)
        tokenizer.save_pretrained(save_dir)
        record_adapter_base(save_dir, config.model, config.seed)  # a LoRA adapter's base, loadable from anywhere
        print0(f"saved {'adapter' if config.lora_rank and not config.merge_lora else 'model'} to {save_dir}")
    dist.barrier()


if __name__ == "__main__":
    run(main)
