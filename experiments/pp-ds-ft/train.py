"""pp-ds-ft: fine-tune a Qwen3 decoder with DeepSpeed's pipeline engine (PipelineModule, 1F1B TrainSchedule).

    uv run torchrun --nproc_per_node=2 experiments/pp-ds-ft/train.py --grad-accum 8                 # 2 stages
    uv run torchrun --nproc_per_node=2 experiments/pp-ds-ft/train.py --model Qwen/Qwen3-0.6B-Base --grad-accum 16
    uv run torchrun --nproc_per_node=4 experiments/pp-ds-ft/train.py --grad-accum 8 --zero-stage 1   # 2 x 2 replicas
    uv run torchrun --nproc_per_node=2 experiments/pp-ds-ft/train.py --grad-accum 8 --lora-rank 16 --save-hf runs/lora
    uv run python experiments/pp-ds-ft/train.py --grad-accum 4                 # one process: a one-stage pipeline
    uv run torchrun --nproc_per_node=2 experiments/pp-ds-ft/train.py --grad-accum 4 --steps 5 --seq-len 128  # CPU smoke

The same pipeline as pp-ft, built the DeepSpeed way: the model as a flat list of layer specs (embedding, decoder
layers, final norm, LM head; the tied embedding / LM head a TiedLayerSpec at both ends) that PipelineModule cuts into
`--stages` stages, and an engine whose train_batch() runs the whole 1F1B step. More ranks than stages: data
parallelism (`--zero-stage 1` shards the optimizer). The step equals single-ft's on B = micro_batch_size x grad_accum
x replicas rows (see `loss_fn`; tests/test_pp_ft.py); the README explains every DeepSpeed setting that matters.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from common.cli import InputError, parse_config, plan_run, resolve_paths, run, stop_early

stop_early(__name__, __file__)  # --help and a flag mistake answer now, before torch and transformers load
import torch  # noqa: E402
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from transformers.masking_utils import create_causal_mask

# DeepSpeed picks its "accelerator" when it is imported; without a CUDA/ROCm GPU, name the CPU one instead of letting it
# probe (and warn). Must happen before `import deepspeed`.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec  # noqa: E402

from common.attention import setup_attention  # noqa: E402
from common.data import IGNORE_INDEX, DataError, build_data, describe, sample_text, token_loss_sum  # noqa: E402
from common.dist import all_ranks, init_distributed, print0, record_collectives_in, teardown  # noqa: E402
from common.ds_engine import act_as_launcher_if_alone, load_deepspeed_checkpoint, \
    save_deepspeed_checkpoint  # noqa: E402
from common.metrics import MetricsLogger, Recorder  # noqa: E402
from common.models import add_lora, count_parameters, flops_per_token, is_preset, load_model, load_tokenizer, \
    record_adapter_base, resolve_model_name, share_export  # noqa: E402
from common.pipeline_trace import per_rank_measures  # noqa: E402
from common.step import clip_grad_norm, lr_factor  # noqa: E402

EXPERIMENT = "pp-ds-ft"
SCRIPT_DIR = Path(__file__).resolve().parent  # a copy of this script runs from any folder (README)
deepspeed.utils.logger.setLevel(logging.WARNING)  # DeepSpeed logs every engine detail at INFO; keep the step lines


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
    micro_batch_size: int = 1  # rows per forward pass
    grad_accum: int = 1  # micro-batches per optimizer step: the pipeline's m (more of them, a smaller bubble)
    steps: int = 300  # optimizer steps (0 = only evaluate / export); 300: a minute or two of qwen3-tiny on 2 CPU cores
    epochs: float | None = None  # instead of --steps: passes over the training rows (e.g. 2, 0.5), rounded up to steps
    lr: float | None = None  # peak learning rate; default 1e-3 for presets, 2e-5 for pretrained models (1e-4 with LoRA)
    warmup_steps: int = 10  # linear warm-up steps, then cosine decay to 0 at the last step
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices (not on norms)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = no clipping; the norm is still logged)
    seed: int = 0  # one seed for init, data order and held-out split
    dtype: Literal["bf16", "fp32"] | None = None  # bf16: bf16 weights, fp32 master weights (GPU default); fp32 (CPU)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward instead of storing activations
    loss_chunk_tokens: int = 0  # not built here: 0 only (the README says why)
    compile: bool = False  # torch.compile each decoder layer (GPU speed; on CPU it only costs compile time)
    packing: bool = True  # pack conversations into rows (--no-packing: one padded conversation per row)
    lora_rank: int = 0  # 0 = full-parameter SFT; N = LoRA of rank N on every linear projection of the decoder layers
    lora_alpha: float | None = None  # LoRA scaling numerator; default 2 x rank
    merge_lora: bool = False  # with --save-hf and LoRA: write the merged full model instead of the adapter
    attn: Literal["auto", "sdpa", "eager", "flash", "varlen"] = "auto"  # attention kernel (common/attention.py)
    eval_fraction: float = 0.05  # share of conversations held out for the evaluation loss
    eval_every: int = 0  # also evaluate every N steps (0 = only at the end)
    log_every: int = 1  # print every N-th step line (the first and the last always); metrics.jsonl keeps every step
    timing_warmup_steps: int = 2  # first steps left out of summary.json's averages (allocator, caches, compilation)
    comm_profile_steps: int = 3  # steps profiled with torch.profiler for comm_ms (starting after the timing warm-up)
    out_dir: str | None = None  # default runs/pp-ds-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never); DeepSpeed's per-layer
        # format
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    # Pipeline
    stages: int | None = None  # pipeline stages; default: the world size; fewer: the other ranks are data parallel
    zero_stage: int | None = None  # 1 shards the optimizer state over the data-parallel replicas (ZeRO-2/3 do not
        # combine with the pipeline); default 1 with bf16 (see resolve), 0 with fp32


def resolve(config: Config, world_size: int) -> Config:
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
    if config.loss_chunk_tokens:
        raise InputError(f"{EXPERIMENT} has no --loss-chunk-tokens yet: the last stage would have to take the labels "
                         "and apply the tied LM head inside the chunked loss instead of returning logits to the "
                         "schedule's loss function (see the README)")
    if config.stages is None:
        config.stages = world_size
    if config.stages < 1 or world_size % config.stages:
        raise InputError(f"--stages {config.stages} must divide the number of processes ({world_size}): "
                         f"run torchrun --nproc_per_node=<a multiple of {config.stages}>")
    # bf16 accumulates gradients in fp32 (as single-ft) only in DeepSpeed's ZeRO-1 BF16_Optimizer (README).
    if config.zero_stage is None:
        config.zero_stage = 1 if config.dtype == "bf16" else 0
    if config.zero_stage not in (0, 1):
        raise InputError(f"--zero-stage must be 0 or 1 (DeepSpeed's pipeline engine rejects ZeRO-2 and 3), "
                         f"got {config.zero_stage}")
    if config.dtype == "bf16" and config.zero_stage == 0:
        raise InputError("--dtype bf16 needs --zero-stage 1 here: DeepSpeed accumulates bf16 gradients in fp32 only "
                         "in its ZeRO-1 bf16 optimizer (with one data-parallel replica it shards nothing)")
    return config


def deepspeed_config(config: Config, data_parallel_size: int) -> dict:
    """The DeepSpeed config. Every key that changes the numbers is written out, defaults included (README)."""
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        # The pipeline engine runs exactly this many micro-batches per train_batch() call: the pipeline's m.
        "gradient_accumulation_steps": config.grad_accum,
        "train_batch_size": config.micro_batch_size * config.grad_accum * data_parallel_size,
        "zero_optimization": {"stage": config.zero_stage},
        # DeepSpeed clips at 1.0 unless told; its fp32 ZeRO-0 path takes the first stage's norm only, so there we
        # clip instead (see main; README).
        "gradient_clipping": config.max_grad_norm if config.zero_stage == 1 else 0.0,
        # bf16: a bf16 module, fp32 master weights and AdamW state in the optimizer (no autocast: about 1% off).
        "bf16": {"enabled": config.dtype == "bf16"},
        # fp16 off = no loss scaling at all (a static scale of 1.0); neither fp32 nor bf16 needs one.
        "fp16": {"enabled": False},
        # Accumulate the micro-batches' gradients (and reduce them over replicas) in fp32, as single-ft does.
        "data_types": {"grad_accum_dtype": "fp32"},
        "communication_data_type": "fp32",
        # Gradients are averaged over data-parallel replicas with no pre-division; loss_fn cancels the mean exactly.
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        # torch.optim.AdamW is single-ft's optimizer; DeepSpeed only "tests" its own with ZeRO.
        "zero_allow_untested_optimizer": True,
        # Non-reentrant activation checkpointing: the reentrant default records no graph under LoRA (README).
        "pipeline": {"use_reentrant": False},
        "steps_per_print": 2**31 - 1,  # we print our own step line
        "wall_clock_breakdown": False,
    }


# ---------------------------------------------------------------------------------------------------------------
# The model as a list of pipe layers: each one's output, (hidden states, position_ids), is the next one's input and
# is sent between stages as is; each decoder layer rebuilds the rotary cos/sin and the block-diagonal mask from it.


class EmbeddingPipe(nn.Module):
    """Token ids -> embeddings; on the last stage the same class is the tied LM head (see lm_head_forward)."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.weight = embed_tokens.weight  # the attribute TiedLayerSpec ties (tied_weight_attr="weight")
        self.padding_idx = embed_tokens.padding_idx  # the pad row gets no gradient from the lookup, as in HF

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs
        return F.embedding(input_ids, self.weight, self.padding_idx), position_ids


