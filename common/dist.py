"""Process-group setup, device choice, rank-0 printing, the collective watchdog and teardown.

How a lost rank ends the run under gloo and NCCL: see common/README.md."""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from common.cli import FlagError

# A collective that waits this long for a peer ends the run (PyTorch's NCCL default; why: common/README.md).
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
HEARTBEAT_S = 2.0  # seconds between two heartbeats of a rank (common/README.md)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None when no process group was created (a single plain process)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_created_group = False  # whether init_distributed created the default group (and so teardown destroys it)


def init_distributed(collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, *,
                     group_of_one: bool = False) -> DistInfo:
    """Create the process group under torchrun (or one of one: `group_of_one`); pick the device."""
    global _created_group
    if not collective_timeout_s > 0:
        raise FlagError(f"--collective-timeout-s must be a number of seconds > 0, got {collective_timeout_s}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) are visible: "
                "lower --nproc_per_node or check CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # transformers imports DeepSpeed when it saves: told the accelerator, it does not warn of a missing GPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "WORLD_SIZE" not in os.environ:
        if group_of_one:
            dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
            _created_group = True
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend=None)
    if dist.is_initialized():
        return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                        backend=dist.get_backend())
    if backend == "nccl":
        _enable_nccl_watchdog()
    # device_id binds the NCCL communicator eagerly (no lazy init on the first collective, no warning)
    dist.init_process_group(
        backend=backend,
        timeout=timedelta(seconds=collective_timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    _created_group = True
    if world_size > 1:
        watch_for_lost_ranks(rank, world_size, collective_timeout_s)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def _enable_nccl_watchdog() -> None:
    """NCCL's watchdog and flight recorder variables, set before the group exists."""
    for names, value in (
        # 3: on a timeout or a NCCL error the watchdog ends the process, and torchrun the others
        (("TORCH_NCCL_ASYNC_ERROR_HANDLING",), "3"),
        # the flight recorder: the last 2,000 collectives of every group, dumped per rank on a timeout
        (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000"),
        (("TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"), "1"),
    ):
        for name in names:
            os.environ.setdefault(name, value)


def record_collectives_in(out_dir: str | Path) -> None:
    """On CUDA, NCCL's flight recorder dumps into `<out_dir>/flight_recorder/rank_<r>`."""
    if not torch.cuda.is_available() or not dist.is_initialized():
        return
    prefix = Path(out_dir).resolve() / "flight_recorder" / "rank_"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        os.environ.setdefault(name, str(prefix))


# ---------------------------------------------------------------------------------------------------------------
# gloo: a lost rank ends the run with one line


class _Heartbeat:
    """Every HEARTBEAT_S seconds, add 1 to this rank's counter in the launch's store (torchrun's TCPStore)."""

    def __init__(self, rank: int, world_size: int):
        self.store = dist.PrefixStore("collective-heartbeat/", dist.distributed_c10d._get_default_store())
        self.rank, self.world_size = rank, world_size
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="collective-heartbeat", daemon=True)
        self.thread.start()

    def _beat(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                self.store.add(str(self.rank), 1)
            except Exception:  # the store is gone (the launcher ended): nobody is left to read the counter
                return

    def silent_ranks(self) -> list[int] | None:
        """The ranks whose counter did not move for 2.5 heartbeats; None when the store itself does not answer."""
        def counts():
            return [self.store.add(str(rank), 0) for rank in range(self.world_size)]
        try:
            before = counts()
            time.sleep(2.5 * HEARTBEAT_S)
            after = counts()
        except Exception:
            return None
        return [rank for rank, (a, b) in enumerate(zip(before, after)) if rank != self.rank and a == b]

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=2 * HEARTBEAT_S)  # not forever: a store call in flight can wait on a lost store


_heartbeat: _Heartbeat | None = None


def watch_for_lost_ranks(rank: int, world_size: int, timeout_s: float) -> None:
    """Start this rank's heartbeat and make a collective's failure end the process with lost_rank_line."""
    global _heartbeat
    _heartbeat = _Heartbeat(rank, world_size)
    # a thread inside a store call while C++ objects are destroyed at exit could crash the process
    atexit.register(_stop_heartbeat)
    previous_hook = sys.excepthook

    def report(exc_type, exc, traceback):
        if not is_collective_failure(exc):
            return previous_hook(exc_type, exc, traceback)
        print(lost_rank_line(rank, exc, traceback, timeout_s), file=sys.stderr, flush=True)
        # No teardown: destroying a group waits for its queued collectives, which wait for the lost rank.
        os._exit(1)

    sys.excepthook = report


def is_collective_failure(exc: BaseException) -> bool:
    """A collective's timeout or a lost peer (gloo's transport RuntimeError, or a DistError)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo/transport" in text)


def lost_rank_line(rank: int, exc: BaseException, traceback, timeout_s: float) -> str:
    """One line: this rank, the collective it was in, what went wrong, and who stopped answering."""
    text = str(exc)
    if "Timed out" in text or "timed out" in text:
        what = f"got no answer within --collective-timeout-s {timeout_s:g}"
    elif "closed by peer" in text or "reset by peer" in text:
        what = "lost its connection to a peer (its process is gone)"
    else:
        what = "failed: " + text.splitlines()[0][-200:]
    silent = _heartbeat.silent_ranks() if _heartbeat is not None else None
    who = ("no heartbeat ran to tell which rank stopped" if _heartbeat is None else
           "the launch's store does not answer either" if silent is None else
           f"rank {silent[0]} stopped answering" if len(silent) == 1 else
           f"ranks {', '.join(map(str, silent))} stopped answering" if silent else
           "every other rank still answers its heartbeat")
    return f"rank {rank}: collective {_failed_collective(traceback)} {what}; {who}. Ending the run."


def _failed_collective(traceback) -> str:
    """The flight recorder's last entry (gloo's in torch 2.15), else the torch.distributed call in the traceback."""
    try:
        entries = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(
            includeCollectives=True, onlyActive=False, backend="gloo"))["entries"]
        if entries:
            last = entries[-1]
            tensors = ", ".join(f"{dtype.lower()}[{', '.join(map(str, size))}]"
                                for dtype, size in zip(last["input_dtypes"], last["input_sizes"]))
            return (f"{last['profiling_name']} #{last['collective_seq_id']} of group {last['process_group'][1]} "
                    f"({tensors or 'no tensor'})")
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        pass
    frames = []
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if f"torch{os.sep}distributed" in code.co_filename:
            frames.append(code.co_name)
        traceback = traceback.tb_next
    return frames[-1] if frames else "(unknown)"


# ---------------------------------------------------------------------------------------------------------------


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only (every rank when no process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_ranks(value):
    """Every rank's `value` (any picklable object), in rank order; [value] without a process group."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _stop_heartbeat() -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def teardown() -> None:
    """After a barrier, stop the heartbeat and destroy the group if init_distributed created them."""
    global _created_group
    if _created_group and dist.is_initialized():
        _stop_heartbeat()
        dist.barrier()
        dist.destroy_process_group()
    _created_group = False
