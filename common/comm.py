"""What each strategy's collectives carry per optimizer step, from the model's shape and the run's settings.

The formulas here predict the `collective_bytes_per_step` that torch.profiler measures (common/metrics.py), and the
tests hold each experiment's measured calls and bytes to them. Conventions, the same as the measurement's:
- bytes are those of the buffer one rank hands to the collective: the whole tensor for an all-reduce, a broadcast,
  a send or a receive; the local shard for an all-gather; the full (unreduced) input for a reduce-scatter;
- keys are the logical collectives ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv");
  `as_backend` renames them as a backend runs them (gloo has no reduce-scatter and runs an all-reduce instead);
- what crosses the links follows from the buffer size (`wire_bytes`): a ring all-reduce moves 2 (W-1)/W of its
  buffer through every rank, an all-gather or a reduce-scatter (W-1)/W of the full tensor, a send its buffer.
"""

from __future__ import annotations


def wire_bytes(kind: str, buffer_bytes: float, world_size: int) -> float:
    """Bytes one rank sends (and receives) for a collective handed `buffer_bytes`, with ring algorithms."""
    w = world_size
    if kind == "all_reduce":
        return 2 * (w - 1) / w * buffer_bytes
    if kind == "all_gather":  # the buffer is the local shard; every rank receives the W-1 others
        return (w - 1) * buffer_bytes
    if kind == "reduce_scatter":  # the buffer is the full input; every rank sends W-1 of its W slices
        return (w - 1) / w * buffer_bytes
    if kind in ("broadcast", "send", "recv"):
        return buffer_bytes
    raise ValueError(f"unknown collective {kind!r}")


def as_backend(collectives: dict[str, dict[str, float]], backend: str) -> dict[str, dict[str, float]]:
    """Logical collectives -> the names the backend records (`gloo:all_reduce`, `nccl:reduce_scatter`, ...).

    gloo has no reduce-scatter: torch runs one as an all-reduce of the same full input (then keeps its slice)."""
    result: dict[str, dict[str, float]] = {}
    for kind, entry in collectives.items():
        if backend == "gloo" and kind == "reduce_scatter":
            kind = "all_reduce"
        total = result.setdefault(f"{backend}:{kind}", {"calls": 0, "bytes": 0})
        total["calls"] += entry["calls"]
        total["bytes"] += entry["bytes"]
    return result


# ---------------------------------------------------------------------------------------------------------------
# Data parallel and tensor parallel (ddp, fsdp, zero, tp, tp-sp)


# ---------------------------------------------------------------------------------------------------------------
# Pipeline parallel (pp, pp-ds)
