"""What DeepSpeed's engines (zero-ft, pp-ds-ft) need besides the runtime every script shares: a launcher's variables
in a plain process, checkpoints in DeepSpeed's own format, and the model-state bytes a rank holds inside its ZeRO
optimizer.

The engines keep their optimizer state in their own sharded objects, which torch.distributed.checkpoint's
get_state_dict does not understand: they save in DeepSpeed's format, published by common/checkpoint.py's protocol
(written into step-<k>.tmp/, renamed to step-<k>/, checked before a resume).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from common.checkpoint import _check_resumable, _published, _resumed_from, _write_identity, checkpoint_dir, \
    prune_checkpoints
from common.metrics import state_bytes, storage_bytes


def act_as_launcher_if_alone() -> None:
    """Outside torchrun, set torchrun's variables for a world of one (DeepSpeed needs a TCP rendezvous even then)."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def save_deepspeed_checkpoint(out_dir: str | Path, step: int, engine, run: dict | None = None, keep: int = 0) -> Path:
    """engine.save_checkpoint into step-<k>.tmp/, published as step-<k>/; the step rides along as client state."""
    with _published(out_dir, step) as temporary:
        _write_identity(temporary, run)
        # DeepSpeed writes into <save_dir>/<tag>/. No "latest" file: --resume names the folder, and a "latest"
        # naming the .tmp folder would be wrong after the rename anyway. The step fixes the data position.
        engine.save_checkpoint(str(temporary.parent), tag=temporary.name, client_state={"step": step},
                               save_latest=False)
    prune_checkpoints(out_dir, keep)
    return checkpoint_dir(out_dir, step)


def load_deepspeed_checkpoint(path: str | Path, engine) -> int:
    """Restore module, optimizer shards and LR schedule in place from a step-<k> folder; returns k.

    The optimizer shards only fit the layout that wrote them (ZeRO stage, pipeline stages, number of ranks)."""
    path = Path(path)
    _check_resumable(path)
    loaded, client_state = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
    if loaded is None:
        raise SystemExit(f"{path}: DeepSpeed found no checkpoint of this run's layout (stages, number of ranks)")
    _resumed_from.add(path.resolve())
    return client_state["step"]


def deepspeed_state_bytes(engine) -> dict[str, int]:
    """The model-state bytes this rank holds inside DeepSpeed after a step's last backward, before its update, in
    state_bytes' kinds (each storage counted once) plus `buffers` (zero-ft). Where each kind lives then:
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
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # a run that calls this has DeepSpeed loaded

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
