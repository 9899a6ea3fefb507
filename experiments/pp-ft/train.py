"""pp-ft: fine-tune a Qwen3 decoder with pipeline parallelism (torch.distributed.pipelining), stages built by hand.

    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --grad-accum 8                     # 2 stages, 1F1B
    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --grad-accum 8 --schedule zbv  # or interleaved-1f1b
    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --model Qwen/Qwen3-0.6B-Base --grad-accum 16
    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --grad-accum 8 --lora-rank 16 --save-hf runs/lora
    uv run torchrun --nproc_per_node=4 experiments/pp-ft/train.py --grad-accum 8 --stages 2   # 2 stages x 2 replicas
    uv run python experiments/pp-ft/train.py --grad-accum 4                    # one process: a one-stage pipeline
    uv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py --grad-accum 4 --steps 5 --seq-len 128  # CPU smoke

Each rank holds one contiguous block of decoder layers (a "stage"; the first also the embedding, the last the norm and
the LM head). A step's B = micro_batch_size x grad_accum x replicas rows are cut into m = --grad-accum micro-batches
that flow through the stages in the order the schedule decides (GPipe, 1F1B, interleaved 1F1B, ZBV); a rank waiting
for its neighbours is idle: the bubble, measured per rank (common/pipeline_trace.py). The step equals single-ft's on
the same B (tests/test_pp_ft.py): see `loss_fn`, `sum_tied_gradients` and the norm over the stages; the README
explains the stages, the replicas (--stages) and what summary.json holds per rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from common.cli import InputError, parse_config, plan_run, resolve_paths, run, stop_early

stop_early(__name__, __file__)  # --help and a flag mistake answer now, before torch and transformers load
import torch  # noqa: E402
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, \
    ScheduleZBVZeroBubble
from torch.nn.parallel import DistributedDataParallel
from transformers.masking_utils import create_causal_mask

from common.attention import VARLEN, document_kwargs, setup_attention
from common.checkpoint import load_checkpoint, save_checkpoint
from common.data import IGNORE_INDEX, DataError, build_data, describe, sample_text, to_device, token_loss_sum
from common.loss import fused_linear_cross_entropy
from common.dist import all_ranks, init_distributed, print0, record_collectives_in, teardown
from common.metrics import MetricsLogger, Recorder
from common.models import TINY_PRESETS, add_lora, checkpoint_activations, count_parameters, flops_per_token, \
    is_preset, load_model, load_tokenizer, record_adapter_base, resolve_model_name, share_export, weights_dtype
from common.pipeline_trace import PipelineTrace
from common.precision import MasterWeights
from common.step import all_reduce_in_buckets, clip_grad_norm, lr_factor

EXPERIMENT = "pp-ft"
SCRIPT_DIR = Path(__file__).resolve().parent  # a copy of this script runs from any folder (README)


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
    micro_batch_size: int = 1  # rows per forward pass
    grad_accum: int | None = None  # micro-batches per optimizer step: the pipeline's m; default one per stage
    steps: int = 300  # optimizer steps (0 = only evaluate / export); 300: a minute or two of qwen3-tiny on 2 CPU cores
    epochs: float | None = None  # instead of --steps: passes over the training rows (e.g. 2, 0.5), rounded up to steps
    lr: float | None = None  # peak learning rate; default 1e-3 for presets, 2e-5 for pretrained models (1e-4 with LoRA)
    warmup_steps: int = 10  # linear warm-up steps, then cosine decay to 0 at the last step
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices (not on norms)
    max_grad_norm: float = 1.0  # clip the global gradient norm to this (0 = no clipping; the norm is still logged)
    seed: int = 0  # one seed for init, data order and held-out split
    dtype: Literal["bf16", "fp32"] | None = None  # bf16: bf16 compute, fp32 master weights (GPU default); fp32 (CPU)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward instead of storing activations
    loss_chunk_tokens: int = 0  # N > 0: the last stage runs the LM head and loss on loss tokens only, N at a time
    compile: bool = False  # torch.compile each decoder layer (GPU speed; on CPU it only costs compile time)
    packing: bool = True  # pack conversations into rows (--no-packing: one padded conversation per row)
    lora_rank: int = 0  # 0 = full-parameter SFT; N = LoRA of rank N on every linear projection of the decoder layers
    lora_alpha: float | None = None  # LoRA scaling numerator; default 2 x rank
    lora_fused: bool = False  # LoRA: one adapter input product for q/k/v and gate/up, each added by its product
    merge_lora: bool = False  # with --save-hf and LoRA: write the merged full model instead of the adapter
    attn: Literal["auto", "sdpa", "eager", "flash", "varlen"] = "auto"  # attention kernel (common/attention.py)
    eval_fraction: float = 0.05  # share of conversations held out for the evaluation loss
    eval_every: int = 0  # also evaluate every N steps (0 = only at the end)
    log_every: int = 1  # print every N-th step line (the first and the last always); metrics.jsonl keeps every step
    timing_warmup_steps: int = 2  # first steps left out of summary.json's averages (allocator, caches, compilation)
    comm_profile_steps: int = 3  # steps profiled with torch.profiler for comm_ms (starting after the timing warm-up)
    out_dir: str | None = None  # default runs/pp-ft-<UTC time>; on --resume, the resumed run's own folder
    checkpoint_every: int = 0  # write <out-dir>/checkpoints/step-<k>/ every N steps (0 = never)
    keep_checkpoints: int = 3  # keep the newest N checkpoints, deleting older ones after each save (0 = keep all)
    resume: str | None = None  # a run folder (its newest good checkpoint), a checkpoints/step-<k> folder, or latest
    resume_anyway: bool = False  # with --resume: continue from another run's checkpoint instead of stopping
    save_hf: str | None = None  # after training, write an HF folder (safetensors + config + tokenizer) here
    report_to: Literal["none", "tensorboard"] = "none"  # tensorboard: the step metrics to <out-dir>/tensorboard too
    collective_timeout_s: float = 600.0  # a collective waiting longer ends the run and names the lost rank
    # Pipeline
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zbv"] = "1f1b"  # order of the micro-batches' forwards and
        # backwards (torch.distributed.pipelining)
    stages_per_rank: int | None = None  # pipeline stages held by each rank (v); default 1, and 2 for interleaved-1f1b
        # and zbv (zbv needs exactly 2)
    split: str | None = None  # first decoder layer of every stage but the first, e.g. "14" (2 stages) or "7,14,21" (4);
        # default: even split
    stages: int | None = None  # pipeline stages in all (S = p ranks per pipeline x v stages each); default: one
        # pipeline over every rank (world x v); fewer: world / p data-parallel replicas of the pipeline


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
    if config.loss_chunk_tokens < 0:
        raise InputError(f"--loss-chunk-tokens {config.loss_chunk_tokens}: expected 0 (off) or a positive chunk size")
    if config.stages_per_rank is None:
        config.stages_per_rank = 2 if config.schedule in ("interleaved-1f1b", "zbv") else 1
    if config.schedule in ("gpipe", "1f1b") and config.stages_per_rank != 1:
        raise InputError(f"--schedule {config.schedule} runs one stage per rank; for more use interleaved-1f1b")
    if config.schedule == "zbv" and config.stages_per_rank != 2:
        raise InputError("--schedule zbv places exactly 2 stages per rank (a V); leave --stages-per-rank at 2")
    if config.schedule == "zbv" and config.loss_chunk_tokens:
        raise InputError("--loss-chunk-tokens does not combine with --schedule zbv: ZBV runs each backward twice, for "
                         "the input gradient and then the weights', while the fused loss computes both once, in its "
                         "forward (common/loss.py); use 1f1b, gpipe or interleaved-1f1b")
    return config


# ---------------------------------------------------------------------------------------------------------------
# Pipeline layout and stages


def pipeline_layout(n_layers: int, n_ranks: int, stages_per_rank: int, schedule: str, split: str | None
                    ) -> tuple[list[range], list[int]]:
    """Which decoder layers each stage holds, and which rank runs each stage.

    Stages are numbered in the order the activations flow. The loop placement (GPipe, 1F1B, interleaved) puts stage s
    on rank s % p, so with v stages per rank an activation visits every rank v times. ZBV places them in a V: rank r
    holds stages r and 2p-1-r, so the activations go down the ranks and back up, and rank 0 holds both the first and
    the last stage.
    """
    n_stages = n_ranks * stages_per_rank
    if n_layers < n_stages:
        raise InputError(f"{n_stages} pipeline stages need at least one decoder layer each; the model has {n_layers}")
    if split:
        try:
            bounds = [int(value) for value in split.split(",")]
        except ValueError:
            raise InputError(f"--split {split!r}: expected comma-separated layer indices, e.g. 14 or 7,14,21") from None
        if len(bounds) != n_stages - 1 or bounds != sorted(set(bounds)) or not 0 < bounds[0] <= bounds[-1] < n_layers:
            raise InputError(f"--split {split!r}: {n_stages} stages need {n_stages - 1} increasing layer indices "
                             f"between 1 and {n_layers - 1} (the first layer of stages 1..{n_stages - 1})")
    else:
        # Even split; the remainder goes to the first stages, since the last one also carries the LM head.
        sizes = [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]
        bounds = [sum(sizes[:s]) for s in range(1, n_stages)]
    layers = [range(start, stop) for start, stop in zip([0, *bounds], [*bounds, n_layers])]
    if schedule == "zbv":
        stage_rank = [s if s < n_ranks else 2 * n_ranks - 1 - s for s in range(n_stages)]
    else:
        stage_rank = [s % n_ranks for s in range(n_stages)]
    return layers, stage_rank


class Qwen3Stage(nn.Module):
    """One pipeline stage of Qwen3ForCausalLM: [embedding] + decoder layers [start, stop) + [final norm + LM head].

    Its parameters keep the names they have in Qwen3ForCausalLM (model.embed_tokens.weight, model.layers.<i>...,
    model.norm.weight, lm_head.weight), so checkpoints and the --save-hf export use the original names.

    Every stage receives the micro-batch's packed position_ids (each rank holds the same rows, so no communication is
    needed) and rebuilds from them what HF's Qwen3Model.forward builds once for all layers: the rotary cos/sin and the
    causal mask. With attention_mask=None, create_causal_mask finds the restarts of position_ids and makes the mask
    block-diagonal, exactly as in single-ft, so packed conversations never see each other on any stage.
    """

    def __init__(self, model, layers: range, is_first: bool, is_last: bool, loss_chunk_tokens: int = 0):
        super().__init__()
        self.config = model.config
        self.is_first, self.is_last = is_first, is_last
        self.loss_chunk_tokens = loss_chunk_tokens
        self.model = nn.Module()
        if is_first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.rotary_emb = model.model.rotary_emb  # buffers only (inv_freq), no weights
        if is_last:
            self.model.norm = model.model.norm
            # Qwen3 (0.6B-4B) ties the LM head to the embedding, which lives on another rank: the last stage gets its
            # own copy, kept identical by summing both copies' gradients before every step (sum_tied_gradients).
            self.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(),
                                               requires_grad=model.lm_head.weight.requires_grad)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor | None = None,
                loss_scale: torch.Tensor | None = None) -> torch.Tensor:
        # labels and loss_scale (--loss-chunk-tokens) reach every stage; only the last uses them.
        hidden = self.model.embed_tokens(x) if self.is_first else x
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        # --attn varlen: the documents' boundaries, once per stage call (a host sync: position_ids are on device).
        packed = document_kwargs(position_ids, x.device) if self.config._attn_implementation == VARLEN else {}
        for layer in self.model.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids,
                           position_embeddings=position_embeddings, **packed)
        if self.is_last and labels is not None:
            # The fused loss: head + cross-entropy on the loss tokens only, in chunks (common/loss.py): the output is
            # this micro-batch's share of the step loss; the head's gradient flows as the plain head's (DDP sees it).
            return fused_linear_cross_entropy(self.model.norm(hidden), self.lm_head.weight, labels,
                                              self.loss_chunk_tokens, loss_scale)
        if self.is_last:
            return self.lm_head(self.model.norm(hidden))
        return hidden


def rank_container(stages: list[Qwen3Stage]) -> nn.Module:
    """This rank's stages as one module with Qwen3ForCausalLM's parameter names (optimizer, checkpoints, export)."""
    if len(stages) == 1:
        return stages[0]
    container = nn.Module()
    container.model = nn.Module()
    container.model.layers = nn.ModuleDict()
    for stage in stages:
        for name, child in stage.model.named_children():
            if name == "layers":
                container.model.layers.update(child)
            else:
                setattr(container.model, name, child)
        if stage.is_last:
            container.lm_head = stage.lm_head
    return container


def sum_tied_gradients(embedding: nn.Parameter | None, lm_head: nn.Parameter | None, group) -> None:
    """Give both copies of the tied weight the gradient of the tied weight: the sum of both copies' gradients.

    In the unsplit model one tensor is used twice (lookup on the way in, matmul on the way out) and autograd adds the
    two contributions. Here each copy received only its own, on its own rank; an all-reduce (sum) over the two ranks
    that hold them restores the total on both, so AdamW applies the same update to both and they stay identical.
    When one rank holds both ends (zbv, or a one-process pipeline) the sum is local. With data-parallel replicas each
    replica has its own pair of ranks, and its own group.
    """
    if embedding is not None and lm_head is not None:
        total = embedding.grad + lm_head.grad
        embedding.grad.copy_(total)
        lm_head.grad.copy_(total)
    elif embedding is not None or lm_head is not None:
        dist.all_reduce((embedding if embedding is not None else lm_head).grad, group=group)


def into_masters_after(weight_pass, masters: MasterWeights):
    """ZBV's weight pass writes .grad itself, not through the hooks that feed the masters: moved after each pass."""
    def run(*args, **kwargs):
        weight_pass(*args, **kwargs)
        masters.take_grads()
    return run


