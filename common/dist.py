"""Process-group setup, device choice, rank-0 printing and teardown.

Every experiment runs either as a plain process (`python train.py`) or under torchrun, which sets RANK,
WORLD_SIZE and LOCAL_RANK. On a GPU machine the backend is NCCL (RCCL on ROCm, where torch.cuda and "nccl" map
to AMD's libraries); on a CPU-only machine it is gloo, so the same scripts and tests run anywhere.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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


def init_distributed(timeout_minutes: int = 30) -> DistInfo:
    """Create the default process group when launched by torchrun; pick this rank's device.

    If a group already exists (a test driver running several configurations in one launch), it is reused.
    """
    global _created_group
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
        # transformers imports DeepSpeed when it saves a model; told the accelerator, DeepSpeed does not print
        # a warning that it is "unable to detect" a GPU this machine does not have.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "WORLD_SIZE" not in os.environ:
        return DistInfo(rank=0, world_size=1, local_rank=0, device=device, backend=None)
    if dist.is_initialized():
        return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                        backend=dist.get_backend())
    # Passing device_id binds the NCCL communicator to this GPU eagerly, which avoids a lazy init on the first
    # collective (and a warning from recent PyTorch); gloo has no such notion.
    dist.init_process_group(
        backend=backend,
        timeout=timedelta(minutes=timeout_minutes),
        device_id=device if backend == "nccl" else None,
    )
    _created_group = True
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, backend=backend)


def act_as_launcher_if_alone() -> None:
    """Outside torchrun, set the variables torchrun would set for a world of one.

    DeepSpeed's engines read LOCAL_RANK and need a real (TCP-rendezvous) process group even for one process, so
    a plain `python train.py` of a DeepSpeed experiment plays its own launcher.
    """
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


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


def teardown() -> None:
    """Destroy the process group if init_distributed created it.

    The barrier first: no rank tears its group down while a peer is still inside a collective, and every
    asynchronous operation (FSDP's reduce-scatters, DDP's bucket all-reduces) has completed on every rank before
    the backend's worker threads are stopped. Without it, fsdp-ft over gloo on a loaded machine sometimes aborted
    after writing its summary ("terminate called without an active exception", SIGABRT).
    """
    global _created_group
    if _created_group and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _created_group = False
