"""What each strategy's collectives carry per optimizer step, from the model's shape and the run's settings.

The formulas here predict the `collective_bytes_per_step` that torch.profiler measures (common/metrics.py), and the
tests hold each experiment's measured calls and bytes to them. No training run calls them: `predict_collectives`
computes a recorded run's from its summary.json (config, world size, the model rebuilt on the meta device).
Conventions, the same as the measurement's:
- bytes are those of the buffer one rank hands to the collective: the whole tensor for an all-reduce, a broadcast,
  a send or a receive; the local shard for an all-gather; the full (unreduced) input for a reduce-scatter;
- keys are the logical collectives ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv");
  `as_backend` renames them as a backend runs them (gloo has no reduce-scatter and runs an all-reduce instead);
- what crosses the links follows from the buffer size (`wire_bytes`): a ring all-reduce moves 2 (W-1)/W of its
  buffer through every rank, an all-gather or a reduce-scatter (W-1)/W of the full tensor, a send its buffer.
"""

from __future__ import annotations

import functools
import math

from common.memory import DEEPSPEED_MAX_LIVE_PARAMETERS, DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD, \
    DEEPSPEED_PREFETCH_BUCKET_ELEMENTS, DEEPSPEED_REDUCE_BUCKET_ELEMENTS, EXPERIMENT_STRATEGY, run_model


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
    if kind == "all_to_all":  # the buffer is what this rank sends; its own block stays (evenly spread: 1/W of it)
        return (w - 1) / w * buffer_bytes
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
#
# Symbols: W ranks; m micro-batches per optimizer step (--grad-accum); Psi trainable parameters (psi_p of parameter
# p); L decoder layers; d hidden size; V vocabulary; T = b s tokens of one micro-batch (b rows of s tokens); e bytes
# of an element (4 fp32, 2 bf16). Bytes are those of the buffer one rank hands to the collective (module docstring);
# every function is for one rank and one optimizer step in the steady state, which is what the experiments profile.
# The step-loss all-reduce (4 bytes) is counted where the experiment issues it (ddp, fsdp, zero: each rank holds the
# loss of its own rows; tp: every rank holds the whole loss, no collective).


def _add(result: dict, kind: str, calls: float, n_bytes: float) -> None:
    if calls:
        entry = result.setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += calls
        entry["bytes"] += n_bytes


def ddp_buckets(grad_bytes: list[int], bucket_cap_bytes: int, first_bucket_bytes: int | None = None) -> list[int]:
    """Bytes of each of DDP's gradient buckets, as its Reducer assigns them (torch's compute_bucket_assignment_by_size):
    the gradients in the order backward produces them, each bucket closed as soon as it holds at least its cap; the
    first bucket's cap is `first_bucket_bytes` (dist._DEFAULT_FIRST_BUCKET_BYTES, 1 MiB, only when
    DistributedDataParallel is given no bucket_cap_mb; ddp-ft always gives one, so there the first cap is the cap)."""
    caps = [bucket_cap_bytes if first_bucket_bytes is None else first_bucket_bytes, bucket_cap_bytes]
    buckets, current = [], 0
    for size in grad_bytes:
        current += size
        if current >= caps[min(len(buckets), 1)]:
            buckets.append(current)
            current = 0
    return buckets + ([current] if current else [])


def ddp_collectives(grad_bytes: list[int], *, bucket_cap_bytes: int, grad_accum: int,
                    reduce_every_micro_batch: bool = False, first_bucket_bytes: int | None = None,
                    sent_per_byte: int = 1) -> dict[str, dict[str, float]]:
    """ddp-ft: the gradient all-reduces, bucket by bucket, and the step loss.

    `grad_bytes`: the trainable parameters' gradient bytes in the order backward produces them. DDP's first
    synchronised backward reduces one bucket of everything (without find_unused_parameters torch does not bucket
    before it has seen the order); the next forward rebuilds the buckets in the order the gradients arrived (two
    small broadcasts of the new assignment, once). For a decoder that order is the reverse of the parameters'
    registration order, which is what ddp-ft passes (the order inside a layer differs a little; it moves a bucket
    boundary only when a cap falls between two of the reordered tensors).
        all_reduce   k n_b + 1 calls, k 4 Psi + 4 bytes
    with k = 1 (no_sync() on all but the last micro-batch) or m (--reduce-every-micro-batch: every backward
    all-reduces every bucket), n_b = len(ddp_buckets(...)) ~ ceil(4 Psi / C) for --bucket-cap-mb C, and the last
    call the 4-byte step loss. Each rank sends 2 (W-1)/W of those bytes (a ring all-reduce, `wire_bytes`).
    `sent_per_byte`: bytes all-reduced per byte of a bucket, 2 where the buckets are of bf16 weights and carry their
    fp32 masters' gradients (--dtype bf16, common/precision.py): the same 4 Psi, in buckets of twice as many
    gradients.
    """
    buckets = ddp_buckets(grad_bytes, bucket_cap_bytes, first_bucket_bytes)
    reductions = grad_accum if reduce_every_micro_batch else 1
    result: dict[str, dict[str, float]] = {}
    _add(result, "all_reduce", reductions * len(buckets), reductions * sum(buckets) * sent_per_byte)
    _add(result, "all_reduce", 1, 4)
    return result


