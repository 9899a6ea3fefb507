"""The recorder: step time, comm time, tokens/s, peak memory and MFU; the step line; metrics.jsonl and
summary.json. The definition of every field: see common/README.md."""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import math
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from common.cli import FlagError
from common.checkpoint import checkpoint_step
from common.dist import all_ranks, print0
from common.models import REPO_ROOT, training_flops
from common.step import GarbageCollection

# Kineto (comm_ms's profiler) logs markers and, without a GPU, a false "ERROR" line; 6 silences it (yours wins)
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

# Dense bf16 peak per device, TFLOP/s, from the data sheet named beside each; matched in order as whole words, so a
# variant comes before its card; None: a variant of unknown peak (MFU null). How it was read: common/README.md.
PEAK_BF16_TFLOPS: list[tuple[str, float | None]] = [
    ("H200 NVL", 835.5),  # NVIDIA H200 datasheet: BF16 Tensor Core 1,671 TFLOPS with sparsity
    ("H200", 989.4),  # NVIDIA H200 datasheet: 1,979 with sparsity; the H100 SXM's tensor cores, 989.4 dense
    ("H100 NVL", 835.5),  # NVIDIA H100 datasheet: H100 NVL BF16 Tensor Core 1,671 TFLOPS with sparsity
    ("H100 PCIe", 756.0),  # NVIDIA H100 Tensor Core GPU Architecture whitepaper: 756 dense (PCIe)
    ("H100", 989.4),  # the same whitepaper: SXM5, 989.4 dense
    ("A100", 312.0),  # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)
    ("L40S", 362.05),  # NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS (733 with sparsity)
    ("RTX A6000", 154.8),  # NVIDIA Ampere GA102 GPU Architecture whitepaper: RTX A6000, 154.8 (309.7 with sparsity)
    ("RTX 4090 D", None),  # fewer SMs than the RTX 4090
    ("RTX 4090 Laptop", None),  # an AD103 chip
    ("RTX 4090", 165.2),  # NVIDIA Ada GPU Architecture whitepaper: BF16 with FP32 accumulate 165.2 (330.4 sparse)
    ("RTX 3090 Ti", None),  # more SMs and clock than the RTX 3090
    ("RTX 3090", 71.0),  # NVIDIA Ampere GA102 GPU Architecture whitepaper: BF16 with FP32 accumulate 71 (142 sparse)
    ("MI300X", 1307.4),  # AMD Instinct MI300X data sheet: BF16 1,307.4 TFLOPS dense
    ("MI250X", 191.5),  # AMD Instinct MI250X data sheet: BF16 383 TFLOPS per OAM, two GCDs
    ("MI250", 181.0),  # AMD Instinct MI250 data sheet: BF16 362.1 TFLOPS per OAM, two GCDs
    ("MI210", 181.0),  # AMD Instinct MI210 data sheet: BF16 181 TFLOPS
    ("MI100", 92.3),  # AMD Instinct MI100 data sheet: BF16 92.3 TFLOPS
]