def lm_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head is the embedding matrix used as a linear layer (Qwen3 0.6B-4B tie them)."""
    return F.linear(hidden, embedding.weight)


class DecoderLayerPipe(nn.Module):
    def __init__(self, layer: nn.Module, rotary_emb: nn.Module, model_config):
        super().__init__()
        self.layer = layer
        self.rotary_emb = rotary_emb  # buffers only (inv_freq), no weights
        self.model_config = model_config

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs
        # --attn varlen: no mask; the attention finds the documents from position_ids (a host sync per layer).
        mask = create_causal_mask(config=self.model_config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        hidden = self.layer(hidden, attention_mask=mask, position_ids=position_ids,
                            position_embeddings=position_embeddings)
        return hidden, position_ids


class FinalNormPipe(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, _ = inputs
        return self.norm(hidden)


def pipe_layers(model) -> list:
    """Qwen3ForCausalLM as DeepSpeed layer specs. A spec is built only on the stage that owns it; every rank has the
    whole (CPU) model at hand, built under the same seed as single-ft's, so each stage starts from single-ft's
    weights. The "embed" key appears twice: both end stages build an EmbeddingPipe, DeepSpeed ties their weights."""
    rotary_emb = model.model.rotary_emb
    return [
        TiedLayerSpec("embed", EmbeddingPipe, model.model.embed_tokens, tied_weight_attr="weight"),
        *[LayerSpec(DecoderLayerPipe, layer, rotary_emb, model.config) for layer in model.model.layers],
        LayerSpec(FinalNormPipe, model.model.norm),
        TiedLayerSpec("embed", EmbeddingPipe, model.model.embed_tokens, forward_fn=lm_head_forward,
                      tied_weight_attr="weight"),
    ]


def hf_state_dict(pipe: PipelineModule) -> dict[str, torch.Tensor]:
    """This stage's weights under their Qwen3ForCausalLM names. The LM head copy is left out: the config says the
    head is tied, so from_pretrained rebuilds it from model.embed_tokens.weight."""
    state = {}
    # forward_funcs are this stage's entries of the layer list, from index pipe._local_start on.
    for layer_index, function in zip(range(pipe._local_start, pipe._local_stop), pipe.forward_funcs):
        if layer_index == 0:
            state["model.embed_tokens.weight"] = function.weight
        elif isinstance(function, DecoderLayerPipe):
            state.update({f"model.layers.{layer_index - 1}.{name}": tensor
                          for name, tensor in function.layer.state_dict().items()})
        elif isinstance(function, FinalNormPipe):
            state["model.norm.weight"] = function.norm.weight
    return {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}


def micro_batch_for_engine(batch: dict[str, torch.Tensor], loss_weight: float):
    """((inputs of the first stage), (labels of the last stage)): the pair DeepSpeed's pipeline engine loads. The first
    stage reads input_ids and position_ids, the last one labels and the loss weight (see loss_fn)."""
    return ((batch["input_ids"], batch["position_ids"]),
            (batch["labels"], torch.tensor(loss_weight, dtype=torch.float32)))


def loss_fn(logits: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Token-loss sum of one micro-batch times a weight that makes DeepSpeed's averaging come out token-weighted.

    DeepSpeed divides each micro-batch's loss by gradient_accumulation_steps and averages over the data-parallel
    replicas. With weight = grad_accum x data_parallel_size / step_loss_tokens those divisions cancel, and the sum over
    micro-batches and replicas is the token-weighted step loss and its gradient (exact for powers of two).
    """
    labels, loss_weight = labels
    return token_loss_sum(logits, labels) * loss_weight


