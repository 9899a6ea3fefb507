"""zero-ft: fine-tune a Qwen3 decoder with DeepSpeed ZeRO (stage 1, 2 or 3) over data-parallel ranks.

    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 2         # 2 GPUs (or 2 CPU processes)
    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 3 --model Qwen/Qwen3-1.7B-Base
    uv run python experiments/zero-ft/train.py --zero-stage 3                               # one process (a world of 1)
    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 3 --steps 5 --seq-len 128  # CPU smoke
    uv run torchrun --nproc_per_node=2 experiments/zero-ft/train.py --zero-stage 2 --loss-chunk-tokens 1024 --compile

ZeRO keeps data parallelism (every rank runs the whole model on its own rows) but stops replicating the training
state: stage 1 shards the optimizer state over the ranks, stage 2 also the gradients, stage 3 also the parameters
(each layer all-gathered just before its forward and backward, then freed). README: what each rank holds.

One optimizer step consumes B = micro_batch_size x grad_accum x world_size packed rows (common/data.py), the same
computation as single-ft on that B, DeepSpeed's own loss scaling undone; tests/test_zero_ft.py holds every stage to it.

Strategy flags: --zero-stage, --cpu-offload. --compile is refused at stage 3 (README.md says why).
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from common.cli import InputError, parse_config, plan_run, resolve_paths, run, stop_early

stop_early(__name__, __file__)  # --help and a flag mistake answer now, before torch and transformers load
import torch  # noqa: E402
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

from common.attention import setup_attention
from common.data import DataError, build_data, describe, evaluate, sample_text, to_device, token_loss_sum
from common.dist import init_distributed, print0, record_collectives_in, teardown
from common.ds_engine import act_as_launcher_if_alone, deepspeed_state_bytes, load_deepspeed_checkpoint, \
    save_deepspeed_checkpoint
from common.generate import generate, sample_prompt
from common.loss import fused_linear_cross_entropy
from common.metrics import MetricsLogger, Recorder, memory_label, peak_memory_gib
from common.models import TINY_PRESETS, add_lora, checkpoint_activations, count_parameters, flops_per_token, \
    is_preset, load_model, load_tokenizer, record_adapter_base, resolve_model_name
from common.step import lr_factor

# DeepSpeed picks its "accelerator" on import: without a CUDA/ROCm GPU, name the CPU one (no probing, no warning).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402

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
    seq_len: int | None = None  # tokens per packed row; default 256 for qwen3-tiny and qwen3-moe-tiny, 1024 otherwise
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
    compile: bool = False  # torch.compile each decoder layer (GPU speed; on CPU it only costs compile time)
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
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never), in DeepSpeed's format
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
        config.seq_len = 256 if config.model in TINY_PRESETS else 1024
    if config.dtype is None:
        config.dtype = "bf16" if torch.cuda.is_available() else "fp32"
    if config.lr is None:
        config.lr = 1e-3 if is_preset(config.model) else (1e-4 if config.lora_rank else 2e-5)
    if config.lora_alpha is None:
        config.lora_alpha = 2.0 * config.lora_rank
    resolve_paths(config, EXPERIMENT)  # --data found, --out-dir under the working directory, --resume
    if config.zero_stage not in (1, 2, 3):
        raise InputError(f"--zero-stage must be 1, 2 or 3, got {config.zero_stage} (stage 0 is plain DDP: see ddp-ft)")
    if config.compile and config.zero_stage == 3:
        raise InputError("--compile needs --zero-stage 1 or 2: ZeRO-3 gathers each projection's weight in hooks that "
                         "break a compiled decoder layer into small graphs between the gathers (see README.md)")
    return config


def deepspeed_config(config: Config, world_size: int) -> dict:
    """The DeepSpeed config. Every key that changes the numbers is written out, defaults included, so that nothing
    silently differs from single-ft; the rest (bucket sizes, prefetching, overlap) only moves time and memory."""
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.grad_accum,
        "train_batch_size": config.micro_batch_size * config.grad_accum * world_size,
        # ZeRO-Offload (--cpu-offload): the fp32 master partition, its gradient and AdamW's state in host memory.
        "zero_optimization": {"stage": config.zero_stage, **({"offload_optimizer": {
            "device": "cpu", "pin_memory": torch.cuda.is_available()}} if config.cpu_offload else {})},
        # Not DeepSpeedCPUAdam under offload: torch's AdamW keeps single-ft's arithmetic, at a slower update.
        "zero_force_ds_cpu_optimizer": False,
        # engine.step() clips the sharded gradients itself (README), at 1.0 unless told; 0 turns it off.
        "gradient_clipping": config.max_grad_norm,
        # bf16: bf16 weights and activations in the module, fp32 master weights and AdamW state in the optimizer.
        "bf16": {"enabled": config.dtype == "bf16"},
        # fp16 off = no loss scaling at all (a static scale of 1.0); neither fp32 nor bf16 needs one.
        "fp16": {"enabled": False},
        # Accumulate and reduce the gradients in fp32, as single-ft accumulates them (bf16 would be the default).
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        # The reduction averages over ranks (the only op ZeRO-3 supports), no pre-division: the loop cancels the mean.
        "gradient_allreduce_op": "mean",
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        # torch's AdamW, single-ft's, on ZeRO's flat fp32 shards: the same element-wise update.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # we print our own step line
        "wall_clock_breakdown": False,
    }


def full_shape(param: torch.nn.Parameter) -> torch.Size:
    """A parameter's real shape, also once ZeRO-3 has partitioned it (the module then holds an empty placeholder)."""
    return getattr(param, "ds_shape", param.shape)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts

    # ---------------------------------------------------------------------------------------------------------
    # One process per device under torchrun; DeepSpeed needs a launcher even for one process: we play a world of one.
    act_as_launcher_if_alone()
    dist_info = init_distributed(config.collective_timeout_s)
    # CPU: no g++ build of DeepSpeed's shared-memory all-reduce (a minute), which only its inference calls (README).
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
    # Data: every row of every step is fixed by (seed, data, seq_len); see common/data.py.
    tokenizer = load_tokenizer(config.model)
    try:
        data = build_data(config.data, tokenizer, config.seq_len, packing=config.packing,
                          eval_fraction=config.eval_fraction, seed=config.seed, split=config.data_split,
                          subset=config.data_config, columns=config.data_columns,
                          train_empty_think=config.train_empty_think)
    except DataError as error:
        raise InputError(f"bad training data: {error}") from None
    print0(describe(data.stats, config.seq_len, config.packing))
    if config.show_sample:
        print0(sample_text(data, tokenizer))
    rows_per_step = config.micro_batch_size * config.grad_accum * world_size
    plan = plan_run(EXPERIMENT, config, data.stats, rows_per_step, print_fn=print0)  # --epochs; --resume checked
    if config.show_sample and config.steps == 0:  # --show-sample --steps 0: look at the data, then stop
        teardown()
        return {}

    # ---------------------------------------------------------------------------------------------------------
    # Model: whole on every rank at stages 1 and 2; stage 3 partitions a checkpoint as it loads (zero.Init, switched on
    # by a live HfDeepSpeedConfig) and a preset after building it in host memory with single-ft's seed (README).
    ds_config = deepspeed_config(config, world_size)
    zero3_checkpoint = config.zero_stage == 3 and not is_preset(config.model)
    zero3_preset = config.zero_stage == 3 and is_preset(config.model)
    hf_deepspeed_config = HfDeepSpeedConfig(ds_config) if zero3_checkpoint else None  # must stay alive while loading
    model = load_model(config.model, tokenizer, attention.impl, dtype=torch.float32,
                       device="cpu" if zero3_preset else device)
    if config.activation_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and is the variant PyTorch recommends.
        checkpoint_activations(model, use_reentrant=False)
    if config.lora_rank:
        model = add_lora(model, config.lora_rank, config.lora_alpha)  # DeepSpeed's bf16 mode casts the module to bf16
    if config.compile:
        # One graph per decoder layer (as torchtitan): bounded compile time; in place, so parameter names stay.
        for layer in model.get_decoder().layers:
            layer.compile()
    if config.zero_stage == 3 and config.dtype == "bf16":
        # ZeRO-3 expects bf16 parameters, as zero.Init builds them: cast what it did not (a preset, peft's adapters).
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
    # Optimizer: single-ft's AdamW and schedule, handed to DeepSpeed, which gives each group this rank's flat fp32
    # shard: every rank's AdamW updates (and holds state for) its 1/world_size. Not DeepSpeed's own Adam (README).
    decay = [p for p in trainable if len(full_shape(p)) >= 2]
    no_decay = [p for p in trainable if len(full_shape(p)) < 2]
    # With --cpu-offload it updates host tensors: the fused kernel is for the GPU ones.
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, fused=device.type == "cuda" and not config.cpu_offload)
    # A function: DeepSpeed builds the schedule on the optimizer it wraps, and steps it once per optimizer step.
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config,
        lr_scheduler=lambda wrapped: torch.optim.lr_scheduler.LambdaLR(
            wrapped, lambda step: lr_factor(step, config.warmup_steps, config.steps)))
    # --loss-chunk-tokens applies the LM head itself, to the hidden states the engine's forward returns (README).
    lm_head, no_positions = model.get_output_embeddings(), torch.empty(0, dtype=torch.long, device=device)
    gather_head = config.loss_chunk_tokens > 0 and config.zero_stage == 3

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    sample_messages = sample_prompt(data)  # --sample-every: the turns before the first held-out answer
    # The step count is the whole data position: step k always consumes the same rows.
    start_step = load_deepspeed_checkpoint(config.resume, engine) if config.resume else 0
    if config.resume:
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Step clock, comm_ms, the step line, metrics.jsonl, summary.json; the garbage collector on a schedule from here.
    rec = Recorder(EXPERIMENT, config, device, model.config, data, rows_per_step, world_size=world_size, rank=rank,
                   steps_per_epoch=plan.steps_per_epoch, start_step=start_step, script_dir=SCRIPT_DIR,
                   n_parameters=n_params, n_trainable=n_trainable, flops_per_token=model_flops_per_token)
    for step in range(start_step, config.steps):
        micro_batches = data.micro_batches(step, config.micro_batch_size, config.grad_accum, rank, world_size)
        loss_tokens = data.step_loss_tokens(step, rows_per_step)  # the denominator of the whole step, all its rows
        # The same, as a device tensor: the fused loss scales its gradients by it without reading anything back.
        step_scale = torch.full((), 1.0 / max(loss_tokens, 1), device=device)
        lr = scheduler.get_last_lr()[0]

        rec.start(step)
        # The step's micro-batches go to the device up front (pinned on a GPU): the copies overlap queued compute.
        batches = [to_device(host_batch, device) for host_batch in micro_batches]
        step_loss = torch.zeros((), device=device)
        for index, (host_batch, batch) in enumerate(zip(micro_batches, batches)):
            # --attn varlen: the documents' boundaries, from the host copy of position_ids ({} otherwise).
            packed = attention.forward_kwargs(host_batch["position_ids"], device)
            # Divided by the whole step's loss tokens: the micro-batches' gradients sum to the step loss's gradient.
            with autocast():
                # No mask + restarted position_ids + no cache: packed conversations stay isolated (common/data.py).
                if config.loss_chunk_tokens:
                    # Through the engine's forward, which hooks its outputs for DeepSpeed's backward (README).
                    hidden = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                    attention_mask=None, use_cache=False, output_hidden_states=True,
                                    logits_to_keep=no_positions, **packed).hidden_states[-1]
                else:
                    logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                    attention_mask=None, use_cache=False, **packed).logits
            # ZeRO-3: the fused loss uses the LM head's weight outside its module, so it is gathered here (README).
            with deepspeed.zero.GatheredParameters([lm_head.weight], enabled=gather_head):
                if config.loss_chunk_tokens:
                    # The LM head and the loss on loss tokens only, chunk by chunk (common/loss.py).
                    loss = fused_linear_cross_entropy(hidden, lm_head.weight, host_batch["labels"],
                                                      config.loss_chunk_tokens, step_scale)
                else:
                    loss = token_loss_sum(logits, batch["labels"]) / loss_tokens
                # engine.backward divides by grad_accum and the reduction by world_size: both undone (README).
                engine.backward(loss * world_size, scale_wrt_gas=False)
            if index == len(micro_batches) - 1:  # the update runs in this micro-batch's engine.step()
                rec.state(step, count=lambda: deepspeed_state_bytes(engine))  # weights, grads, master, AdamW's state
            # At the last micro-batch (the accumulation boundary): reduce, clip, AdamW on the shards, LR schedule.
            engine.step()
            step_loss += loss.detach()
        dist.all_reduce(step_loss)  # each rank holds its rows' share of the step loss: the log line wants the sum
        grad_norm = engine.get_global_grad_norm()  # before clipping, over all shards; a tensor or a float
        rec.stop()
        # The one host-device synchronisation of the step: the step line's loss and gradient norm, read together.
        # (Of this loop's own code: DeepSpeed's step has its own.)
        values = torch.stack([step_loss, torch.as_tensor(grad_norm, dtype=torch.float32, device=device)]).tolist()
        rec.step(step, values[0], lr, values[1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate(engine, data, config.micro_batch_size, device, autocast))
        if config.sample_every and (step + 1) % config.sample_every == 0 and sample_messages:
            completion = generate(engine.module, tokenizer, sample_messages, device, autocast=autocast,
                                  synced_gpus=config.zero_stage == 3 and world_size > 1)
            print0(f"sample step {step + 1}: {completion!r}")
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            # DeepSpeed's own sharded format (its optimizer objects are opaque to torch.distributed.checkpoint).
            saved = save_deepspeed_checkpoint(config.out_dir, step + 1, engine, run=plan.identity,
                                              keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export; every rank evaluates every batch, as ZeRO-3's gathers need all ranks.
    eval_loss = evaluate(engine, data, config.micro_batch_size, device, autocast)
    rec.eval(config.steps, eval_loss)
    peak_mem_gib_per_rank = [None] * world_size  # the point of this experiment: what each rank held at its peak
    dist.all_gather_object(peak_mem_gib_per_rank, peak_memory_gib(device))
    print0(f"peak memory per rank ({memory_label(device)}), ZeRO stage {config.zero_stage}: "
           + ", ".join(f"rank {r} {gib:.2f} GiB" for r, gib in enumerate(peak_mem_gib_per_rank)))
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(
        attention=asdict(attention), eval_loss=eval_loss, zero_stage=config.zero_stage,
        peak_mem_gib_per_rank=peak_mem_gib_per_rank,
        deepspeed=dict(version=deepspeed.__version__, config=ds_config))

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