def peak_flops_per_device(device_name: str) -> float | None:
    """Dense bf16 FLOP/s of one device (the first whole-word match in the table), or None when unknown."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name, re.IGNORECASE):
            return None if tflops is None else tflops * 1e12
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None, n_devices: int) -> float | None:
    if peak_flops is None:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * n_devices)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30


def memory_label(device: torch.device) -> str:
    return "max_memory_reserved" if device.type == "cuda" else "peak RSS of the process (CPU)"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def hardware_info(device: torch.device, world_size: int) -> dict:
    return dict(
        device_kind=device.type if device.type == "cpu" else ("rocm" if torch.version.hip else "cuda"),
        device_name=device_name(device),
        device_count=torch.cuda.device_count() if device.type == "cuda" else 1,
        world_size=world_size,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        cpu=_cpu_model(),
        cpu_cores=_cpu_count(),
        python=platform.python_version(),
        packages=_package_versions(),
    )


def _package_versions() -> dict[str, str | None]:
    versions = {}
    for package in ("transformers", "peft", "deepspeed", "datasets", "tokenizers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    return versions


def repository_relative(argv: list[str], root: Path = REPO_ROOT) -> list[str]:
    """The arguments with absolute paths inside the repository made relative to its root."""
    def relative(text: str) -> str:
        if not text.startswith("/"):
            return text
        path = Path(os.path.normpath(text))
        return path.relative_to(root).as_posix() if path.is_relative_to(root) and path != root else text

    result = []
    for argument in argv:
        flag, equals, value = argument.partition("=")
        result.append(f"{flag}={relative(value)}" if equals and flag.startswith("-") else relative(argument))
    return result


def launch_command() -> str:
    """The command line that started this run, launcher included, its paths relative to the repository root."""
    if "LOCAL_WORLD_SIZE" in os.environ:  # set by torchrun
        nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ["LOCAL_WORLD_SIZE"])
        launcher = ["uv", "run", "torchrun", f"--nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}"]
        if nodes > 1:
            launcher.append(f"--nnodes={nodes}")
    else:
        launcher = ["uv", "run", "python"]
    return shlex.join(launcher + repository_relative(sys.argv))


def git_commit(repo: Path) -> str | None:
    """HEAD's hash, with "-dirty" when tracked files have uncommitted changes; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def git_diff_hash(repo: Path) -> str | None:
    """16 hex digits of a SHA-256 of what the tree differs from HEAD by; None when clean."""
    def git(*args: str, cwd: Path) -> bytes:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=True).stdout

    try:
        top = Path(git("rev-parse", "--show-toplevel", cwd=repo).decode().strip())
        diff = git("diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", cwd=top)
        untracked = git("ls-files", "--others", "--exclude-standard", "-z", "--", ".", ":(exclude)devlog/data",
                        cwd=top)
    except (OSError, subprocess.CalledProcessError):
        return None
    if not diff and not untracked:
        return None
    return hashlib.sha256(diff + b"\0untracked:\0" + untracked).hexdigest()[:16]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_count() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


# ---------------------------------------------------------------------------------------------------------------
# Communication time


def _merged_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def collective_ms(profiler) -> float:
    """Milliseconds covered by collectives in a finished torch.profiler run (overlaps merged)."""
    intervals = []
    for event in profiler.profiler.kineto_results.events():
        name = event.name().lower()
        on_device = event.device_type() != torch.autograd.DeviceType.CPU
        if (on_device and ("nccl" in name or "rccl" in name)) or (not on_device and name.startswith("gloo:")):
            intervals.append((event.start_ns() / 1e3, event.end_ns() / 1e3))  # microseconds
    return _merged_length(intervals) / 1000.0


COLLECTIVE_OP_PREFIXES = ("c10d::", "_c10d_functional::")  # eager process-group ops and DTensor's functional ones


def _is_collective_op(name: str) -> bool:
    return name.startswith(COLLECTIVE_OP_PREFIXES) and "wait" not in name


def collective_counts(profiler) -> dict[str, int]:
    """How many collectives of each kind a finished profiler run issued (outermost op only)."""
    # nested: another collective op on its thread is still open when it starts (per thread, by start, longest first)
    ops = sorted((event.start_thread_id(), event.start_ns(), -event.end_ns(), event.name())
                 for event in profiler.profiler.kineto_results.events()
                 if event.device_type() == torch.autograd.DeviceType.CPU and _is_collective_op(event.name()))
    counts: dict[str, int] = {}
    open_ends: list[tuple[int, int]] = []  # (thread, end) of the enclosing collective ops
    for thread, start, negative_end, name in ops:
        while open_ends and (open_ends[-1][0] != thread or open_ends[-1][1] <= start):
            open_ends.pop()
        if not open_ends:
            counts[name] = counts.get(name, 0) + 1
        open_ends.append((thread, -negative_end))
    return counts


BACKEND_EVENT_PREFIXES = ("gloo:", "nccl:")  # the backend's own record of a collective (RCCL reports as nccl)
DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
               "unsigned char": 1, "signed char": 1, "bool": 1, "short int": 2}