# ---------------------------------------------------------------------------------------------------------------
# Evaluation and export


@torch.no_grad()
def evaluate_pipeline(stages: dict[int, Qwen3Stage], stage_rank: list[int], data, micro_batch_size: int,
                      device: torch.device, pp_group) -> float | None:
    """Token-weighted loss over the held-out split, one micro-batch at a time through all stages (ranks numbered in
    `pp_group`). Plain send/recv: a forward has no backward to overlap with, and schedule.eval() fails on ZBV's V."""
    batches = data.eval_batches(micro_batch_size)
    if not batches:
        return None
    rank = dist.get_rank(pp_group)
    for stage in stages.values():
        stage.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for batch in batches:
        batch = {key: value.to(device) for key, value in batch.items()}
        hidden = None
        for s, owner in enumerate(stage_rank):
            if owner != rank:
                continue
            if s == 0:
                inputs = batch["input_ids"]
            elif stage_rank[s - 1] == rank:
                inputs = hidden
            else:
                # Hidden states have the weights' dtype: bf16 under --dtype bf16 (bf16 weights or LoRA base), else fp32.
                first_layer = next(iter(stages[s].model.layers.values()))
                inputs = torch.empty(*batch["input_ids"].shape, stages[s].config.hidden_size, device=device,
                                     dtype=first_layer.input_layernorm.weight.dtype)
                dist.recv(inputs, group=pp_group, group_src=stage_rank[s - 1])
            hidden = stages[s](inputs, position_ids=batch["position_ids"])
            if s == len(stage_rank) - 1:
                total += token_loss_sum(hidden, batch["labels"]).double()
            elif stage_rank[s + 1] != rank:
                dist.send(hidden.contiguous(), group=pp_group, group_dst=stage_rank[s + 1])
        count += int((batch["labels"] != IGNORE_INDEX).sum())
    for stage in stages.values():
        stage.train()
    dist.broadcast(total, group=pp_group, group_src=stage_rank[-1])
    return float(total) / count