def fsdp_shard_numel(shape: tuple[int, ...], world_size: int) -> int:
    """Elements of one rank's FSDP2 shard of a parameter: dim 0 split in W, padded up to a multiple of W."""
    rows = -(-shape[0] // world_size) if shape else 1
    return rows * math.prod(shape[1:])


def fsdp_collectives(units: list[list[tuple[tuple[int, ...], bool]]], *, world_size: int, grad_accum: int,
                     reshard_after_forward: bool, reduce_every_micro_batch: bool, gather_bytes: int,
                     reduce_bytes: int = 4, reshard_after_backward: bool = True) -> dict[str, dict[str, float]]:
    """fsdp-ft (FSDP2): per unit, all-gathers of its shards and a reduce-scatter of its gradients; the gradient norm
    and the step loss.

    `units`: each FSDP unit's parameters as (shape, trainable), the root (embedding, final norm, tied LM head) first,
    then the N - 1 decoder layers. A unit's all-gather hands over its shard, a_u = sum_p ceil(rows_p / W) cols_p
    elements (FSDP2 pads dim 0 to a multiple of W); its reduce-scatter the full padded gradient of its trainable
    parameters, r_u = W sum_p ceil(rows_p / W) cols_p elements. Per optimizer step, for N units:
        all_gather      m (N + [reshard] (N - 1)) calls, m e (sum_u a_u + [reshard] sum_{u != root} a_u) bytes
                        forward gathers every unit; backward gathers the layers again when they were resharded after
                        forward (--reshard-after-forward, the default); the root is never resharded after forward.
                        Every micro-batch starts resharded (backward reshards all units). e is the gather dtype: 2
                        under --dtype bf16 (MixedPrecisionPolicy casts the shards before the all-gather), else 4.
                        With --no-reshard-after-forward --no-reshard-after-backward nothing is resharded before the
                        step's last backward: N calls, e sum_u a_u bytes, once per step whatever m.
        reduce_scatter  k N_t calls, k 4 sum_u r_u bytes (in fp32, the reduce dtype; N_t units with trainable
                        parameters), k = 1, or m with --reduce-every-micro-batch
        all_reduce      2 calls, 4 n + 4 bytes: clip_grad_norm_'s one fp32 partial norm per trainable tensor (n of
                        them), summed in one all-reduce, and the step loss
    Without LoRA, sum_u a_u = Psi/W and sum_u r_u = Psi (up to padding). One rank sends (`wire_bytes`)
    (W-1)/W e g Psi for the all-gathers (g gathers of the model per step: about 2m with resharding, m without, 1
    gathering once) and (W-1)/W 4 Psi for the reduce-scatters (fp32), against DDP's 2 (W-1)/W 4 Psi (fp32). Leaving
    out the root's saved gather: in fp32 with resharding, (2m + 1)/2 times DDP's traffic (1.5 at m = 1); under bf16
    (e = 2) with resharding (m + 1)/2 times (DDP's bytes at m = 1), without (m + 2)/4, gathering once 3/4.
    A step right after an evaluation (--eval-every) gathers less: a forward without backward leaves units gathered
    (the root always, every unit without reshard-after-forward) for the next forward to use.
    """
    if not reshard_after_backward and reshard_after_forward:
        raise ValueError("reshard_after_backward=False keeps the weights between micro-batches only with "
                         "reshard_after_forward=False")
    reductions = grad_accum if reduce_every_micro_batch else 1
    gathers = grad_accum if reshard_after_backward else 1  # forwards that find the units resharded
    gathered = [sum(fsdp_shard_numel(shape, world_size) for shape, _ in unit) for unit in units]
    reduced = [world_size * sum(fsdp_shard_numel(shape, world_size) for shape, trainable in unit if trainable)
               for unit in units]
    n_trainable = sum(trainable for unit in units for _, trainable in unit)
    result: dict[str, dict[str, float]] = {}
    _add(result, "all_gather", gathers * len(units), gathers * gather_bytes * sum(gathered))
    if reshard_after_forward:
        _add(result, "all_gather", grad_accum * (len(units) - 1), grad_accum * gather_bytes * sum(gathered[1:]))
    _add(result, "reduce_scatter", reductions * sum(1 for r in reduced if r), reductions * reduce_bytes * sum(reduced))
    _add(result, "all_reduce", 1, 4 * n_trainable)
    _add(result, "all_reduce", 1, 4)
    return result


def zero_bucket_flushes(numels: list[int], bucket_elements: int) -> int:
    """How many reductions DeepSpeed's gradient bucket (reduce_bucket_size elements) makes of gradients arriving in
    this order: a gradient that would overflow a non-empty bucket first sends the bucket (stage_1_and_2.py and
    stage3.py, reduce_independent_p_g_buckets_and_remove_grads); what is left is sent at the end of backward."""
    flushes, filled = 0, 0
    for numel in numels:
        if filled and filled + numel > bucket_elements:
            flushes, filled = flushes + 1, 0
        filled += numel
    return flushes + (1 if filled else 0)


def zero_collectives(stage: int, *, group_numels: list[int], reduction_numels: list[int],
                     parameter_numels: list[int], world_size: int, grad_accum: int, bf16: bool,
                     reduce_bytes: int = 4, reduce_bucket_elements: int = DEEPSPEED_REDUCE_BUCKET_ELEMENTS,
                     prefetch_bucket_elements: int = DEEPSPEED_PREFETCH_BUCKET_ELEMENTS,
                     persistence_threshold: int = DEEPSPEED_PARAM_PERSISTENCE_THRESHOLD,
                     max_live_parameters: int = DEEPSPEED_MAX_LIVE_PARAMETERS) -> dict[str, dict[str, float]] | None:
    """zero-ft (DeepSpeed ZeRO, fp32 gradient communication as zero-ft configures it): what DeepSpeed 0.19 runs,
    with the DeepSpeed defaults zero-ft leaves alone (common.memory names them).

    `group_numels`: the trainable elements of each of the G optimizer parameter groups; `reduction_numels`: the
    trainable parameters' sizes in the order their gradients are reduced (stage 1: the groups' order, at the
    accumulation boundary; stages 2 and 3: as backward produces them, the reverse of registration order);
    `parameter_numels`: every parameter's size, frozen ones included (stage 3 partitions and gathers all of them);
    `bf16`: DeepSpeed's bf16 mode, whose module weights (and so the all-gathers) are bf16, e = 2 bytes (else 4). f =
    the number of gradient-bucket reductions, zero_bucket_flushes(reduction_numels, 5e8 elements): 1 up to 5e8.
    Stages 1 and 2 (stage_1_and_2.py; despite its name, its default "reduce_scatter" path all-reduces the bucket and
    each rank keeps its own slice, use_multi_rank_bucket_allreduce):
        all_reduce   k f + G + 1 calls, k 4 Psi + 4 G + 4 bytes: the gradients (k = 1 for stage 1, which reduces
                     once at the boundary; k = m for stage 2, which reduces each micro-batch's gradients as backward
                     produces them and accumulates only its own partition), one fp32 squared norm per parameter
                     group, the step loss; under bf16 one more call of 1 byte, the overflow flag (bf16's
                     check_grad_overflow, on by default)
        all_gather   G calls, e sum_g P_g bytes: after the update, each group's updated partition, P_g =
                     ceil(Psi_g / 2W) 2 elements (DeepSpeed aligns the flat group to 2 W elements)
    Stage 3 (stage3.py, partition_parameters.py): parameters of at most 1e5 elements (norms, and small projections)
    are "persistent": kept whole on every rank, re-gathered after each update. The others are gathered for compute;
    when all of them (Psi_np elements) fit one prefetch bucket (5e7 elements), the first module's prefetch gathers
    them all in one coalesced call and none is released before backward (their reuse distance is below
    max_reuse_distance), so each micro-batch gathers them once:
        all_gather      m + N_p calls, m e sum_np ceil(psi/W) + e sum_p ceil(psi/W) bytes (N_p persistent ones, one
                        call each)
        reduce_scatter  m f calls, m 4 W sum_t ceil(psi_t/W) bytes: every trainable gradient, padded to W slices
        all_reduce      G + 1 calls, 8 G + 4 bytes: one fp64 squared norm per parameter group, the step loss
    Returns None where the config alone does not decide the collectives: stage 3 when the gathered parameters exceed
    one prefetch bucket or max_live_parameters (which layers DeepSpeed then releases and gathers again in backward
    follows from its recorded trace of the modules, partitioned_param_coordinator.py); stage 1 under bf16, which
    DeepSpeed runs through another optimizer (BF16_Optimizer, for fp32 gradient accumulation) and the engine's own
    bucketed all-reduce, not modelled here.
    """
    if stage == 1 and bf16:
        return None
    weight_bytes = 2 if bf16 else 4
    psi = sum(group_numels)
    flushes = zero_bucket_flushes(reduction_numels, reduce_bucket_elements)
    groups = len(group_numels)
    result: dict[str, dict[str, float]] = {}
    if stage in (1, 2):
        reductions = 1 if stage == 1 else grad_accum
        _add(result, "all_reduce", reductions * flushes, reductions * reduce_bytes * psi)
        _add(result, "all_reduce", groups, 4 * groups)
        _add(result, "all_reduce", 1 if bf16 else 0, 1)
        _add(result, "all_reduce", 1, 4)
        alignment = 2 * world_size
        partitions = [-(-numel // alignment) * alignment // world_size for numel in group_numels]
        _add(result, "all_gather", groups, weight_bytes * sum(partitions))
        return result
    if stage != 3:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    persistent = [n for n in parameter_numels if n <= persistence_threshold]
    gathered = [n for n in parameter_numels if n > persistence_threshold]
    if sum(gathered) > prefetch_bucket_elements or sum(parameter_numels) > max_live_parameters:
        return None

    def shard(numel: int) -> int:
        return -(-numel // world_size)

    if gathered:
        _add(result, "all_gather", grad_accum, grad_accum * weight_bytes * sum(shard(n) for n in gathered))
    _add(result, "all_gather", len(persistent), weight_bytes * sum(shard(n) for n in persistent))
    _add(result, "reduce_scatter", grad_accum * flushes,
         grad_accum * reduce_bytes * world_size * sum(shard(n) for n in reduction_numels))
    _add(result, "all_reduce", groups, 8 * groups)
    _add(result, "all_reduce", 1, 4)
    return result


def tp_collectives(*, layers: int, hidden: int, head_dim: int, vocab: int, tokens: int, grad_accum: int,
                   world_size: int, sequence_parallel: bool, loss_parallel: bool = True,
                   sync_qk_norm_grads: bool = True, element_bytes: int = 4) -> dict[str, dict[str, float]]:
    """tp-ft and tp-sp-ft, full-parameter (their apply_tp plans): the activations inside every layer, the loss,
    and once per step the partial gradients and the gradient norm. a = e T d, one micro-batch's hidden states, e the
    bytes of an activation: 4 under fp32, 2 under --dtype bf16's bf16 weights (common/precision.py); the loss (on
    fp32 logits) and the gradients (of the fp32 masters) stay fp32.
    Per micro-batch, tensor parallel (tp-ft): all-reduces of a bytes, 2 per layer in forward (o_proj's and
    down_proj's partial sums), 2 per layer in backward (the gradients into the attention's and the MLP's replicated
    input), 1 in forward for the vocabulary-split embedding's partial lookups and 1 in backward for the gradient into
    the LM head's replicated input: 4 L + 2.
    With sequence parallelism (tp-sp-ft) each of those becomes a reduce-scatter (a bytes, the full input) and an
    all-gather (a / W bytes, the local slice of the sequence), 4 L + 2 of each: the all-gathers open the attention,
    the MLP and the LM head in forward and carry the reduce-scatters' gradients back, the embedding's included. What
    a rank sends is the same as tp-ft's (a ring all-reduce is a reduce-scatter then an all-gather, `wire_bytes`).
    The loss: with loss parallelism, 3 all-reduces of 4 T bytes (each token's max logit, sum of exponentials and
    target logit over the vocabulary shards); without, 1 all-gather of the logits' shard, 4 T V / W bytes.
    Per step, 1 all-reduce of 4 n_p bytes, the gradients each rank holds only a part of (q_norm and k_norm, which see
    only the rank's heads: n_p = 2 L h; under SP also every norm weight, which sees only the rank's tokens: + 2 L d +
    d), and 1 of 4 n_t bytes, clip_grad_norm's per-tensor norms of the n_t DTensor parameters (the 7 projections of
    every layer and the embedding, n_t = 7 L + 1; under SP also the 2 L + 1 norms). Every rank computes the whole
    loss: no step-loss all-reduce. In all, with loss parallelism:
        tp-ft     all_reduce      m (4 L + 5) + 2 calls, m (4 L + 2) e T d + 12 m T + 4 n_p + 4 n_t bytes
        tp-sp-ft  reduce_scatter  m (4 L + 2) calls, m (4 L + 2) e T d bytes
                  all_gather      m (4 L + 2) calls, m (4 L + 2) e T d / W bytes
                  all_reduce      3 m + 2 calls, 12 m T + 4 n_p + 4 n_t bytes
    """
    activation = element_bytes * tokens * hidden
    regions = 4 * layers + 2
    partial_grads = (2 * layers * head_dim if sync_qk_norm_grads else 0) + \
        ((2 * layers + 1) * hidden if sequence_parallel else 0)
    sharded_tensors = 7 * layers + 1 + (2 * layers + 1 if sequence_parallel else 0)
    result: dict[str, dict[str, float]] = {}
    if sequence_parallel:
        _add(result, "reduce_scatter", grad_accum * regions, grad_accum * regions * activation)
        _add(result, "all_gather", grad_accum * regions, grad_accum * regions * activation // world_size)
    else:
        _add(result, "all_reduce", grad_accum * regions, grad_accum * regions * activation)
    if loss_parallel:
        _add(result, "all_reduce", 3 * grad_accum, 3 * grad_accum * 4 * tokens)
    else:
        _add(result, "all_gather", grad_accum, grad_accum * 4 * tokens * vocab // world_size)
    _add(result, "all_reduce", 1 if partial_grads else 0, 4 * partial_grads)
    _add(result, "all_reduce", 1, 4 * sharded_tensors)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Pipeline parallel (pp, pp-ds)


def pipeline_collectives(stage_rank: list[int], rank: int, *, microbatches: int, micro_batch_size: int, seq_len: int,
                         hidden: int, vocab: int, tied_gradients: bool, hidden_bytes: int = 4
                         ) -> dict[str, dict[str, float]]:
    """The collectives of one pp-ft optimizer step on `rank`: calls and bytes by logical collective.

    Symbols: S stages, stage s on rank R(s) (`stage_rank`); m micro-batches of b rows of T tokens; hidden size d,
    vocabulary V; a = b T d e, the bytes of one micro-batch's hidden states: e = 2 under --dtype bf16 (`hidden_bytes`:
    the weights are bf16, so is the residual stream), 4 under fp32 and in runs from before the fp32 masters
    (summary.json without `master_weights`: autocast over fp32 weights, the fp32 embedding promoting every addition
    of the residual stream to fp32). The tied gradient is summed on the fp32 masters: V d 4 bytes either way.
    A stage boundary s -> s+1 is
    crossed by a transfer only where R(s) != R(s+1). On rank r, out_r boundaries leave it (R(s) = r != R(s+1)) and
    in_r enter it (R(s+1) = r != R(s)):
        send       m (out_r + in_r) calls of a bytes: the activations forward over out_r, their gradients back over in_r
        recv       m (out_r + in_r) calls of a bytes: the activations in over in_r, the gradients back over out_r
        all_reduce 1 call of 4 bytes: the squared gradient norm (a float32 scalar), summed over all ranks;
                   + 1 call of V d 4 bytes on R(0) and R(S-1) when R(0) != R(S-1) and the tied embedding / LM head is
                   trained: the sum of its two copies' gradients (none under LoRA, the copies being frozen, and none
                   when one rank holds both ends: the sum is then local)
        broadcast  1 call of 4 bytes: the step loss, from R(S-1) (the last stage computes it)
    The schedule (GPipe, 1F1B, interleaved, ZBV) only orders these transfers; the placement decides their number.
    Loop placement (R(s) = s mod p, v stages per rank, p > 1): out_r = v - [r = p-1], in_r = v - [r = 0]; every
    extra stage per rank adds 2m sends and 2m receives. V placement (ZBV, v = 2, rank r holds stages r and 2p-1-r):
    out_r = in_r = [r > 0] + [r < p-1], the turn of the V (stages p-1 and p, both on rank p-1) costing nothing.
    p = 1: no transfers at all.
    """
    n_stages = len(stage_rank)
    boundaries = [(stage_rank[s], stage_rank[s + 1]) for s in range(n_stages - 1) if stage_rank[s] != stage_rank[s + 1]]
    out_r = sum(1 for source, _ in boundaries if source == rank)
    in_r = sum(1 for _, destination in boundaries if destination == rank)
    activation = micro_batch_size * seq_len * hidden * hidden_bytes
    transfers = microbatches * (out_r + in_r)
    result: dict[str, dict[str, float]] = {}
    if transfers:
        result["send"] = {"calls": transfers, "bytes": transfers * activation}
        result["recv"] = {"calls": transfers, "bytes": transfers * activation}
    result["all_reduce"] = {"calls": 1, "bytes": 4}
    ends = (stage_rank[0], stage_rank[-1])
    if tied_gradients and ends[0] != ends[1] and rank in ends:
        result["all_reduce"] = {"calls": 2, "bytes": 4 + vocab * hidden * 4}
    result["broadcast"] = {"calls": 1, "bytes": 4}
    return result


def deepspeed_pipeline_collectives(n_stages: int, stage: int, *, microbatches: int, micro_batch_size: int,
                                   seq_len: int, hidden: int, vocab: int, stage_trainable: int, tied_gradients: bool,
                                   zero_stage: int, optimizer_groups: int, bucket_elements: int = 500_000_000
                                   ) -> dict[str, dict[str, float]]:
    """The collectives of one pp-ds-ft optimizer step in fp32 (DeepSpeed 0.19's PipelineEngine, one data-parallel
    replica) on the rank of stage k of S: calls and bytes by logical collective. Symbols as in pipeline_collectives
    (a = b T d 4); N_k the trainable parameters of stage k, the LM head copy included.
        send       m [k < S-1] (a + 8 b T) bytes in 2 m [k < S-1] calls: DeepSpeed sends the whole tuple a layer
                   returns, here (hidden states, position_ids as int64), one send per tensor; plus m [k > 0] calls of
                   a bytes: the hidden states' gradient back (position_ids have none)
        recv       the mirror image: m [k > 0] (a + 8 b T) bytes in 2 m [k > 0] calls, and m [k < S-1] calls of a
        all_reduce the tied embedding / LM head gradient, V d 4 bytes, on the first and the last stage (S > 1, and
                   not under LoRA: DeepSpeed skips a tied weight without gradient); the data-parallel reduction of
                   the stage's gradients, 4 N_k bytes in ceil(N_k / 5e8) buckets, which DeepSpeed runs even over a
                   group of one replica; the gradient norm: with ZeRO-0 pp-ds-ft's own, 1 call of 4 bytes over the
                   stages (DeepSpeed's fp32 clipping is off there), with ZeRO-1 DeepSpeed's, 2 calls of 4 bytes per
                   optimizer parameter group (over the data-parallel group, then over the stages)
        broadcast  1 call of 8 bytes: the step loss and the data-parallel group's loss (two fp32), from the last stage
    Nothing else: DeepSpeed sends the tensors' shapes once, in the first step only. With --dtype bf16 the module is
    bf16 (a = b T d 2) and DeepSpeed's BF16_Optimizer reduces the gradients its own way: not modelled here.
    """
    activation = micro_batch_size * seq_len * hidden * 4
    position_ids = micro_batch_size * seq_len * 8
    has_next, has_previous = stage < n_stages - 1, stage > 0
    result: dict[str, dict[str, float]] = {}
    if n_stages > 1:
        result["send"] = {"calls": microbatches * (2 * has_next + has_previous),
                          "bytes": microbatches * (has_next * (activation + position_ids) + has_previous * activation)}
        result["recv"] = {"calls": microbatches * (2 * has_previous + has_next),
                          "bytes": microbatches * (has_previous * (activation + position_ids) + has_next * activation)}
    calls, n_bytes = 0, 0
    if tied_gradients and n_stages > 1 and stage in (0, n_stages - 1):
        calls, n_bytes = calls + 1, n_bytes + vocab * hidden * 4
    if stage_trainable:
        calls, n_bytes = calls + -(-stage_trainable // bucket_elements), n_bytes + 4 * stage_trainable
    norm_calls = 1 if zero_stage == 0 else 2 * optimizer_groups
    result["all_reduce"] = {"calls": calls + norm_calls, "bytes": n_bytes + 4 * norm_calls}
    result["broadcast"] = {"calls": 1, "bytes": 8}
    return result


def bubble_textbook(schedule: str, n_ranks: int, n_microbatches: int, stages_per_rank: int) -> tuple[float, str]:
    """The idle share of a step if every stage took the same time and communication were free.

    GPipe and 1F1B: (p-1)/(m+p-1). Each rank idles for p-1 micro-batch slots while the pipeline fills and drains,
    out of m+p-1 slots. GPipe (Huang et al. 2019, arXiv:1811.06965: bubble overhead O((K-1)/(M+K-1)) for K stages and
    M micro-batches); 1F1B has the same bubble but keeps at most p micro-batches in flight (Narayanan et al. 2021,
    arXiv:2104.04473, section 2.2.1: bubble/ideal = (p-1)/m, i.e. (p-1)/(m+p-1) of the total).
    Interleaved 1F1B with v stages per rank: each slot is v times shorter, so (p-1)/(v*m+p-1) (ibid. section 2.2.2:
    bubble/ideal = (p-1)/(v*m)).
    ZBV: 0 when a forward, an input-gradient backward and a weight-gradient backward take the same time and
    m >= 2p (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv:2401.10241, section 6); real stages
    are not that even, so some bubble remains.
    """
    p, m, v = n_ranks, n_microbatches, stages_per_rank
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if schedule == "interleaved-1f1b":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    return 0.0, "0 if T_F = T_B = T_W (zero bubble)"


def predict_bubble(summary: dict) -> tuple[float, str] | None:
    """bubble_textbook for a recorded pipeline run (summary.json's `pipeline`), beside its measured bubble_fraction;
    None for a run without a pipeline. pp-ds-ft runs DeepSpeed's 1F1B over its stages, one per rank."""
    pipeline = summary.get("pipeline")
    if not pipeline:
        return None
    schedule = "1f1b" if pipeline["schedule"] == "deepspeed-1f1b" else pipeline["schedule"]
    return bubble_textbook(schedule, pipeline.get("ranks") or pipeline["stages"], pipeline["microbatches"],
                           pipeline.get("stages_per_rank") or 1)


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism (ep)


def dense_buckets(grad_bytes: list[int], bucket_bytes: int) -> list[int]:
    """common.step.all_reduce_in_buckets (ep-ft's dense gradients): in order, a bucket sent once it holds
    bucket_bytes or more."""
    buckets, size = [], 0
    for n_bytes in grad_bytes:
        size += n_bytes
        if size >= bucket_bytes:
            buckets.append(size)
            size = 0
    return buckets + ([size] if size else [])


def ep_collectives(*, rows_sent: list[int], rows_received: list[int], hidden: int, experts: int, element_bytes: int,
                   dense_grad_bytes: list[int], bucket_bytes: int, logged_values: int) -> dict[str, dict[str, float]]:
    """ep-ft, one rank, one optimizer step. Forward i (one per sparse layer and micro-batch) dispatched
    rows_sent[i] (token, expert) rows of d elements and received rows_received[i]: the routing decides both, so the
    run passes the counts of its profiled step. Per forward, five all-to-alls: the per-expert counts (E int64), the
    rows out (dispatch), the results back (combine); in backward the gradient of what came back (rows_sent rows)
    and of what was received (rows_received rows). Then the all-reduces: the dense gradients in buckets, the experts'
    squared gradient norm (one fp32), and the step's logged values (loss, aux loss, tokens per expert per layer)."""
    result: dict[str, dict[str, float]] = {}
    for sent, received in zip(rows_sent, rows_received, strict=True):
        _add(result, "all_to_all", 1, experts * 8)
        _add(result, "all_to_all", 4, 2 * (sent + received) * hidden * element_bytes)
    for bucket in dense_buckets(dense_grad_bytes, bucket_bytes):
        _add(result, "all_reduce", 1, bucket)
    _add(result, "all_reduce", 1, 4)
    _add(result, "all_reduce", 1, 4 * logged_values)
    return result


def ep_collectives_mean(forwards_per_step: list[list[tuple[list[int], int]]], backend: str, **shape) -> dict:
    """ep_collectives averaged over profiled steps, in the backend's names: each step given as its forwards' (rows
    sent to each rank, rows received), as ep-ft's expert blocks record them; `shape` is ep_collectives' other
    arguments."""
    steps = [ep_collectives(rows_sent=[sum(send) for send, _ in forwards], rows_received=[got for _, got in forwards],
                            **shape) for forwards in forwards_per_step]
    return as_backend({kind: {key: sum(step[kind][key] for step in steps) / len(steps) for key in ("calls", "bytes")}
                       for kind in steps[0]}, backend)


# ---------------------------------------------------------------------------------------------------------------
# From a recorded run: the formula for its summary.json, computed where it is shown (posts, plots, tests)


def backend_of(summary: dict) -> str:
    """The backend a run's collectives ran on, as the experiments choose it: gloo on CPU, NCCL (RCCL) on a GPU."""
    return "gloo" if summary["hardware"]["device_kind"] == "cpu" else "nccl"


@functools.cache
def meta_model(name: str, lora_rank: int = 0, lora_alpha: float = 0.0):
    """The run's model on the meta device (shapes, no memory), with its LoRA adapters: the parameters in the order
    the experiments register them, which is what the formulas read (buckets, units, groups)."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.models import add_lora, model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(name))
        return add_lora(model, lora_rank, lora_alpha) if lora_rank else model


def decoder_layers(model) -> list:
    """The decoder layers, LoRA adapters included (the modules fsdp-ft shards one by one)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def predict_collectives(summary: dict) -> dict | list[dict] | None:
    """This module's formula for the collectives of one profiled step of a recorded run (summary.json), in the
    backend's names, beside its measured `collective_bytes_per_step`: a dict, or for the pipelines one per rank
    (`collective_bytes_per_step_per_rank`). None where no formula models the run; each experiment's README says
    what is left out (one rank, LoRA or bf16 where named below, HSDP, offload, pipeline replicas, ...)."""
    config, experiment, world = summary["config"], summary["experiment"], summary["hardware"]["world_size"]
    if experiment not in EXPERIMENT_STRATEGY:
        raise ValueError(f"{experiment} is not one of this repository's experiments: nothing to predict")
    if experiment == "single-ft":
        return {}  # one process: no collective
    lora, bf16 = config.get("lora_rank", 0), config["dtype"] == "bf16"
    model = meta_model(run_model(summary), lora, config.get("lora_alpha", 0.0))
    geometry = model.config
    trainable = [p for p in model.parameters() if p.requires_grad]
    backend = backend_of(summary)
    formula = None
    if experiment == "ddp-ft" and world > 1:
        # With fp32 masters (common/precision.py) DDP's buckets are of the bf16 weights, 2 bytes a gradient against
        # --bucket-cap-mb, and each sends its masters' fp32 gradients: twice its bytes.
        bucketed = 2 if summary.get("master_weights") else 4
        formula = ddp_collectives([bucketed * p.numel() for p in reversed(trainable)],  # backward's order
                                  bucket_cap_bytes=int(config["bucket_cap_mb"] * 2**20), sent_per_byte=4 // bucketed,
                                  grad_accum=config["grad_accum"],
                                  reduce_every_micro_batch=config["reduce_every_micro_batch"])
    elif experiment == "fsdp-ft" and world > 1 and config.get("replicate_degree", 1) == 1 and \
            not (config["cpu_offload"] and backend != "gloo"):
        layers = decoder_layers(model)
        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        units = [[(tuple(p.shape), p.requires_grad) for p in model.parameters() if id(p) not in in_layers]]
        units += [[(tuple(p.shape), p.requires_grad) for p in layer.parameters()] for layer in layers]
        formula = fsdp_collectives(
            units, world_size=world, grad_accum=config["grad_accum"],
            reshard_after_forward=config["reshard_after_forward"],
            reshard_after_backward=config.get("reshard_after_backward", True),
            reduce_every_micro_batch=config["reduce_every_micro_batch"], gather_bytes=2 if bf16 else 4)
    elif experiment == "zero-ft" and world > 1 and not lora and (not config["cpu_offload"] or
                                                                 config["zero_stage"] == 2):
        groups = [group for group in ([p for p in trainable if p.ndim >= 2], [p for p in trainable if p.ndim < 2])
                  if group]
        order = [p for group in groups for p in group] if config["zero_stage"] == 1 else list(reversed(trainable))
        formula = zero_collectives(
            config["zero_stage"], group_numels=[sum(p.numel() for p in group) for group in groups],
            reduction_numels=[p.numel() for p in order], parameter_numels=[p.numel() for p in model.parameters()],
            world_size=world, grad_accum=config["grad_accum"], bf16=bf16)
    elif experiment in ("tp-ft", "tp-sp-ft") and world > 1 and not lora and \
            (not bf16 or summary.get("master_weights")):  # bf16 under autocast (earlier runs): not modelled
        formula = tp_collectives(
            layers=geometry.num_hidden_layers, hidden=geometry.hidden_size, head_dim=geometry.head_dim,
            vocab=geometry.vocab_size, tokens=config["micro_batch_size"] * config["seq_len"],
            grad_accum=config["grad_accum"], world_size=summary.get("tensor_parallel") or world,
            sequence_parallel=experiment == "tp-sp-ft", loss_parallel=config["loss_parallel"],
            sync_qk_norm_grads=config["sync_qk_norm_grads"], element_bytes=2 if bf16 else 4)
    elif experiment == "pp-ft" and summary["pipeline"].get("replicas", 1) == 1:
        return [as_backend(pipeline_collectives(
            summary["pipeline"]["stage_rank"], rank, microbatches=config["grad_accum"],
            micro_batch_size=config["micro_batch_size"], seq_len=config["seq_len"], hidden=geometry.hidden_size,
            vocab=geometry.vocab_size, tied_gradients=not lora, hidden_bytes=2 if summary.get("master_weights") else 4),
            backend) for rank in range(world)]
    elif experiment == "pp-ds-ft" and summary["pipeline"]["data_parallel"] == 1 and not bf16:
        # DeepSpeed's layer list: the embedding, the decoder layers, the final norm, the tied LM head (a copy).
        embedding = model.get_input_embeddings()
        layer_trainable = [sum(p.numel() for p in module.parameters() if p.requires_grad)
                           for module in (embedding, *decoder_layers(model), model.get_decoder().norm, embedding)]
        starts = summary["pipeline"]["stage_starts"]
        return [as_backend(deepspeed_pipeline_collectives(
            len(starts) - 1, stage, microbatches=config["grad_accum"], micro_batch_size=config["micro_batch_size"],
            seq_len=config["seq_len"], hidden=geometry.hidden_size, vocab=geometry.vocab_size,
            stage_trainable=sum(layer_trainable[starts[stage]:starts[stage + 1]]), tied_gradients=not lora,
            zero_stage=config["zero_stage"], optimizer_groups=2), backend) for stage in range(len(starts) - 1)]
    elif experiment == "ep-ft" and world > 1 and summary.get("routed_rows_profiled") and \
            not config["activation_checkpointing"]:
        sparse = [layer.mlp.experts for layer in decoder_layers(model) if hasattr(layer.mlp, "experts")]
        experts = {id(p) for module in sparse for p in module.parameters()}
        return ep_collectives_mean(
            summary["routed_rows_profiled"], backend, hidden=geometry.hidden_size, experts=geometry.num_experts,
            element_bytes=2 if bf16 else 4, bucket_bytes=int(config["dense_bucket_mb"] * 2**20),
            dense_grad_bytes=[4 * p.numel() for p in model.parameters() if id(p) not in experts],  # fp32 gradients
            logged_values=2 + len(sparse) * geometry.num_experts)  # loss, aux loss, tokens per expert per layer
    return formula and as_backend(formula, backend)