def collective_bytes(profiler) -> dict[str, dict[str, int]]:
    """Calls and bytes of every collective the backend ran in a finished profiler run, by name."""
    result: dict[str, dict[str, int]] = {}
    for event in profiler.profiler.kineto_results.events():
        name = event.name()
        if not name.startswith(BACKEND_EVENT_PREFIXES):
            continue
        n_bytes = sum(math.prod(shape) * DTYPE_BYTES.get(dtype, 0)
                      for shape, dtype in zip(event.shapes(), event.dtypes()))
        entry = result.setdefault(name, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += n_bytes
    return result


class CollectiveTimer:
    """Profiles steps [first_step, first_step + n_steps) one at a time: comm_ms, counts and bytes."""

    def __init__(self, device: torch.device, first_step: int, n_steps: int):
        self.device = device
        self.window = range(first_step, first_step + n_steps)
        self.profiler = None
        self.counts: Counter[str] = Counter()  # collectives issued over the profiled steps, by op
        self.bytes: dict[str, Counter[str]] = {}  # backend collectives over the profiled steps: calls and bytes
        self.profiled: list[int] = []  # 1-based numbers of the steps that ran under the profiler

    def start(self, step: int) -> None:
        if not dist.is_initialized() or step not in self.window:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()

    def stop(self, step: int) -> float | None:
        """comm_ms of this step; None when the step was not profiled."""
        if not dist.is_initialized():
            return 0.0
        if self.profiler is None:
            return None
        self.profiler.__exit__(None, None, None)
        value = collective_ms(self.profiler)
        self.counts.update(collective_counts(self.profiler))
        for name, entry in collective_bytes(self.profiler).items():
            self.bytes.setdefault(name, Counter()).update(entry)
        self.profiled.append(step + 1)
        self.profiler = None
        return value

    def collectives_per_step(self) -> dict[str, float] | None:
        """Average number of collectives of each kind per profiled step (None if no step was profiled)."""
        if not self.profiled:
            return None
        return {name: count / len(self.profiled) for name, count in sorted(self.counts.items())}

    def collective_bytes_per_step(self) -> dict[str, dict[str, float]] | None:
        """Per backend collective: calls and bytes per profiled step, on this rank (None if nothing was profiled)."""
        if not self.profiled:
            return None
        return {name: {key: value / len(self.profiled) for key, value in entry.items()}
                for name, entry in sorted(self.bytes.items())}


# ---------------------------------------------------------------------------------------------------------------
# Model-state bytes, summed from the tensors a rank actually holds


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor (FSDP2, tensor parallel), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views of one flat buffer share it)."""
    seen, total = set(), 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = local_tensor(tensor).untyped_storage()
        key = (storage.data_ptr(), storage.device)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def state_bytes(parameters, optimizer: torch.optim.Optimizer | None = None, master=()) -> dict[str, int]:
    """Model-state bytes held by this rank, by kind, as common.memory names them: the weights (every parameter, its
    local shard under FSDP2 or TP), their gradients, the optimizer's state (AdamW's moments and step counters) and
    any separate master copy (`master`: tensors an engine keeps beside the weights, e.g. DeepSpeed's fp32 partition;
    their gradients count as gradients: common/precision.py's masters hold them). Call it after a backward, before
    the optimizer's update (so gradients exist) and after one update (so the optimizer's state exists)."""
    parameters, master = list(parameters), list(master)
    optimizer_tensors = [] if optimizer is None else [
        value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]
    return dict(weights=storage_bytes([*parameters, *quantization_state(parameters)]),
                grads=storage_bytes(p.grad for p in [*parameters, *master]),
                optimizer=storage_bytes(optimizer_tensors), master=storage_bytes(master))


def quantization_state(parameters):
    """The tensors a 4-bit weight keeps in its quant_state (QLoRA's absmaxes, scales, code books)."""
    for parameter in parameters:
        state = getattr(parameter, "quant_state", None)
        while state is not None:
            yield from (value for value in vars(state).values() if isinstance(value, torch.Tensor))
            state = getattr(state, "state2", None)


# ---------------------------------------------------------------------------------------------------------------
# The step line, metrics.jsonl and summary.json

def format_duration(seconds: float) -> str:
    """1m32s, 1h05m, 0m07s: the step line's eta."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def format_step_line(record: dict, total_steps: int, eta_s: float | None = None) -> str:
    def optional(value, fmt):
        return "-" if value is None else format(value, fmt)

    aux = f" | aux {record['aux_loss']:.4f}" if record.get("aux_loss") is not None else ""
    epoch = f" | epoch {record['epoch']:.2f}" if record.get("epoch") is not None else ""
    line = (f"step {record['step']}/{total_steps}{epoch} | loss {record['loss']:.4f}{aux} | lr {record['lr']:.1e} | "
            f"grad_norm {record['grad_norm']:.2f} | step_ms {record['step_ms']:.0f} | "
            f"comm_ms {optional(record['comm_ms'], '.0f')} | tok/s {record['tokens_per_s']:,.0f} | "
            f"mfu {optional(record['mfu'], '.2f')} | mem {record['peak_mem_gib']:.1f} GiB")
    return line if eta_s is None else f"{line} | eta {format_duration(eta_s)}"


def timed_records(records: list[dict], warmup_steps: int, profiled=(), resumed_at: int = 0
                  ) -> tuple[list[dict], list[dict]]:
    """(measured, timed): the records after the warm-up, and those of them not profiled."""
    segments = [records[:resumed_at], records[resumed_at:]] if resumed_at else [records]
    measured = [record for segment in segments for record in segment[warmup_steps:]] or records
    timed = [r for r in measured if r["step"] not in set(profiled)] or measured
    return measured, timed


def flops_averages(timed: list[dict], peak_flops: float | None, n_devices: int) -> dict:
    """flops_per_token and mfu of the timed steps (null where a step has no FLOPs)."""
    tokens, seconds = sum(r["tokens"] for r in timed), sum(r["step_ms"] for r in timed) / 1000.0
    if not timed or any(r.get("flops") is None for r in timed) or not tokens or seconds <= 0:
        return dict(flops_per_token=None, mfu=None)
    flops_per_token = sum(r["flops"] for r in timed) / tokens
    return dict(flops_per_token=flops_per_token, mfu=mfu(tokens / seconds, flops_per_token, peak_flops, n_devices))


@dataclass
class MetricsLogger:
    """Collects one record per optimizer step, prints the step line on rank 0 and writes the results files."""
    out_dir: Path
    total_steps: int
    warmup_steps: int  # the first steps (compilation, allocator growth, caches) left out of the averages
    model_config: PretrainedConfig  # the model trained, for the FLOPs of each step (common/models.py)
    device: torch.device
    world_size: int
    is_main: bool
    lora_rank: int = 0  # --lora-rank (QLoRA's too): the base model is frozen, 4 FLOPs per weight and token, not 6
    head_on_loss_tokens: bool = False  # --loss-chunk-tokens: the LM head runs on the loss tokens only (common/loss.py)
    report_to: str = "none"  # --report-to: "tensorboard" also writes every step's metrics as TensorBoard scalars
    log_every: int = 1  # --log-every: print every N-th step line (and the first and the last); every step is recorded
    steps_per_epoch: float | None = None  # optimizer steps per pass over the training rows: the records' `epoch`
    resume: str | None = None  # --resume's step-<k> folder: in its own run folder, that run's first k records go on

    def __post_init__(self):
        self.out_dir = Path(self.out_dir)
        self.records: list[dict] = self._records_before_resume()
        self.resumed_at = len(self.records)  # records of the run before this process (they had their own warm-up)
        self.writer = None
        self.check_report_to(self.report_to)
        if self.report_to == "tensorboard" and self.is_main:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops what an earlier process logged after the checkpoint's step.
            self.writer = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"),
                                        purge_step=self.records[-1]["step"] + 1 if self.records else None)
        self.wall_s: list[float] = []  # wall time from one step line to the next (data loading and eval included)
        self._last_line: float | None = None
        self.flops = training_flops(self.model_config, self.lora_rank)
        self.peak_flops = peak_flops_per_device(device_name(self.device)) if self.device.type == "cuda" else None
        self._peak_notice = None
        if self.device.type == "cuda" and self.peak_flops is None:
            self._peak_notice = (f"mfu: no dense bf16 peak for {device_name(self.device)} in common/metrics.py's "
                                 f"PEAK_BF16_TFLOPS, so MFU is null (add the device's data-sheet figure to get it)")
        # the collector's time between two step lines (gc_ms): a slow step told apart from a slow kernel
        self._gc_s, self._gc_started = 0.0, None
        gc.callbacks.append(self._time_gc)
        self._frames_compiled = frames_compiled()
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            # replaced whole, never truncated in place: other ranks of a resumed run read it now
            fresh = self.out_dir / "metrics.jsonl.tmp"
            fresh.write_text("".join(json.dumps(record) + "\n" for record in self.records))
            fresh.replace(self.out_dir / "metrics.jsonl")

    def _records_before_resume(self) -> list[dict]:
        """Resuming in the checkpoint's own run folder: its records up to the checkpoint's step; else none."""
        if self.resume is None or Path(self.resume).parent.parent.resolve() != self.out_dir.resolve():
            return []
        step = checkpoint_step(self.resume)
        file = self.out_dir / "metrics.jsonl"
        lines = file.read_text().splitlines() if file.exists() else []
        return [record for line in lines if line.strip() and (record := json.loads(line))["step"] <= step]

    def _time_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_s += time.perf_counter() - self._gc_started
            self._gc_started = None

    @staticmethod
    def check_report_to(report_to: str) -> None:
        """Stops with one line when --report-to cannot work here; each experiment calls it before anything loads."""
        if report_to not in ("none", "tensorboard"):
            raise FlagError(f"--report-to must be none or tensorboard, got {report_to!r}")
        if report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
            raise SystemExit("--report-to tensorboard needs the tensorboard package: uv sync --group tensorboard")

    def log_step(self, step: int, loss: float, lr: float, grad_norm: float, tokens: int, loss_tokens: int,
                 step_ms: float, comm_ms: float | None, print_fn=print, extra: dict | None = None,
                 documents: list[int] | None = None) -> dict:
        """The record of one step (tokens, loss tokens, documents: the whole step's), printed and written."""
        if documents is not None and sum(documents) != tokens:
            raise ValueError(f"log_step: the step's documents hold {sum(documents):,} tokens, not its {tokens:,}")
        tokens_per_s = tokens / (step_ms / 1000.0)
        flops = None if documents is None else \
            self.flops.of_documents(documents, loss_tokens if self.head_on_loss_tokens else None)
        compiled = frames_compiled()
        record = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=tokens, loss_tokens=loss_tokens,
                      step_ms=step_ms, comm_ms=comm_ms, tokens_per_s=tokens_per_s,
                      peak_mem_gib=peak_memory_gib(self.device),
                      mfu=None if flops is None or not tokens else mfu(tokens_per_s, flops / tokens, self.peak_flops,
                                                                         self.world_size),
                      flops=flops, gc_ms=self._gc_s * 1000.0, compiles=compiled - self._frames_compiled,
                      **(extra or {}))
        if self.steps_per_epoch:
            record["epoch"] = step / self.steps_per_epoch
        self._gc_s, self._frames_compiled = 0.0, compiled
        self.records.append(record)
        now = time.perf_counter()
        self.wall_s.append(step_ms / 1000.0 if self._last_line is None else now - self._last_line)
        self._last_line = now
        if self.is_main:
            with open(self.out_dir / "metrics.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            if self._peak_notice:
                print_fn(self._peak_notice)
                self._peak_notice = None
            first = len(self.records) == self.resumed_at + 1  # this process's first step
            if step == 1 or step % self.log_every == 0 or step == self.total_steps or first:
                print_fn(format_step_line(record, self.total_steps, self.eta_s(step)))
            if first:
                print_fn(self.first_line_notes(record))
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "step_ms", "comm_ms", "tokens_per_s", "mfu", "peak_mem_gib"):
                if record[key] is not None:
                    self.writer.add_scalar(f"train/{key}", record[key], step)
        return record

    def first_line_notes(self, record: dict) -> str:
        """Under the first step line: what its fields measure, and why a `-` stands where a number would."""
        notes = [f"mem: {memory_label(self.device)}"]
        if record["comm_ms"] is None:
            notes.append("comm_ms -: not measured on this step (torch.profiler times the collectives on the steps "
                         "after the timing warm-up, --comm-profile-steps of them)")
        if record["mfu"] is None and self.device.type != "cuda":  # an unknown GPU's notice came before the line
            notes.append(f"mfu -: unknown, no dense bf16 peak is listed for {device_name(self.device)} "
                         f"(common/metrics.py)")
        if self.log_every > 1:
            notes.append(f"a line every {self.log_every} steps (--log-every); metrics.jsonl has every step")
        return "  (" + "; ".join(notes) + ")"

    def outputs(self) -> str:
        """Where this run's files went: results, TensorBoard logs, checkpoints (the export prints its own line)."""
        lines = [f"results: {self.out_dir}/metrics.jsonl, {self.out_dir}/summary.json"]
        if self.report_to == "tensorboard":
            lines.append(f"tensorboard: {self.out_dir / 'tensorboard'} (view: tensorboard --logdir {self.out_dir})")
        steps = sorted(self.out_dir.glob("checkpoints/step-*[0-9]"), key=checkpoint_step)
        if steps:
            lines.append(f"checkpoints: {steps[-1]} is the newest (continue: --resume {self.out_dir})")
        return "\n".join(lines)

    def log_eval(self, step: int, loss: float | None) -> None:
        """The held-out loss after optimizer step `step` (TensorBoard's eval/loss; the step line prints it)."""
        if self.writer is not None and loss is not None:
            self.writer.add_scalar("eval/loss", loss, step)

    def eta_s(self, step: int) -> float:
        """Time left: steps to go x the mean wall time per step after the warm-up (evaluation and loading in)."""
        recent = self.wall_s[self.warmup_steps:] or self.wall_s
        return max(0, self.total_steps - step) * sum(recent) / len(recent)

    def averages(self, profiled: list[int] = ()) -> dict:
        """Means over the measured steps; the `profiled` ones (1-based) give comm_ms only."""
        measured, timed = timed_records(self.records, self.warmup_steps, profiled, self.resumed_at)
        result = {}
        for key in ("step_ms", "comm_ms"):
            values = [r[key] for r in (measured if key == "comm_ms" else timed) if r[key] is not None]
            result[key] = sum(values) / len(values) if values else None
        # total tokens over total time: a mean of per-step rates would overstate throughput
        seconds = sum(r["step_ms"] for r in timed) / 1000.0
        result["tokens_per_s"] = sum(r["tokens"] for r in timed) / seconds if timed and seconds > 0 else None
        result.update(flops_averages(timed, self.peak_flops, self.world_size))
        if measured:
            result["peak_mem_gib"] = max(r["peak_mem_gib"] for r in measured)
        profiled_records = [r for r in measured if r["step"] in set(profiled)]
        result["measured_steps"] = len(measured)
        result["warmup_steps_excluded"] = len(self.records) - len(measured)
        result["timed_steps"] = len(timed)
        result["profiled_steps"] = sorted(profiled)
        result["profiled_step_ms"] = (sum(r["step_ms"] for r in profiled_records) / len(profiled_records)
                                      if profiled_records else None)
        tokens_per_s = result["tokens_per_s"]
        result["tokens_per_s_per_device"] = None if tokens_per_s is None else tokens_per_s / self.world_size
        result["warmup_steps_observed"] = steps_until_settled([r["step_ms"] for r in self.records])
        result["gc_ms_total"] = sum(r["gc_ms"] for r in self.records)
        result["gc_ms_max"] = max((r["gc_ms"] for r in self.records), default=None)
        result["compiled_frames"] = sum(r["compiles"] for r in self.records)
        result["recompiles"] = sum(r["compiles"] for r in self.records[1:])
        return result

    def write_summary(self, comm_timer: CollectiveTimer | None = None, **fields) -> dict:
        """Writes summary.json: the caller's fields, the averages and `comm_timer`'s collectives per step."""
        if self._time_gc in gc.callbacks:  # the steps are over; several runs in one process must not pile up timers
            gc.callbacks.remove(self._time_gc)
        summary = dict(fields)
        profiled = comm_timer.profiled if comm_timer else []
        if comm_timer is not None:
            summary["collectives_per_step"] = comm_timer.collectives_per_step()
            summary["collective_bytes_per_step"] = comm_timer.collective_bytes_per_step()
        summary.update(self.averages(profiled))
        summary["lm_head_flops_on"] = "loss tokens" if self.head_on_loss_tokens else "every token"
        # every token attending to its whole row: the count of tools that do not see documents
        dense = (fields.get("model") or {}).get("flops_per_token")
        summary["mfu_dense"] = (None if dense is None or summary["tokens_per_s"] is None else
                                mfu(summary["tokens_per_s"], dense, self.peak_flops, self.world_size))
        summary["final_loss"] = self.records[-1]["loss"] if self.records else None
        summary["epochs"] = self.records[-1].get("epoch") if self.records else None  # passes over the training rows
        summary["memory_measure"] = memory_label(self.device)
        if self.device.type == "cuda":
            # the tensors' own peak; the rest of max_memory_reserved is the caching allocator's
            summary["peak_mem_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if self.is_main:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            print0(self.outputs())
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        return summary


SUMMARY_TABLE_FIELDS = ("step_ms", "comm_ms", "tokens_per_s", "tokens_per_s_per_device", "peak_mem_gib", "mfu",
                        "t_eff", "final_loss", "eval_loss", "packing_efficiency", "n_conversations", "n_truncated")


def summary_table(summary: dict) -> str:
    """A markdown table of a summary.json's headline numbers (the closing table, and devlog tables)."""
    lines = ["| metric | value |", "|---|---|"]
    for key in SUMMARY_TABLE_FIELDS:
        value = summary.get(key)
        if value is None:
            text = "-"
        elif isinstance(value, float):
            text = f"{value:,.4f}" if abs(value) < 10 else f"{value:,.1f}"
        else:
            text = f"{value:,}" if isinstance(value, int) else str(value)
        lines.append(f"| {key} | {text} |")
    return "\n".join(lines)


def frames_compiled() -> int:
    """Frames torch.compile has compiled in this process so far (0 when it was never imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.counters["frames"]["ok"] if utils is not None else 0


def steps_until_settled(step_ms: list[float], factor: float = 1.5) -> int | None:
    """How many leading steps are slower than `factor` x the second half's median (None under 4 steps)."""
    if len(step_ms) < 4:
        return None
    later = sorted(step_ms[len(step_ms) // 2:])
    settled = later[len(later) // 2]
    return next((index for index, ms in enumerate(step_ms) if ms <= factor * settled), len(step_ms))


class StepClock:
    """One optimizer step's time. On a GPU two CUDA events bracket the step on the device's queue, so reading the clock
    costs no synchronisation of its own: `stop()` goes before the step's one host read, and once that read has
    returned, the end event has completed too. On a CPU, perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.begin = self.end = None
        self.started = self.stopped = 0.0

    def start(self) -> None:
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record()
        else:
            self.stopped = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.cuda:
            self.end.synchronize()  # done already when the step's host read came after stop(): no wait
            return self.begin.elapsed_time(self.end)
        return (self.stopped - self.started) * 1000.0


def expert_load(records: list[dict]) -> dict | None:
    """Tokens per expert and layer, and each layer's max over mean (1.0: even); None for a dense model."""
    steps = [record["expert_tokens"] for record in records if "expert_tokens" in record]
    if not steps:
        return None
    load = [[sum(column) for column in zip(*layers)] for layers in zip(*steps)]
    per_layer = []
    for counts in load:
        mean = sum(counts) / len(counts)
        per_layer.append(max(counts) / mean if mean else None)
    known = [value for value in per_layer if value is not None]
    return dict(imbalance_per_layer=per_layer, imbalance_mean=sum(known) / len(known) if known else None,
                imbalance_max=max(known) if known else None, tokens_per_expert=load)


class Recorder:
    """A run's measurement behind one object, the same in every experiment: the step clock, the collective timer,
    the GC schedule, the model-state bytes and summary.json. `rows_per_step`: the whole step's rows, all ranks.
    How a loop uses it: common/README.md."""

    def __init__(self, experiment: str, config, device: torch.device, model_config, data, rows_per_step: int, *,
                 world_size: int = 1, rank: int = 0, steps_per_epoch: float | None = None, start_step: int = 0,
                 script_dir: Path | None = None, n_parameters: int | None = None,
                 n_trainable: int | None = None, flops_per_token: float | None = None):
        self.experiment, self.config, self.device, self.data = experiment, config, device, data
        self.rows_per_step, self.world_size, self.script_dir = rows_per_step, world_size, script_dir
        self.model = dict(name=config.model, parameters=n_parameters, trainable_parameters=n_trainable,
                          flops_per_token=flops_per_token)
        self.metrics = MetricsLogger(
            out_dir=config.out_dir, total_steps=config.steps,
            warmup_steps=min(config.timing_warmup_steps, max(0, config.steps - 1)), model_config=model_config,
            lora_rank=config.lora_rank, head_on_loss_tokens=getattr(config, "loss_chunk_tokens", 0) > 0,
            device=device, world_size=world_size, is_main=rank == 0,
            report_to=config.report_to, log_every=config.log_every, steps_per_epoch=steps_per_epoch,
            resume=getattr(config, "resume", None))
        self.comm = CollectiveTimer(device, first_step=config.timing_warmup_steps, n_steps=config.comm_profile_steps)
        self.clock = StepClock(device)
        # Model-state bytes are counted once, on the second step, after its backward and before its update: the
        # gradients exist, and so does the optimizer state, created by the first update.
        self.state_step = min(start_step + 1, config.steps - 1)
        self.measured_state = None
        self.eval_history: list[tuple[int, float | None]] = []  # (step, held-out loss) of the --eval-every evaluations
        # from here on the garbage collector runs between steps, never inside one
        self.collector = GarbageCollection()

    @property
    def records(self) -> list[dict]:
        return self.metrics.records

    def start(self, step: int) -> None:
        self.collector.step(step)  # every few steps, a young-generation collection: before the clock starts
        self.comm.start(step)
        self.clock.start()

    def state(self, step: int, parameters=(), optimizer=None, master=(), count=None) -> None:
        """On the state step: the bytes of every weight, gradient and optimizer tensor here (or `count()`)."""
        if step == self.state_step:
            self.measured_state = count() if count is not None else state_bytes(parameters, optimizer, master)

    def stop(self) -> None:
        self.clock.stop()

    def step(self, step: int, loss: float, lr: float, grad_norm: float, extra: dict | None = None) -> dict:
        """After the step's host read: the record of optimizer step `step` (0-based), its line printed on rank 0."""
        step_ms = self.clock.elapsed_ms()
        comm_ms = self.comm.stop(step)
        rows = self.rows_per_step
        return self.metrics.log_step(step + 1, loss, lr, grad_norm, self.data.step_real_tokens(step, rows),
                                     self.data.step_loss_tokens(step, rows), step_ms, comm_ms, print_fn=print0,
                                     extra=extra, documents=self.data.step_documents(step, rows))

    def eval(self, step: int, loss: float | None) -> None:
        """The held-out loss after step `step`, printed and logged (before the last step: eval_history)."""
        self.metrics.log_eval(step, loss)
        loss_text = "no held-out conversations (--eval-fraction 0)" if loss is None else f"loss {loss:.4f}"
        if step < self.config.steps:
            self.eval_history.append((step, loss))
            print0(f"eval step {step}: {loss_text}")
        else:
            print0(f"eval: {loss_text}" + (f" over {self.data.stats['n_eval_conversations']} held-out conversations"
                                            if loss is not None else ""))

    def finish(self, **fields) -> dict:
        """summary.json, written and printed by rank 0; every rank calls it. `fields`: the strategy's own."""
        self.collector.close()
        fields.setdefault("eval_history", self.eval_history)
        if (load := expert_load(self.records)) is not None:  # a mixture of experts: tokens per expert, imbalance
            fields.setdefault("expert_load", load)
        stats = self.data.stats
        measured = self.measured_state
        gathered = all_ranks(measured)
        summary = self.metrics.write_summary(
            comm_timer=self.comm, experiment=self.experiment, command=launch_command(),
            commit=git_commit(self.script_dir) if self.script_dir else None,
            commit_diff=git_diff_hash(self.script_dir) if self.script_dir else None, config=asdict(self.config),
            hardware=hardware_info(self.device, world_size=self.world_size), model=self.model,
            t_eff=self.rows_per_step * self.config.seq_len,
            state_bytes_per_rank=None if measured is None else gathered,
            state_bytes_step=None if measured is None else self.state_step + 1,  # 1-based, as in metrics.jsonl
            packing_efficiency=stats["packing_efficiency"], n_conversations=stats["n_conversations"],
            n_truncated=stats["n_truncated"], data=stats, garbage_collection=self.collector.summary(), **fields)
        print0(f"\nsummary ({summary['measured_steps']} measured steps, {summary['warmup_steps_excluded']} warm-up "
               f"excluded; memory: {summary['memory_measure']}) -> {self.config.out_dir}\n{summary_table(summary)}")
        return summary
