"""Which strategy to try first, and the command that runs exactly what was priced.

The decision tree, first rung that fits wins; a rung fits when its predicted peak plus ERROR_BAND of it (room for the
model's own error, common/memory/states.py) is within USABLE_FRACTION of a GPU's memory, in GiB. A rung is a strategy
with its own flags; every rung takes the largest micro-batch that fits (the rest of the asked rows per step as
--grad-accum, so the step is the same), and the speed flags its experiment takes (--attn varlen, --loss-chunk-tokens,
--compile: FAST_FLAGS; under LoRA, --lora-fused where the experiment has it: LORA_FUSED). A strategy's own flags
(activation checkpointing, --reduce-every-micro-batch) are tried before the next strategy, and what is trained
changes last: full fine-tuning down the whole ladder, then LoRA, then QLoRA.
1. one GPU: single-ft (DDP on more GPUs: a replica per GPU, one all-reduce of the gradients per step);
2. more GPUs, a replica does not fit: FSDP (fsdp-ft), which shards weights, gradients and AdamW state. At one
   micro-batch per step its bf16 all-gathers and fp32 reduce-scatter move as many bytes as DDP's fp32 all-reduce
   (8 Psi (W-1)/W), at m micro-batches (m+1)/2 times as many; with several micro-batches it first keeps their
   unsharded gradients (fewer bytes), then reduces every micro-batch (--reduce-every-micro-batch: less memory).
   ZeRO-2 (zero-ft --zero-stage 2) is priced in the table but never the first choice: it holds more per GPU than
   FSDP (bf16 weights whole beside 16 sharded bytes: 10 Psi on 2 GPUs against FSDP's 8 Psi) and, as zero-ft runs
   it under bf16, all-reduces fp32 gradients every micro-batch and all-gathers bf16 weights every step (post 04
   measures the bytes); what it has for it is fewer, larger collectives and no gathers in forward;
3. model parallelism: pipeline stages first on PCIe (only hidden states cross the link), tensor + sequence
   parallelism first on NVLink;
4. nothing fits on the GPUs alone: CPU offload, ZeRO-Offload (zero-2-offload: the GPU keeps the whole bf16 model)
   before ZeRO-3 with its optimizer offloaded (a 1/N share) before FSDP's offload (only the layers being computed).
   Offload comes last because every step then runs AdamW on the CPU and moves gradients and weights over PCIe,
   several times slower than any strategy that keeps its states on the GPUs, and it needs about 16-18 bytes per
   parameter of host memory;
5. full fine-tuning fits nowhere: LoRA (rank DEFAULT_LORA_RANK unless given) on a bf16 base, down rungs 1-3
   (when the answer for full fine-tuning was an offload, it also names the fastest LoRA rung on the GPUs);
6. LoRA fits nowhere on the GPUs: QLoRA (a 4-bit base: single-ft, ddp-ft), then LoRA offloaded (rung 4).
Within a rung, activation checkpointing (about a third more compute) is taken only when it buys a larger
micro-batch than the rung reaches without it and that one is below EFFICIENT_MICRO_TOKENS: at one 1,024-token
row per micro-batch the GPU ladder's step was host-bound (devlog/2026-11-26-gpu-suite-nvidia-h200.md), which costs
more than recomputing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from common.memory.estimate import MemoryEstimate, estimate
from common.memory.states import GIB, QLORA_STRATEGIES, STRATEGIES, USABLE_FRACTION, BytesPerParam, ModelShape, \
    model_shape

DEFAULT_LORA_RANK = 16  # what the recommendation falls back to when full SFT fits nowhere
DEFAULT_ROWS_PER_GPU = 8  # rows of --seq-len each replica consumes per optimizer step, unless asked: the fastest rung
EFFICIENT_MICRO_TOKENS = 4096  # below this many tokens per micro-batch, a larger micro-batch beats no recomputation
LOSS_CHUNK_TOKENS = 1024  # the chunked loss's chunk, as the GPU ladder ran it
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
# The speed flags each experiment takes: (varlen attention, chunked loss, compiled layers). Each script's README says
# why it refuses the others: TP's loss parallelism already splits the logits, the pipelines' last stage does not take
# the labels, tp-ft's plan and ZeRO-3's hooks do not compile.
FAST_FLAGS = {
    "single": (True, True, True), "ddp": (True, True, True), "fsdp": (True, True, True),
    "fsdp-offload": (True, True, True), "zero-1": (True, True, True), "zero-2": (True, True, True),
    "zero-2-offload": (True, True, True), "zero-3": (True, True, False), "zero-3-offload": (True, True, False),
    "tp": (True, False, False), "tp-sp": (True, False, True), "pp": (True, False, True),
    "fsdp-tp": (True, False, False),
    "ep": (True, True, True),
}
# The experiments that take --lora-fused (common/lora.py: the same adapters in fewer kernels; on one H100 LoRA r16's
# step 6% shorter and 1.75 GiB smaller, devlog/2026-11-27-gpu-suite-nvidia-h100-80gb-hbm3.md).
LORA_FUSED = ("single", "ddp", "fsdp", "fsdp-offload", "pp")
# After every strategy that keeps its model states on the GPUs: the GPU keeps the whole bf16 model, then a 1/N share
# of it, then only the layers being computed.
OFFLOAD_LADDER = ("zero-2-offload", "zero-3-offload", "fsdp-offload")
WHY = {
    "single": "it fits on one GPU",
    "ddp": "a full replica fits on each GPU: DDP all-reduces only the gradients, once per step, the cheapest way to "
           "add GPUs for throughput",
    "zero-1": "ZeRO-1 shards AdamW state and the master copy only",
    "zero-2": "ZeRO-2 shards gradients and AdamW state but keeps the bf16 weights whole; zero-ft under bf16 "
              "all-reduces fp32 gradients every micro-batch and gathers bf16 weights every step, more bytes than DDP "
              "and FSDP (post 04), for fewer and larger collectives and no gathers in forward",
    "zero-3": "ZeRO-3 shards weights, gradients and AdamW state, gathering each module as it runs",
    "fsdp": "FSDP shards weights, gradients and AdamW state and all-gathers one layer at a time: at one micro-batch "
            "per step its bf16 gathers and fp32 reduce-scatter move DDP's bytes, at m micro-batches (m+1)/2 times "
            "as many",
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


# The parts of a GPU's memory an estimate breaks down, as the CLI's table and the ladder's JSON name them.
PARTS = (("weights", "weights_bytes"), ("grads", "grads_bytes"), ("optimizer", "optimizer_bytes"),
         ("master", "master_bytes"), ("copies", "compute_copy_bytes"), ("activations", "activations_bytes"),
         ("logits", "logits_bytes"), ("buffers", "buffers_bytes"))


@dataclass(frozen=True)
class Rung:
    """One way to run: a strategy with its flags, priced at one micro-batch size."""
    strategy: str
    activation_checkpointing: bool
    lora_rank: int
    qlora: bool
    micro_batch_size: int
    grad_accum: int
    flags: tuple[str, ...]  # the strategy's own flags (e.g. --reduce-every-micro-batch)
    fast: tuple[bool, bool, bool]  # varlen, chunked loss, compile
    estimate: MemoryEstimate
    plain_micro_batch_size: int = 0  # with checkpointing: the largest micro-batch that fits without it (0: none)
    lora_fused: bool = False  # --lora-fused


@dataclass(frozen=True)
class Recommendation:
    strategy: str | None  # None: nothing fits
    activation_checkpointing: bool
    lora_rank: int
    reason: str
    choice: MemoryEstimate | None
    estimates: list[MemoryEstimate]  # every strategy that applies to these GPUs, with the settings as given
    gpus: int
    gpu_mem_gib: float
    dtype: str | None = None  # the --dtype the estimates priced (None: a convention given for every strategy)
    grad_accum: int = 1
    rung: Rung | None = None  # what the command runs
    model: str = ""  # --model of the command
    seq_len: int = 1024
    notes: list[str] = field(default_factory=list)

    @property
    def fitting(self) -> list[str]:
        return [e.strategy for e in self.estimates if e.fits(self.gpu_mem_gib)]

    def command(self) -> str:
        """The command that runs what was priced: the model, the batch layout, the rung's flags."""
        if self.strategy is None or self.rung is None:
            return ""
        rung = self.rung
        launcher = "python" if rung.strategy == "single" else f"torchrun --nproc_per_node={self.gpus}"
        parts = [f"uv run {launcher} {RUN_WITH[rung.strategy]}"]
        if self.model:
            parts.append(f"--model {self.model}")
        parts.append(f"--seq-len {self.seq_len} --micro-batch-size {rung.micro_batch_size} "
                     f"--grad-accum {rung.grad_accum}")
        varlen, chunked, compiled = rung.fast
        parts += ["--attn varlen"] * varlen + [f"--loss-chunk-tokens {LOSS_CHUNK_TOKENS}"] * chunked \
            + ["--compile"] * compiled
        parts += ["--activation-checkpointing"] * rung.activation_checkpointing
        parts += ["--qlora"] * rung.qlora
        parts += [f"--lora-rank {rung.lora_rank}"] * (rung.lora_rank > 0) + ["--lora-fused"] * rung.lora_fused
        parts += list(rung.flags)
        parts += [f"--dtype {self.dtype}"] * bool(self.dtype)  # explicit: a CPU's default is fp32
        return " ".join(parts)