def save_hf_sharded(save_dir: Path, module: nn.Module, model_config, tokenizer, pp_group, writes: bool) -> None:
    """An HF sharded checkpoint: each rank of the pipeline with `writes` writes its stages' weights as one shard, its
    first rank the index, config and tokenizer; no rank holds the whole model. The LM head copy is left out: tied."""
    if not writes:
        dist.barrier()
        return
    rank, world_size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    save_dir.mkdir(parents=True, exist_ok=True)
    shard = f"model-{rank + 1:05d}-of-{world_size:05d}.safetensors"
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in module.state_dict().items()
               if name != "lm_head.weight"}
    save_file(tensors, save_dir / shard, metadata={"format": "pt"})
    shards = [None] * world_size
    dist.all_gather_object(shards, (shard, {name: t.numel() * t.element_size() for name, t in tensors.items()}),
                           group=pp_group)
    if rank == 0:
        weight_map = {name: file for file, sizes in shards for name in sizes}
        total_size = sum(size for _, sizes in shards for size in sizes.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (save_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        model_config.architectures = ["Qwen3ForCausalLM"]
        model_config.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
    dist.barrier()


def merge_lora_adapters(module: nn.Module) -> None:
    """peft's merge_and_unload on this rank's stages only: every adapted projection becomes its plain nn.Linear with
    W += (alpha / r) B A, so save_hf_sharded writes them as for full fine-tuning."""
    from peft.tuners.lora import LoraLayer

    for name, child in list(module.named_modules()):
        if isinstance(child, LoraLayer):
            child.merge()
            parent, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(parent), attribute, child.get_base_layer())


def save_lora_adapter(save_dir: Path, module: nn.Module, lora_config, base_model_class: type, tokenizer) -> None:
    """What PeftModel.save_pretrained writes (adapter_model.safetensors in peft's names, adapter_config.json): the
    adapters are small, so rank 0 gathers every stage's and writes one file."""
    adapters = {f"base_model.model.{name.replace('.default.', '.')}": tensor.detach().cpu().contiguous()
                for name, tensor in module.state_dict().items() if ".lora_" in name}
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


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(Config, argv)  # a flag mistake stops with one line (common/cli.py)
    MetricsLogger.check_report_to(config.report_to)  # a missing package stops the run before anything starts

    # ---------------------------------------------------------------------------------------------------------
    # Processes and devices: one per device (torchrun); a plain `python train.py` gets a one-rank group (a HashStore).
    dist_info = init_distributed(config.collective_timeout_s)
    device = dist_info.device
    config = resolve(config)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    world_size = dist.get_world_size()
    # The mesh ("dp", "pp"): pp_size ranks per pipeline, world / pp_size replicas of it; row-major, so the ranks of
    # one pipeline are consecutive (one node's links carry the activations).
    v = config.stages_per_rank
    if config.stages is None:
        config.stages = world_size * v
    if config.stages < 1 or config.stages % v or world_size % (config.stages // v):
        raise InputError(f"--stages {config.stages} must be a multiple of --stages-per-rank {v} whose quotient (ranks "
                         f"per pipeline) divides the number of processes ({world_size}): run torchrun "
                         f"--nproc_per_node=<a multiple of {max(1, config.stages // v)}>")
    pp_size = config.stages // v
    replicas = world_size // pp_size
    if config.grad_accum is None:  # the fewest micro-batches every schedule runs: one per stage
        config.grad_accum = config.stages
    mesh = init_device_mesh(device.type, (replicas, pp_size), mesh_dim_names=("dp", "pp"))
    pp_group, dp_group = mesh["pp"].get_group(), mesh["dp"].get_group()
    # `rank` is this rank's place in its pipeline (what stage_rank below refers to); `replica` which rows it reads.
    rank, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    if replicas > 1 and config.schedule == "zbv":
        raise InputError("--schedule zbv does not combine with data-parallel replicas here: its weight-gradient pass "
                         "does not fire DDP's hooks (the steps come out wrong); use 1f1b, gpipe or interleaved-1f1b")
    record_collectives_in(config.out_dir)  # CUDA: where NCCL's flight recorder dumps on a timeout
    print0(f"config: {json.dumps(asdict(config))}")
    torch.manual_seed(config.seed)
    attention = setup_attention(device, config.attn, print_fn=print0)

    # ---------------------------------------------------------------------------------------------------------
    # Data: every rank builds the same rows; each replica reads its "dp" slice of every step's rows (never by
    # global rank): the first stage takes input_ids, the last labels, all of them position_ids.
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
    rows_per_step = config.micro_batch_size * config.grad_accum * replicas
    plan = plan_run(EXPERIMENT, config, data.stats, rows_per_step, print_fn=print0)  # --epochs; --resume checked
    if config.show_sample and config.steps == 0:  # --show-sample --steps 0: look at the data, then stop
        teardown()
        return {}

    # ---------------------------------------------------------------------------------------------------------
    # Model, then this rank's stages: every rank builds the whole model on the CPU under the same seed (single-ft's
    # weights) and keeps only its stages (the README's Limits: host memory).
    model = load_model(config.model, tokenizer, attention.impl, device="cpu",
                       dtype=weights_dtype(config.dtype, config.lora_rank))  # a LoRA base in bf16 under bf16
    if config.activation_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and is the variant PyTorch recommends.
        checkpoint_activations(model, use_reentrant=False)
    lora_config = None
    if config.lora_rank:
        # single-ft's adapters, injected before the model is cut; the stages are cut from the plain model peft wraps.
        model = add_lora(model, config.lora_rank, config.lora_alpha, fused=config.lora_fused)  # fused: common/lora.py
        lora_config, model = model.peft_config["default"], model.get_base_model()
    base_model_class = type(model)
    model_config = model.config
    n_layers = model_config.num_hidden_layers
    layers, stage_rank = pipeline_layout(n_layers, pp_size, config.stages_per_rank, config.schedule, config.split)
    n_stages = len(layers)
    stages = {s: Qwen3Stage(model, layers[s], is_first=s == 0, is_last=s == n_stages - 1,
                            loss_chunk_tokens=config.loss_chunk_tokens).to(device)
              for s in range(n_stages) if stage_rank[s] == rank}
    del model
    if config.compile:
        # One compiled graph per decoder layer, as in single-ft; in place, so the parameter names do not change.
        for stage in stages.values():
            for layer in stage.model.layers.values():
                layer.compile()
    module = rank_container(list(stages.values()))
    module.train()
    # --dtype bf16: the trainable weights become bf16, AdamW updates fp32 master copies (common/precision.py).
    masters = MasterWeights(module, torch.bfloat16 if config.dtype == "bf16" else None)
    first_rank, last_rank = stage_rank[0], stage_rank[-1]
    # The tied weight's two copies (their fp32 masters under bf16) get their gradients summed (sum_tied_gradients),
    # unless frozen (LoRA), over a group of the two ranks holding them, one per replica (a collective: all take part).
    tied_trainable = not config.lora_rank
    tie_group = None
    if tied_trainable and first_rank != last_rank:
        tie_group, _ = dist.new_subgroups_by_enumeration([[row[first_rank], row[last_rank]]
                                                          for row in mesh.mesh.tolist()])
    embedding = masters.module.model.embed_tokens.weight if tied_trainable and 0 in stages else None
    lm_head = masters.module.lm_head.weight if tied_trainable and n_stages - 1 in stages else None

    n_params = count_parameters(model_config)["total"]
    trainable = masters.parameters  # the fp32 masters, or the model's own trainable weights (fp32)
    params_for_norm = [p for p in trainable if p is not lm_head]
    # Per rank of one pipeline (replica 0 = global ranks 0 .. pp_size - 1; the other replicas hold the same).
    held, trainable_held = map(list, zip(*all_ranks((sum(p.numel() for p in module.parameters()),
                                                     sum(p.numel() for p in params_for_norm)))[:pp_size]))
    n_trainable = sum(trainable_held)  # the LM head copy left out: it is the embedding's twin
    model_flops_per_token = flops_per_token(model_config, config.seq_len, config.lora_rank)
    print0(f"model: {config.model} | {n_params:,} parameters ({sum(held):,} held by the stages, the LM head copy "
           f"included), {n_trainable:,} trainable | {model_flops_per_token / 1e9:.3f} GFLOP/token (training) | "
           f"dtype {config.dtype}")
    for s in range(n_stages):
        block = f"layer {layers[s].start}" if len(layers[s]) == 1 else f"layers {layers[s].start}-{layers[s].stop - 1}"
        head = "norm + LM head" + (" and loss on loss tokens (fused)" if config.loss_chunk_tokens else "")
        parts = (["embedding"] if s == 0 else []) + [block] + ([head] if s == n_stages - 1 else [])
        print0(f"stage {s} on rank {stage_rank[s]}: {', '.join(parts)}")
    print0(f"parameters held per rank: {', '.join(f'rank {r}: {n:,}' for r, n in enumerate(held))}")
    trace = PipelineTrace(device, config)  # the bubble per rank and one step's timeline (summary.json)
    print0(f"pipeline: {config.schedule}, p = {pp_size} ranks x v = {config.stages_per_rank} stages each, "
           f"m = {config.grad_accum} micro-batches"
           + (f" | {replicas} data-parallel replicas of it (mesh {replicas} x {pp_size}), each stage's gradients "
              f"all-reduced over its {replicas} copies" if replicas > 1 else ""))
    print0(f"batch: B = {config.micro_batch_size} x {config.grad_accum} x {replicas} replica(s) = {rows_per_step} rows "
           f"of {config.seq_len} -> T_eff = {rows_per_step * config.seq_len:,} token slots per optimizer step")
    if world_size == 1:
        print0(f"one process: all {n_stages} stage(s) on one rank, no parallelism; run under torchrun "
               f"--nproc_per_node=2 (or more) to spread them")

    # ---------------------------------------------------------------------------------------------------------
    # Pipeline schedule. loss_fn runs on the last stage once per micro-batch: divided by the whole step's loss tokens,
    # the m losses add up to the step's (scale_grads=False: no division by m); x replicas undoes DDP's average (README).
    # With --loss-chunk-tokens the last stage's output already is that loss (its forward ran the fused loss).
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor, step_loss_tokens: int) -> torch.Tensor:
        if config.loss_chunk_tokens:
            return logits
        return token_loss_sum(logits, labels) / step_loss_tokens * replicas

    pipeline_stages = []
    for s, stage_module in stages.items():
        if replicas > 1 and not masters.copies:
            # DDP over the replicas' copies of this stage, all-reducing once per step in the last backward (no_sync
            # before it); find_unused_parameters=True stops its bucket rebuild, which breaks step 2 here (README).
            stage_module = DistributedDataParallel(stage_module, process_group=dp_group, broadcast_buffers=False,
                                                   find_unused_parameters=True, gradient_as_bucket_view=True,
                                                   device_ids=[device.index] if device.type == "cuda" else None)
        # Stage indices and peer ranks are numbered inside this rank's pipeline (pp_group).
        stage = PipelineStage(stage_module, stage_index=s, num_stages=n_stages, device=device, group=pp_group)
        trace.time_stage(stage, s)  # every forward and backward of this stage timed: the bubble
        if config.schedule == "zbv" and masters.copies:
            stage.backward_weight_one_chunk = into_masters_after(stage.backward_weight_one_chunk, masters)
        pipeline_stages.append(stage)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
                      "zbv": ScheduleZBVZeroBubble}[config.schedule]
    try:
        schedule = schedule_class(pipeline_stages if config.stages_per_rank > 1 else pipeline_stages[0],
                                  n_microbatches=config.grad_accum, loss_fn=trace.time_loss(loss_fn, n_stages - 1),
                                  scale_grads=False)
    except ValueError as error:
        raise InputError(f"--schedule {config.schedule} with {n_stages} stages and --grad-accum {config.grad_accum}: "
                         f"{error} (more micro-batches also shrink the bubble)") from None

    # ---------------------------------------------------------------------------------------------------------
    # Optimizer: AdamW; no weight decay on norms (1-D weights). Fused kernels on GPU. This rank's parameters only.
    # No empty group (LoRA trains nothing 1-D): a checkpoint's optimizer state cannot load into one.
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([group for group in groups if group["params"]], lr=config.lr,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, config.steps))

    # ---------------------------------------------------------------------------------------------------------
    # Training loop
    start_step = load_checkpoint(config.resume, masters.module, optimizer, scheduler) if config.resume else 0
    if config.resume:
        masters.copy_to_model()  # the loaded fp32 masters, rounded into the weights the forward reads
        print0(f"resumed from {config.resume}: continuing at step {start_step + 1}")
    # Step clock, comm_ms, the step line, metrics.jsonl, summary.json; the garbage collector on a schedule from here.
    rec = Recorder(EXPERIMENT, config, device, model_config, data, rows_per_step, world_size=world_size,
                   rank=dist.get_rank(), steps_per_epoch=plan.steps_per_epoch, start_step=start_step,
                   script_dir=SCRIPT_DIR, n_parameters=n_params, n_trainable=n_trainable,
                   flops_per_token=model_flops_per_token)
    rec.model.update(parameters_held_per_rank=held, trainable_parameters_per_rank=trainable_held)
    for step in range(start_step, config.steps):
        micro_batches = data.micro_batches(step, config.micro_batch_size, config.grad_accum, replica, replicas)
        loss_tokens = data.step_loss_tokens(step, rows_per_step)  # the denominator of the whole step, all replicas
        lr = scheduler.get_last_lr()[0]

        rec.start(step)
        # The step's micro-batches go to the device up front (pinned on a GPU): the copies overlap queued compute.
        batches = [to_device(host_batch, device) for host_batch in micro_batches]
        labels = [batch["labels"] for batch in batches] if n_stages - 1 in stages else None
        kwargs = [{"position_ids": batch["position_ids"]} for batch in batches]
        if config.loss_chunk_tokens:
            # The last stage's fused loss: the labels' host copy (picks the loss tokens without a device sync) and
            # the step's scale as a device tensor, 1 / loss tokens (x replicas, as loss_fn's).
            loss_scale = torch.full((), replicas / max(loss_tokens, 1), device=device)
            kwargs = [dict(kw, labels=host_batch["labels"], loss_scale=loss_scale)
                      for kw, host_batch in zip(kwargs, micro_batches)]
        trace.start(step, labels)
        micro_losses = []
        schedule.step(arg_mbs=[(batch["input_ids"],) for batch in batches] if 0 in stages else None,
                      kwarg_mbs=kwargs,
                      target_mbs=labels, losses=micro_losses, loss_kwargs={"step_loss_tokens": loss_tokens},
                      return_outputs=False)
        trace.stop(step)
        if replicas > 1 and masters.copies:  # bf16: no DDP (the masters' hooks take each gradient first): the mean
            # here, in DDP's 25 MiB buckets, not overlapped with the backward
            all_reduce_in_buckets([master.grad.div_(replicas) for master in trainable], 25 * 2**20, group=dp_group)
        # The replicas' gradients averaged (by DDP inside the schedule, or just above); the tied copies next, the norm.
        sum_tied_gradients(embedding, lm_head, tie_group)
        rec.state(step, module.parameters(), optimizer, masters.copies)  # weights, gradients, AdamW, masters
        max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
        # The whole model's norm: the squares of every stage of this pipeline, the LM head copy counted once.
        grad_norm = clip_grad_norm(optimizer, trainable, max_norm, group=pp_group, norm_parameters=params_for_norm)
        masters.free_weights()  # the bf16 weights are not read again before the next forward (common/precision.py)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        masters.copy_to_model()  # the updated fp32 masters, rounded into the weights the next forward reads
        # Only the last stage has the loss (with replicas, each its share, x replicas): summed, then sent to rank 0.
        step_loss = torch.stack(micro_losses).sum().detach() / replicas if micro_losses \
            else torch.zeros((), device=device)
        if replicas > 1:
            dist.all_reduce(step_loss, group=dp_group)
        dist.broadcast(step_loss, group=pp_group, group_src=last_rank)
        rec.stop()
        # The one host-device synchronisation of the step: the step line's loss and gradient norm, read together.
        values = torch.stack([step_loss, grad_norm.float()]).tolist()
        rec.step(step, values[0], lr, values[1])
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            rec.eval(step + 1, evaluate_pipeline(stages, stage_rank, data, config.micro_batch_size, device, pp_group))
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
            saved = save_checkpoint(config.out_dir, step + 1, masters.module, optimizer, scheduler, run=plan.identity,
                                    keep=config.keep_checkpoints)
            print0(f"checkpoint: {saved}")

    # ---------------------------------------------------------------------------------------------------------
    # Evaluation, results, export
    pipeline_measures = trace.finish(rec)  # the bubble per rank, one step's timeline, every rank's peak memory
    eval_loss = evaluate_pipeline(stages, stage_rank, data, config.micro_batch_size, device, pp_group)
    rec.eval(config.steps, eval_loss)
    # summary.json: what was measured, and the settings the predictions read from it afterwards (not in this run).
    summary = rec.finish(
        attention=asdict(attention), eval_loss=eval_loss, master_weights=masters.summary(),
        pipeline=dict(schedule=config.schedule, ranks=pp_size, stages_per_rank=config.stages_per_rank,
                      microbatches=config.grad_accum, stage_layers=[[r.start, r.stop] for r in layers],
                      stage_rank=stage_rank, replicas=replicas),
        **pipeline_measures)

    if config.save_hf:
        masters.restore_masters()  # the fp32 weights, as an export under autocast wrote them
    if config.save_hf and config.lora_rank and not config.merge_lora:
        save_lora_adapter(Path(config.save_hf), module, lora_config, base_model_class, tokenizer)
        record_adapter_base(config.save_hf, config.model, config.seed)  # its base, loadable from anywhere
        print0(f"saved adapter to {config.save_hf} (gathered from the {world_size} rank(s) on rank 0)")
    elif config.save_hf:
        if config.lora_rank:
            merge_lora_adapters(module)
        save_hf_sharded(Path(config.save_hf), module, model_config, tokenizer, pp_group, writes=replica == 0)
        share_export(config.save_hf)  # safetensors writes 0600; the export is readable like its config
        print0(f"saved model to {config.save_hf} ({pp_size} shard(s), one per rank of a pipeline)")
    if own_group:
        dist.destroy_process_group()
    teardown()
    return summary


if __name__ == "__main__":
    run(main)