def padded_eval_batches(data, micro_batch_size: int, pad_token_id: int) -> list[dict[str, torch.Tensor]]:
    """The held-out rows in micro-batches of exactly micro_batch_size rows: DeepSpeed sizes its receive buffers on the
    first micro-batch, so a short last one is filled with pad rows that carry no loss."""
    batches = data.eval_batches(micro_batch_size)
    if batches and batches[-1]["input_ids"].shape[0] < micro_batch_size:
        last = batches[-1]
        missing = micro_batch_size - last["input_ids"].shape[0]
        seq_len = last["input_ids"].shape[1]
        filler = {"input_ids": torch.full((missing, seq_len), pad_token_id, dtype=torch.long),
                  "labels": torch.full((missing, seq_len), IGNORE_INDEX, dtype=torch.long),
                  "position_ids": torch.arange(seq_len).expand(missing, seq_len)}
        batches[-1] = {key: torch.cat([last[key], filler[key]]) for key in last}
    return batches


def evaluate_pipeline(engine, data, micro_batch_size: int, pad_token_id: int) -> float | None:
    """Token-weighted loss over the held-out split: every replica runs all of it through the pipeline, forward only."""
    batches = padded_eval_batches(data, micro_batch_size, pad_token_id)
    if not batches:
        return None
    eval_loss_tokens = sum(int((batch["labels"] != IGNORE_INDEX).sum()) for batch in batches)
    # eval_batch averages the micro-batch losses (divides by their number): the weight undoes it, as in training.
    weight = len(batches) / eval_loss_tokens
    loss = engine.eval_batch(iter([micro_batch_for_engine(batch, weight) for batch in batches]),
                             num_micro_batches=len(batches))
    return float(loss)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts

    # ---------------------------------------------------------------------------------------------------------
    # Processes and devices: one per stage and replica (torchrun); a plain `python train.py` plays a launcher with a
    # world of one, since DeepSpeed needs a process group and the launcher's variables even for one process.
    act_as_launcher_if_alone()
    dist_info = init_distributed(config.collective_timeout_s)
    # On CPU, DeepSpeed would first build (g++, a minute) a shared-memory all-reduce only inference uses: not built.
    if dist_info.device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed's communication layer wraps the group just created.
    deepspeed.init_distributed(dist_backend=dist_info.backend)
    device, world_size = dist_info.device, dist_info.world_size
    config = resolve(config, world_size)
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)
    # No autocast: with bf16, DeepSpeed itself holds the module in bf16 (and the fp32 master copy in the optimizer).

    # ---------------------------------------------------------------------------------------------------------
    # Data: every rank builds the same rows; replica d (all the ranks of its pipeline) takes the d-th slice of a step.
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
    data_parallel_size = world_size // config.stages
    rows_per_step = config.micro_batch_size * config.grad_accum * data_parallel_size
    plan = plan_run(EXPERIMENT, config, data.stats, rows_per_step, print_fn=print0)  # --epochs; --resume checked
    if config.show_sample and config.steps == 0:  # --show-sample --steps 0: look at the data, then stop
        teardown()
        return {}

    # ---------------------------------------------------------------------------------------------------------
    # Model: built whole on the CPU under single-ft's seed; PipelineModule builds only this stage's layers from it
    # (the same number of decoder layers per stage) and moves them to the device; the rest is freed with `model`.
    model = load_model(config.model, tokenizer, attention.impl, dtype=torch.float32, device="cpu")
    lora_config = None
    if config.lora_rank:
        # single-ft's adapters, injected before the layer specs take the model's pieces; the tied weight is frozen.
        model = add_lora(model, config.lora_rank, config.lora_alpha)  # DeepSpeed's bf16 mode casts it to bf16
        lora_config, model = model.peft_config["default"], model.get_base_model()
    base_model_class = type(model)
    model_config = model.config
    # no_grad: the constructor broadcasts the tied weight into the last stage's copy in place, unrecorded by autograd.
    with torch.no_grad():
        pipe = PipelineModule(
            layers=pipe_layers(model), num_stages=config.stages, loss_fn=loss_fn,
            partition_method="type:DecoderLayerPipe",
            # Recompute every decoder layer in backward; embedding, norm and head keep their activations.
            activation_checkpoint_interval=1 if config.activation_checkpointing else 0,
            checkpointable_layers=["DecoderLayerPipe"])
    del model
    if config.compile:
        # One compiled graph per decoder layer, as in single-ft; in place, so the parameter names do not change.
        for module in pipe.modules():
            if isinstance(module, DecoderLayerPipe):
                module.layer.compile()
    pipe.train()
    n_params = count_parameters(model_config)["total"]
    params = [p for p in pipe.parameters() if p.requires_grad]  # all of them, or the LoRA adapters
    held = all_ranks(sum(p.numel() for p in pipe.parameters()))
    model_flops_per_token = flops_per_token(model_config, config.seq_len, config.lora_rank)
    held_by_stages = sum(held) // data_parallel_size  # the replicas hold the same
    # The LM head copy (DeepSpeed marks it ds_pipe_replicated) is the embedding's twin: not counted as trainable.
    n_trainable = sum(all_ranks(sum(p.numel() for p in params if not getattr(p, "ds_pipe_replicated", False)))
                      ) // data_parallel_size
    print0(f"model: {config.model} | {n_params:,} parameters ({held_by_stages:,} held by the stages, the LM head copy "
           f"included), {n_trainable:,} trainable | {model_flops_per_token / 1e9:.3f} GFLOP/token (training) | "
           f"dtype {config.dtype}")
    parts = pipe.parts  # where each stage starts in the layer list: 0 embedding, 1..L layers, L+1 norm, L+2 head
    names = ["embedding", *[f"layer {i}" for i in range(model_config.num_hidden_layers)], "norm", "LM head"]
    for stage in range(config.stages):
        owned = names[parts[stage]:parts[stage + 1]]
        print0(f"stage {stage}: {owned[0]} .. {owned[-1]} ({len(owned)} pipe layers)")
    print0(f"pipeline: DeepSpeed 1F1B, {config.stages} stages x {data_parallel_size} data-parallel replica(s), "
           f"m = {config.grad_accum} micro-batches | ZeRO stage {config.zero_stage}")
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} x {data_parallel_size} replica(s) = "
           f"{rows_per_step} rows of {config.seq_len} -> T_eff = {rows_per_step * config.seq_len:,} token slots per "
           f"optimizer step")

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: single-ft's AdamW and schedule, handed to DeepSpeed, which steps both once per train_batch().
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=config.lr, fused=device.type == "cuda")
    ds_config = deepspeed_config(config, data_parallel_size)
    engine, _, _, scheduler = deepspeed.initialize(
        model=pipe, optimizer=optimizer, config=ds_config,
        lr_scheduler=lambda wrapped: torch.optim.lr_scheduler.LambdaLR(
            wrapped, lambda step: lr_factor(step, config.warmup_steps, config.steps)))
    replica = engine.grid.data_parallel_id
    for weight, _ in engine.module.get_tied_weights_and_groups():
        if not weight.requires_grad:
            # DeepSpeed's bf16 path reads every tied weight's _hp_grad, set only on trained ones: None = no gradient.
            weight._hp_grad = None
    stage_norm = {}  # the fp32 ZeRO-0 path's gradient norm, from the hook below
    if config.zero_stage == 0:
        # Our AdamW's step pre-hook runs after DeepSpeed's reductions: single-ft's clipping there, the norm summed over
        # this replica's stages, the LM head copy (ds_pipe_replicated, the embedding's gradient) left out.
        counted = [p for p in params if not getattr(p, "ds_pipe_replicated", False)]
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        optimizer.register_step_pre_hook(lambda *_: stage_norm.update(value=clip_grad_norm(
            optimizer, params, max_norm, group=engine.grid.get_model_parallel_group(), norm_parameters=counted)))

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    start_step = load_deepspeed_checkpoint(config.resume, engine) if config.resume else 0
    if config.resume:
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Step clock, comm_ms, the step line, metrics.jsonl, summary.json; the garbage collector on a schedule from here.
    rec = Recorder(EXPERIMENT, config, device, model_config, data, rows_per_step, world_size=world_size,
                   rank=dist.get_rank(), steps_per_epoch=plan.steps_per_epoch, start_step=start_step,
                   script_dir=SCRIPT_DIR, n_parameters=n_params, n_trainable=n_trainable,
                   flops_per_token=model_flops_per_token)
    rec.model.update(parameters_held_per_rank=held)
    for step in range(start_step, config.steps):
        micro_batches = data.micro_batches(step, config.micro_batch_size, config.grad_accum, replica,
                                           data_parallel_size)
        loss_tokens = data.step_loss_tokens(step, rows_per_step)  # the whole step's, all replicas: counted locally
        loss_weight = config.grad_accum * data_parallel_size / loss_tokens  # see loss_fn
        lr = scheduler.get_last_lr()[0]

        rec.start(step)
        # One call runs the whole 1F1B step (reductions, clipping, AdamW, the LR schedule) and returns the step loss,
        # already broadcast from the last stage to every rank.
        step_loss = engine.train_batch(iter([micro_batch_for_engine(batch, loss_weight) for batch in micro_batches]))
        grad_norm = engine.get_global_grad_norm() if config.zero_stage == 1 else stage_norm["value"]
        rec.stop()
        rec.step(step, float(step_loss), lr, float(grad_norm))  # the step's host read
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate_pipeline(engine, data, config.micro_batch_size, tokenizer.pad_token_id))
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            # DeepSpeed's own sharded format (its optimizer is opaque to DCP), published atomically (common/checkpoint).
            saved = save_deepspeed_checkpoint(config.out_dir, step + 1, engine, run=plan.identity,
                                              keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export
    pipeline_measures = per_rank_measures(rec)  # every rank's peak memory and collectives (stages differ)
    eval_loss = evaluate_pipeline(engine, data, config.micro_batch_size, tokenizer.pad_token_id)
    rec.eval(config.steps, eval_loss)
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(
        attention=asdict(attention), eval_loss=eval_loss,
        pipeline=dict(schedule="deepspeed-1f1b", stages=config.stages, data_parallel=data_parallel_size,
                      microbatches=config.grad_accum, stage_starts=[int(start) for start in parts]),
        deepspeed=dict(version=deepspeed.__version__, config=ds_config),
        **pipeline_measures)

    if config.save_hf and config.lora_rank and not config.merge_lora:
        save_lora_adapter(Path(config.save_hf), engine, lora_config, base_model_class, tokenizer)
        record_adapter_base(config.save_hf, config.model, config.seed)  # its base, loadable from anywhere
        print0(f"saved adapter to {config.save_hf} (gathered from the {config.stages} stage(s) on rank 0)")
    elif config.save_hf:
        if config.lora_rank:
            merge_lora_adapters(engine.module)
        save_hf_sharded(Path(config.save_hf), engine, model_config, tokenizer)
        share_export(config.save_hf)  # safetensors writes 0600; the export is readable like its config
        print0(f"saved model to {config.save_hf} ({config.stages} shard(s), one per stage)")
    engine.destroy()
    teardown()
    return summary


# -------------------------------------------------------------------------------------------------------------
# Export: an HF sharded checkpoint, one safetensors shard per stage (the stage's first replica writes it) and the
# index; no rank holds the whole model. With bf16 the shards hold the bf16 weights DeepSpeed computes with.


def save_hf_sharded(save_dir: Path, engine, model_config, tokenizer) -> None:
    pipe, grid = engine.module, engine.grid
    n_stages = grid.pipe_parallel_size
    shard = f"model-{pipe.stage_id + 1:05d}-of-{n_stages:05d}.safetensors"
    writes = grid.data_parallel_id == 0
    tensors = hf_state_dict(pipe) if writes else {}
    if writes:
        save_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, save_dir / shard, metadata={"format": "pt"})
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, (shard, {name: t.numel() * t.element_size() for name, t in tensors.items()}))
    if dist.get_rank() == 0:
        weight_map = {name: file for file, sizes in shards for name in sizes}
        total_size = sum(size for _, sizes in shards for size in sizes.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (save_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        model_config.architectures = ["Qwen3ForCausalLM"]
        model_config.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
    dist.barrier()


def merge_lora_adapters(pipe: PipelineModule) -> None:
    """peft's merge_and_unload on this stage's layers only: every adapted projection becomes its plain nn.Linear with
    W += (alpha / r) B A, so hf_state_dict finds Qwen3ForCausalLM's names."""
    from peft.tuners.lora import LoraLayer

    for name, child in list(pipe.named_modules()):
        if isinstance(child, LoraLayer):
            child.merge()
            parent, _, attribute = name.rpartition(".")
            setattr(pipe.get_submodule(parent), attribute, child.get_base_layer())


def save_lora_adapter(save_dir: Path, engine, lora_config, base_model_class: type, tokenizer) -> None:
    """What PeftModel.save_pretrained writes (adapter_model.safetensors in peft's names, adapter_config.json): the
    adapters are small, so rank 0 gathers every stage's (from the first replica) and writes one file."""
    pipe = engine.module
    adapters = {}
    if engine.grid.data_parallel_id == 0:
        for layer_index, function in zip(range(pipe._local_start, pipe._local_stop), pipe.forward_funcs):
            if isinstance(function, DecoderLayerPipe):
                adapters.update({f"base_model.model.model.layers.{layer_index - 1}.{name.replace('.default.', '.')}":
                                 tensor.detach().cpu().contiguous()
                                 for name, tensor in function.layer.state_dict().items() if ".lora_" in name})
    gathered = all_ranks(adapters)
    if dist.get_rank() == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        tensors = {name: tensor for part in gathered for name, tensor in part.items()}
        save_file(dict(sorted(tensors.items())), save_dir / "adapter_model.safetensors", metadata={"format": "pt"})
        lora_config.inference_mode = True  # as peft saves it
        lora_config.save_pretrained(save_dir, auto_mapping_dict={"base_model_class": base_model_class.__name__,
                                                                 "parent_library": base_model_class.__module__})
        tokenizer.save_pretrained(save_dir)
    dist.barrier()


if __name__ == "__main__":
    run(main)