def _micro_batches(rows: int, strategy: str, gpus: int, fixed: int | None) -> list[tuple[int, int]]:
    """(micro-batch, grad-accum) pairs for `rows` rows per replica per step, largest micro-batch first. A pipeline
    needs at least as many micro-batches as stages."""
    if fixed:
        return [(fixed, max(1, -(-rows // fixed)))]
    least = gpus if strategy == "pp" else 1
    pairs, micro = [], rows
    while micro >= 1:
        if rows % micro == 0 and rows // micro >= least:
            pairs.append((micro, rows // micro))
        micro //= 2
    return pairs or [(1, max(rows, least))]


class Ladder:
    """The rungs of the decision tree for one question (a model, its GPUs, the batch and training asked for), each
    priced once, in the order recommend() tries them; the first that fits a GPU's memory is the answer. The order
    does not depend on the memory: `rungs()` is the whole ladder, which the site's "will it fit" page walks for any
    memory it is given."""

    def __init__(self, config_like, gpus: int, *, seq_len: int = 1024, micro_batch_size: int | None = None,
                 grad_accum: int | None = None, rows_per_gpu: int = DEFAULT_ROWS_PER_GPU,
                 activation_checkpointing: bool = False, lora_rank: int = 0, qlora: bool = False,
                 precision: BytesPerParam | str = "bf16", attention: str | None = None, interconnect: str = "pcie",
                 fast: bool = True, kv_expanded: bool = False):
        self.shape, self.gpus, self.seq_len = model_shape(config_like), gpus, seq_len
        self.micro_batch_size, self.activation_checkpointing = micro_batch_size, activation_checkpointing
        self.rows = micro_batch_size * (grad_accum or 1) if micro_batch_size else (grad_accum or rows_per_gpu)
        self.lora_rank, self.qlora, self.precision, self.fast = lora_rank, qlora, precision, fast
        self.plain_attention = attention or "sdpa-packed"
        self.varlen_attention = "flash-expanded-kv" if kv_expanded else "flash"
        shape = self.shape
        if shape.is_moe:  # single-ft on one GPU, ep-ft on several; full fine-tuning only
            self.on_gpus = [("single", ())] if gpus == 1 else [("ep", ())]
        elif gpus == 1:
            self.on_gpus = [("single", ())]
        else:
            model_parallel = ("tp-sp", "tp", "pp") if interconnect == "nvlink" else ("pp", "tp-sp", "tp")
            fsdp_variants = [("fsdp", ())] + ([("fsdp", ("--reduce-every-micro-batch",))] if self.rows > 1 else [])
            self.on_gpus = [("ddp", ()), *fsdp_variants, *((s, ()) for s in model_parallel)]
        offload = [] if shape.is_moe else [(s, ()) for s in OFFLOAD_LADDER]
        # (LoRA rank, QLoRA, rungs): full fine-tuning on the GPUs, then offloaded; LoRA on the GPUs; QLoRA; LoRA
        # offloaded.
        rank = lora_rank or DEFAULT_LORA_RANK
        if qlora:
            self.trainings = [(rank, True, self.on_gpus)]
        elif lora_rank:
            self.trainings = [(rank, False, self.on_gpus), (rank, True, self.on_gpus), (rank, False, offload)]
        elif shape.is_moe:
            self.trainings = [(0, False, self.on_gpus)]
        else:
            self.trainings = [(0, False, self.on_gpus + offload), (rank, False, self.on_gpus),
                              (rank, True, self.on_gpus), (rank, False, offload)]

    def price(self, strategy: str, checkpointing: bool, rank: int, quantized: bool, micro: int, accum: int,
              flags: tuple[str, ...] = ()) -> Rung | None:
        world = 1 if strategy == "single" else self.gpus
        varlen, chunked, compiled = FAST_FLAGS[strategy] if self.fast else (False, False, False)
        fused = self.fast and rank > 0 and strategy in LORA_FUSED
        try:
            priced = estimate(self.shape, strategy, world, seq_len=self.seq_len, micro_batch_size=micro,
                              lora_rank=rank, activation_checkpointing=checkpointing, precision=self.precision,
                              attention=self.varlen_attention if varlen else self.plain_attention,
                              grad_accum=1 if "--reduce-every-micro-batch" in flags else accum,
                              loss_chunk_tokens=LOSS_CHUNK_TOKENS if chunked else 0, compile=compiled,
                              qlora=quantized, lora_fused=fused)
        except ValueError:  # e.g. heads that do not divide over the GPUs, QLoRA elsewhere than single/ddp
            return None
        return Rung(strategy, checkpointing, rank, quantized, micro, accum, flags, (varlen, chunked, compiled),
                    priced, lora_fused=fused)

    def group(self, strategy: str, rank: int, quantized: bool, flags: tuple[str, ...] = ()) -> list[Rung]:
        """One strategy's rungs for one training, in the order to try them: the first that fits is the one to take
        (module docstring: checkpointing only where it buys a micro-batch that keeps the GPU busy). Micro-batches
        large enough without checkpointing come first; then checkpointed ones down to that size; below it each
        size without, then with checkpointing, so that checkpointing wins only where it fits a larger micro-batch
        than the plain step does."""
        layouts = _micro_batches(self.rows, strategy, self.gpus, self.micro_batch_size)
        if self.activation_checkpointing:
            order = [(True, layout) for layout in layouts]
        else:
            efficient = [layout for layout in layouts if layout[0] * self.seq_len >= EFFICIENT_MICRO_TOKENS]
            small = [layout for layout in layouts if layout[0] * self.seq_len < EFFICIENT_MICRO_TOKENS]
            order = ([(False, layout) for layout in efficient] + [(True, layout) for layout in efficient]
                     + [(checkpointing, layout) for layout in small for checkpointing in (False, True)])
        rungs = [self.price(strategy, checkpointing, rank, quantized, micro, accum, flags)
                 for checkpointing, (micro, accum) in order]
        return [rung for rung in rungs if rung is not None]

    def best(self, strategy: str, rank: int, quantized: bool, flags: tuple[str, ...], gpu_mem_gib: float
             ) -> tuple[Rung | None, list[MemoryEstimate]]:
        """The first rung of the group that fits, and the estimates tried before it (for the reason)."""
        tried = self.group(strategy, rank, quantized, flags)
        for index, rung in enumerate(tried):
            if rung.estimate.fits(gpu_mem_gib):
                plain = [r.micro_batch_size for r in tried if not r.activation_checkpointing
                         and r.estimate.fits(gpu_mem_gib)]
                if rung.activation_checkpointing and plain:
                    rung = replace(rung, plain_micro_batch_size=max(plain))
                return rung, [r.estimate for r in tried[:index]]
        return None, [r.estimate for r in tried]

    def to_json(self, model: str = "") -> list[dict]:
        """The whole ladder as plain data, in order, each rung with its command and its GiB per GPU by part: the
        first whose `peak_gib` x (1 + ERROR_BAND) is within 90% of a GPU's memory (USABLE_FRACTION) is recommend()'s
        answer for it."""
        rows = []
        for rung in self.rungs():
            e = rung.estimate
            command = Recommendation(rung.strategy, rung.activation_checkpointing, rung.lora_rank, "", e, [],
                                     self.gpus, 0.0, self.precision if isinstance(self.precision, str) else None,
                                     rung.grad_accum, rung, model, self.seq_len).command()
            rows.append(dict(
                strategy=rung.strategy, activation_checkpointing=rung.activation_checkpointing,
                lora_rank=rung.lora_rank, qlora=rung.qlora, micro_batch_size=rung.micro_batch_size,
                grad_accum=rung.grad_accum, flags=list(rung.flags), command=command,
                peak_gib=e.total_gib, peak_phase=e.peak_phase, cpu_gib=e.cpu_bytes / GIB,
                parts_gib={name: getattr(e, field) / GIB for name, field in PARTS}))
        return rows

    def rungs(self) -> list[Rung]:
        """The whole ladder in the order recommend() tries it: for any GPU memory, the first rung that fits is its
        answer."""
        return [rung for rank, quantized, ladder in self.trainings for strategy, flags in ladder
                if not (quantized and strategy not in QLORA_STRATEGIES)
                for rung in self.group(strategy, rank, quantized, flags)]


def recommend(config_like, gpus: int, gpu_mem_gib: float, *, seq_len: int = 1024, micro_batch_size: int | None = None,
              grad_accum: int | None = None, rows_per_gpu: int = DEFAULT_ROWS_PER_GPU,
              activation_checkpointing: bool = False, lora_rank: int = 0, qlora: bool = False,
              precision: BytesPerParam | str = "bf16", attention: str | None = None, interconnect: str = "pcie",
              fast: bool = True, kv_expanded: bool = False, model: str = "") -> Recommendation:
    """The decision tree of the module docstring: the first rung of Ladder that fits. `micro_batch_size` and
    `grad_accum`, when given, fix the batch layout (rows per replica per step = their product); otherwise each rung
    takes the largest micro-batch that fits of `rows_per_gpu` rows per replica per step. `fast`: price and run the
    speed flags each experiment takes (varlen attention, the chunked loss, compiled layers; `kv_expanded`: the
    installed torch's varlen kernel repeats K/V heads); otherwise `attention` (an ATTENTION_KINDS entry, default
    sdpa-packed) is priced as given. `precision` is the --dtype ("bf16", "fp32"), each strategy priced as its
    experiment runs it (strategy_precision), or one BytesPerParam for every strategy. `model` is the --model the
    command names."""
    ladder_ = Ladder(config_like, gpus, seq_len=seq_len, micro_batch_size=micro_batch_size, grad_accum=grad_accum,
                     rows_per_gpu=rows_per_gpu, activation_checkpointing=activation_checkpointing,
                     lora_rank=lora_rank, qlora=qlora, precision=precision, attention=attention,
                     interconnect=interconnect, fast=fast, kv_expanded=kv_expanded)
    shape, rows, on_gpus, trainings = ladder_.shape, ladder_.rows, ladder_.on_gpus, ladder_.trainings
    plain_attention, varlen_attention = ladder_.plain_attention, ladder_.varlen_attention
    price = ladder_.price
    usable_gib = gpu_mem_gib * USABLE_FRACTION
    if qlora and not lora_rank:
        lora_rank = DEFAULT_LORA_RANK
    dtype = precision if isinstance(precision, str) else None

    def best(strategy: str, rank: int, quantized: bool, flags: tuple[str, ...] = ()):
        return ladder_.best(strategy, rank, quantized, flags, gpu_mem_gib)

    def table(rank: int, quantized: bool) -> list[MemoryEstimate]:
        """Every strategy these GPUs can run, each at its best rung for this training (or, where none fits, at one
        micro-batch without checkpointing): the table the CLI prints."""
        if shape.is_moe:
            candidates = ("single",) if gpus == 1 else ("single", "ep")
        elif quantized:
            candidates = ("single",) if gpus == 1 else QLORA_STRATEGIES
        else:
            candidates = ("single", *OFFLOAD_LADDER) if gpus == 1 else tuple(s for s in STRATEGIES[1:] if s != "ep")
        rows_of_table = []
        for strategy in candidates:
            rung = best(strategy, rank, quantized)[0]
            if rung is None:
                micro, accum = _micro_batches(rows, strategy, gpus, micro_batch_size)[-1]
                rung = price(strategy, activation_checkpointing, rank, quantized, micro, accum)
            if rung is not None:
                rows_of_table.append(rung.estimate)
        return rows_of_table

    failures: list[MemoryEstimate] = []
    for rank, quantized, ladder in trainings:
        for strategy, flags in ladder:
            if quantized and strategy not in QLORA_STRATEGIES:
                continue
            rung, misses = best(strategy, rank, quantized, flags)
            if rung is None:
                failures += misses
                continue
            lora_alternative = None
            if strategy in OFFLOAD_LADDER and not rank:
                # Offloading full SFT is slow; LoRA on the GPUs alone is the usual way out, so name it too.
                lora_alternative = next((r.estimate for s, f in on_gpus
                                         for r in [best(s, DEFAULT_LORA_RANK, False, f)[0]] if r), None)
            reason = _explain(rung, failures, shape, usable_gib, lora_rank, qlora, lora_alternative, seq_len)
            if strategy == "fsdp" and rung.grad_accum > 1 and "--reduce-every-micro-batch" not in flags:
                # fsdp-ft's gather-once setting: the whole model gathered for the step, one all-gather per unit per
                # step instead of two per micro-batch; named where it fits the same micro-batch.
                once = estimate(shape, "fsdp", gpus, seq_len=seq_len, micro_batch_size=rung.micro_batch_size,
                                grad_accum=rung.grad_accum, lora_rank=rank, precision=precision,
                                activation_checkpointing=rung.activation_checkpointing,
                                attention=varlen_attention if rung.fast[0] else plain_attention,
                                loss_chunk_tokens=LOSS_CHUNK_TOKENS if rung.fast[1] else 0, compile=rung.fast[2],
                                reshard_after_forward=False)
                if once.fits(gpu_mem_gib):
                    reason += (f"; with memory to spare, --no-reshard-after-forward --no-reshard-after-backward "
                               f"gathers each unit once per step instead of twice per micro-batch "
                               f"({once.total_gib:.1f} GiB per GPU)")
            if strategy == "ep":
                reason = f"{_moe_split(shape, gpus, gpu_mem_gib, rung)}; {reason}"
            return Recommendation(strategy, rung.activation_checkpointing, rank, reason, rung.estimate,
                                  table(rank, quantized), gpus, gpu_mem_gib, dtype, rung.grad_accum, rung, model,
                                  seq_len)
    as_asked = table(*trainings[0][:2])
    if not failures:  # every rung refused these settings (a mixture of experts under LoRA, or E % gpus)
        reason = (f"no strategy takes these settings: a mixture of experts trains every parameter, in single-ft on "
                  f"one GPU or in ep-ft on a number of GPUs that divides its {shape.experts} experts"
                  if shape.is_moe else "no strategy takes these settings")
        return Recommendation(None, activation_checkpointing, lora_rank, reason, None, as_asked, gpus, gpu_mem_gib,
                              dtype, grad_accum or 1, None, model, seq_len)
    smallest = min(failures, key=lambda e: e.total_bytes)
    reason = (f"nothing fits in {usable_gib:.1f} GiB per GPU; the smallest, {_label(smallest)}, needs "
              f"{smallest.needed_gib:.1f} GiB with its margin ({smallest.total_gib:.1f} predicted): shorten --seq-len, "
              f"or add GPUs"
              + (" (ep-ft splits a mixture of experts' experts over them)" if shape.is_moe else ""))
    return Recommendation(None, activation_checkpointing, lora_rank, reason, None, as_asked, gpus, gpu_mem_gib,
                          dtype, grad_accum or 1, None, model, seq_len)


def _moe_split(shape: ModelShape, gpus: int, gpu_mem_gib: float, rung: Rung) -> str:
    """Why a mixture of experts goes to ep-ft: what one GPU would need, and what each GPU holds instead."""
    e = rung.estimate
    single = estimate(shape, "single", seq_len=e.seq_len, micro_batch_size=rung.micro_batch_size,
                      activation_checkpointing=rung.activation_checkpointing,
                      precision=e.precision, grad_accum=rung.grad_accum,
                      loss_chunk_tokens=e.loss_chunk_tokens, compile=e.compiled)
    experts = shape.layers * shape.layer_expert_parameters
    verdict = "does not fit one GPU" if not single.fits(gpu_mem_gib) else "fits one GPU, and ep-ft adds throughput"
    return (f"the whole model ({shape.total_parameters / 1e9:.1f}B parameters, {experts / 1e9:.1f}B of them in "
            f"{shape.experts} experts per layer) {verdict} (single: {single.total_gib:.1f} GiB); ep-ft gives each "
            f"of the {gpus} GPUs {shape.experts // gpus} experts per layer and the "
            f"{(shape.total_parameters - experts) / 1e9:.2f}B dense parameters")


def _label(e: MemoryEstimate) -> str:
    return (e.strategy + (" + activation checkpointing" if e.activation_checkpointing else "")
            + (f" + QLoRA r{e.lora_rank}" if e.qlora else f" + LoRA r{e.lora_rank}" if e.lora_rank else "")
            + (f", micro-batch {e.micro_batch_size}" if e.micro_batch_size > 1 else ""))


def _explain(rung: Rung, failures: list[MemoryEstimate], shape: ModelShape, usable_gib: float, requested_rank: int,
             requested_qlora: bool, lora_alternative: MemoryEstimate | None, seq_len: int) -> str:
    choice = rung.estimate
    parts = []
    lora_fallback = choice.lora_rank and not requested_rank and not requested_qlora
    if failures:
        considered = [e for e in failures if not e.lora_rank] if lora_fallback else failures
        leanest = min(considered or failures, key=lambda e: e.total_bytes)
        parts.append(f"{'full SFT fits nowhere: ' if lora_fallback else ''}the leanest option tried before, "
                     f"{_label(leanest)}, needs {leanest.needed_gib:.2f} GiB per GPU with its margin "
                     f"({leanest.total_gib:.2f} predicted) of {usable_gib:.2f} usable")
    if lora_fallback:
        adapters = shape.lora_parameters(choice.lora_rank)
        base = "a 4-bit base (QLoRA)" if choice.qlora else "a frozen bf16 base"
        parts.append(f"LoRA rank {choice.lora_rank} trains {adapters:,} parameters "
                     f"({adapters / shape.total_parameters:.2%}) on {base}")
    parts.append(WHY[choice.strategy] + ("; --reduce-every-micro-batch reduce-scatters each micro-batch instead of "
                                         "holding its unsharded fp32 gradients" if rung.flags else ""))
    parts.append(f"micro-batch {rung.micro_batch_size} x {seq_len} tokens, {rung.grad_accum} per step "
                 f"(the largest that fits)")
    if choice.activation_checkpointing:
        parts.append(f"with activation checkpointing, which keeps only each layer's input and recomputes the layer "
                     f"in backward (about a third more compute): {choice.activations_bytes / GIB:.1f} GiB of "
                     f"activations" + (f"; without it micro-batch {rung.plain_micro_batch_size} fits, fewer than "
                                       f"{EFFICIENT_MICRO_TOKENS:,} tokens per forward, where a GPU step is host-bound"
                                       if rung.plain_micro_batch_size else ""))
    if choice.cpu_bytes:
        parts.append(f"it needs {choice.cpu_bytes * choice.world_size / GIB:.1f} GiB of host memory in all")
    if lora_alternative:
        parts.append(f"faster, if training adapters instead of all weights is acceptable: {_label(lora_alternative)} "
                     f"({lora_alternative.total_gib:.1f} GiB per GPU)")
    return "; ".join(parts)


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

    if model_shape(config_like).is_moe:  # only ep-ft splits a mixture of experts
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


def format_multi_node(layouts: list[NodeLayout], nodes: int, gpus_per_node: int, gpu_mem_gib: float) -> str:
    lines = [f"across {nodes} nodes x {gpus_per_node} GPUs (torchrun --nnodes={nodes} "
             f"--nproc-per-node={gpus_per_node}), GiB per GPU:"]
    for layout in layouts:
        size = "n/a" if layout.estimate is None else f"{layout.estimate.total_gib:.2f}"
        fits = "-" if layout.estimate is None else ("yes" if layout.estimate.fits(gpu_mem_gib) else "no")
        lines.append(f"  {layout.name:<8}{size:>8}  {fits:<4} {layout.why}")
    chosen = next((layout for layout in layouts if layout.estimate and layout.estimate.fits(gpu_mem_gib)), None)
    lines.append(f"on {nodes} nodes: {chosen.name}: uv run torchrun --nnodes={nodes} --nproc-per-node={gpus_per_node} "
                 f"--rdzv-backend=c10d --rdzv-endpoint=HOST:29500 {chosen.flags}" if chosen else
                 f"on {nodes} nodes: none of these fits; try --activation-checkpointing or --lora-rank")
    return "\n".join(lines)
