"""common/comm.py: what a collective moves over the links, backend names, and the data- and tensor-parallel formulas'
rules (DDP's buckets, DeepSpeed's bucket flushes, FSDP2's padding, what ZeRO-3's formula leaves out).

The formulas are held to torch.profiler's measurement by the 2-rank launches of test_ddp_fsdp.py, test_zero_ft.py and
test_tp_ft.py (`assert_formula_matches`); the helpers those files share live here. No run computes a formula: the
launches and the committed runs are held to predict_collectives(summary), computed from what summary.json recorded.
"""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.comm import (as_backend, ddp_buckets, ddp_collectives, fsdp_collectives, fsdp_shard_numel,
                         predict_collectives, tp_collectives, wire_bytes, zero_bucket_flushes, zero_collectives)
from common.models import load_tokenizer, model_config
from conftest import REPO_ROOT

MIB = 2**20


# ---------------------------------------------------------------------------------------------------------------
# Shared by the launches' checks


def tiny_parameters() -> list[tuple[str, tuple[int, ...]]]:
    """qwen3-tiny's parameters as (name, shape), in registration order, the tied LM head once (no memory: meta)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config("qwen3-tiny", load_tokenizer("qwen3-tiny")))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def assert_formula_matches(summary: dict) -> None:
    """The profiled steps' calls and bytes per backend collective (rank 0) are exactly common/comm.py's formula,
    computed from the run's summary.json (predict_collectives)."""
    measured, formula = summary["collective_bytes_per_step"], predict_collectives(summary)
    assert measured and formula is not None, (measured, formula)
    assert summary["profiled_steps"] and min(summary["profiled_steps"]) >= 3  # steady state (DDP rebuilds at step 2)
    assert measured == formula, (summary["experiment"], summary["config"], measured, formula)


def committed_runs_measured_as_their_formula() -> list:
    """The committed runs whose profiled collectives equalled, call for call and byte for byte, the formula they
    recorded when they ran (runs made before summary.json stopped recording it)."""
    runs = []
    for path in sorted(REPO_ROOT.glob("devlog/data/*/*/summary.json")):
        summary = json.loads(path.read_text())
        per_rank = "collective_bytes_formula_per_rank" in summary
        recorded = summary.get("collective_bytes_formula_per_rank" if per_rank else "collective_bytes_formula")
        measured = summary.get("collective_bytes_per_step_per_rank" if per_rank else "collective_bytes_per_step")
        if recorded and measured == recorded:
            runs.append(pytest.param(path, id=str(path.parent.relative_to(REPO_ROOT / "devlog" / "data"))))
    return runs


@pytest.mark.parametrize("path", committed_runs_measured_as_their_formula())
def test_the_formula_from_a_committed_summary_is_what_its_run_measured(path):
    """predict_collectives rebuilds each formula's inputs from summary.json alone (the config, the world size, the
    model on the meta device: its parameters' order, units and groups): for every committed run whose measurement
    equalled the formula its script computed, the one computed from its summary equals the measurement too."""
    summary = json.loads(path.read_text())
    measured = summary.get("collective_bytes_per_step_per_rank") or summary["collective_bytes_per_step"]
    if summary["experiment"] == "ep-ft" and "routed_rows_profiled" not in summary:
        assert predict_collectives(summary) is None  # its rows are routing's: recorded by ep-ft since, not then
    else:
        assert predict_collectives(summary) == measured


# ---------------------------------------------------------------------------------------------------------------
# Wire bytes and backend names


def test_a_ring_all_reduce_moves_twice_its_buffer_times_w_minus_1_over_w():
    assert wire_bytes("all_reduce", 1000, 2) == 1000
    assert wire_bytes("all_reduce", 1000, 4) == 1500  # 2 (W-1)/W B
    assert wire_bytes("all_reduce", 1000, 1) == 0
    # An all-gather's buffer is the local shard: every rank receives the W - 1 others. A reduce-scatter's is the
    # full input: every rank sends W - 1 of its W slices. Together they are one all-reduce (what tp-sp-ft relies on).
    assert wire_bytes("all_gather", 250, 4) == 750
    assert wire_bytes("reduce_scatter", 1000, 4) == 750
    assert wire_bytes("reduce_scatter", 1000, 4) + wire_bytes("all_gather", 1000 / 4, 4) == \
        wire_bytes("all_reduce", 1000, 4)
    assert wire_bytes("broadcast", 1000, 8) == wire_bytes("send", 1000, 2) == 1000
    # An all-to-all's buffer is what the rank sends; the block for itself stays (an even spread: 1/W of it).
    assert wire_bytes("all_to_all", 1000, 4) == 750
    with pytest.raises(ValueError, match="unknown collective"):
        wire_bytes("scatter", 1, 2)


def test_as_backend_names_collectives_as_the_backend_runs_them():
    logical = {"all_reduce": {"calls": 2, "bytes": 8}, "reduce_scatter": {"calls": 3, "bytes": 300},
               "all_gather": {"calls": 1, "bytes": 50}}
    # gloo runs a reduce-scatter as an all-reduce of the same full input: the two add up under one name.
    assert as_backend(logical, "gloo") == {"gloo:all_reduce": {"calls": 5, "bytes": 308},
                                           "gloo:all_gather": {"calls": 1, "bytes": 50}}
    assert as_backend(logical, "nccl") == {"nccl:all_reduce": {"calls": 2, "bytes": 8},
                                           "nccl:reduce_scatter": {"calls": 3, "bytes": 300},
                                           "nccl:all_gather": {"calls": 1, "bytes": 50}}


# ---------------------------------------------------------------------------------------------------------------
# The formulas' rules


def test_ddp_closes_a_bucket_once_it_reaches_its_cap():
    # torch's compute_bucket_assignment_by_size: add, then close when the bucket holds at least the cap.
    assert ddp_buckets([3, 3, 3, 3, 3], bucket_cap_bytes=6) == [6, 6, 3]
    assert ddp_buckets([5, 2, 5, 2], bucket_cap_bytes=6) == [7, 7]
    assert ddp_buckets([4, 4, 4], bucket_cap_bytes=100) == [12]
    # The small first bucket (DDP's default when no bucket_cap_mb is given), then the cap.
    assert ddp_buckets([1, 1, 4, 4, 4], bucket_cap_bytes=8, first_bucket_bytes=2) == [2, 8, 4]


def test_ddp_reduce_every_micro_batch_multiplies_the_gradient_traffic_by_m():
    grads = [MIB] * 10  # 10 MiB of gradients, 4 MiB buckets: 4 + 4 + 2
    once = ddp_collectives(grads, bucket_cap_bytes=4 * MIB, grad_accum=4)
    every = ddp_collectives(grads, bucket_cap_bytes=4 * MIB, grad_accum=4, reduce_every_micro_batch=True)
    assert once == {"all_reduce": {"calls": 3 + 1, "bytes": 10 * MIB + 4}}  # + the step loss
    assert every == {"all_reduce": {"calls": 4 * 3 + 1, "bytes": 4 * 10 * MIB + 4}}


def test_fsdp_pads_dim_0_to_a_multiple_of_the_world_size():
    assert fsdp_shard_numel((10, 3), 4) == 3 * 3  # rows 10 -> 12, 3 per rank
    assert fsdp_shard_numel((8, 3), 4) == 2 * 3
    assert fsdp_shard_numel((5,), 2) == 3


def test_fsdp_gathers_again_in_backward_only_what_was_resharded():
    root = [((100, 4), True), ((4,), True)]
    layer = [((8, 4), True), ((4,), False)]  # a frozen norm: gathered, never reduced
    units = [root, layer, layer]
    shards = [(50 * 4 + 2), (4 * 4 + 2), (4 * 4 + 2)]
    common = dict(world_size=2, grad_accum=3, reduce_every_micro_batch=False, gather_bytes=2)
    resharded = fsdp_collectives(units, reshard_after_forward=True, **common)
    kept = fsdp_collectives(units, reshard_after_forward=False, **common)
    assert kept["all_gather"] == {"calls": 3 * 3, "bytes": 3 * 2 * sum(shards)}
    assert resharded["all_gather"] == {"calls": 3 * (3 + 2), "bytes": 3 * 2 * (sum(shards) + sum(shards[1:]))}
    # One reduce-scatter per unit, in fp32, of the trainable parameters' padded gradients (2 x their shards).
    assert resharded["reduce_scatter"] == {"calls": 3, "bytes": 4 * 2 * (50 * 4 + 2 + 2 * 4 * 4)}
    assert resharded["all_reduce"] == {"calls": 2, "bytes": 4 * 4 + 4}  # 4 trainable tensors' norms, the loss
    # Kept through backward as well: each unit gathered once per optimizer step, whatever the micro-batches; the
    # gradients are reduced as before.
    once = fsdp_collectives(units, reshard_after_forward=False, reshard_after_backward=False, **common)
    assert once["all_gather"] == {"calls": 3, "bytes": 2 * sum(shards)}
    assert once["reduce_scatter"] == resharded["reduce_scatter"] and once["all_reduce"] == resharded["all_reduce"]
    with pytest.raises(ValueError, match="reshard_after_forward=False"):
        fsdp_collectives(units, reshard_after_forward=True, reshard_after_backward=False, **common)


def test_deepspeed_sends_its_bucket_before_a_gradient_would_overflow_it():
    assert zero_bucket_flushes([3, 3, 3], bucket_elements=10) == 1
    assert zero_bucket_flushes([6, 6, 6], bucket_elements=10) == 3
    assert zero_bucket_flushes([4, 6, 1], bucket_elements=10) == 2  # 4 + 6 fit exactly, 1 starts a new bucket
    assert zero_bucket_flushes([12, 1], bucket_elements=10) == 2  # a gradient larger than the bucket goes alone
    assert zero_bucket_flushes([], bucket_elements=10) == 0


def test_zero_formula_leaves_out_what_the_config_does_not_decide():
    names, shapes = zip(*tiny_parameters())
    numels = [math.prod(shape) for shape in shapes]
    common = dict(group_numels=[sum(numels)], reduction_numels=numels, parameter_numels=numels, world_size=2,
                  grad_accum=1)
    assert zero_collectives(3, bf16=False, **common) is not None
    # ZeRO-3 beyond one prefetch bucket: which layers are released and gathered again follows DeepSpeed's trace.
    assert zero_collectives(3, bf16=False, prefetch_bucket_elements=1_000_000, **common) is None
    assert zero_collectives(1, bf16=True, **common) is None  # BF16_Optimizer's own path
    stage2 = zero_collectives(2, bf16=True, **common)
    assert stage2["all_gather"]["bytes"] == 2 * sum(numels) // 2  # bf16 partitions of the only group
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        zero_collectives(4, bf16=False, **common)


def test_sequence_parallel_sends_what_tensor_parallel_sends():
    geometry = dict(layers=4, hidden=256, head_dim=32, vocab=8192, tokens=512, grad_accum=2)
    for world in (2, 4):
        tp = tp_collectives(world_size=world, sequence_parallel=False, **geometry)
        sp = tp_collectives(world_size=world, sequence_parallel=True, **geometry)

        def wire(result, kinds):
            return sum(wire_bytes(kind, result[kind]["bytes"], world) for kind in kinds if kind in result)

        activations = 2 * (4 * 4 + 2) * 4 * 512 * 256  # m (4 L + 2) a
        loss_and_grads = tp["all_reduce"]["bytes"] - activations
        assert wire(sp, ["reduce_scatter", "all_gather"]) == wire_bytes("all_reduce", activations, world)
        # SP's per-step all-reduces also carry the norm weights' gradients and norms: 2 L + 1 tensors of d more.
        assert sp["all_reduce"]["bytes"] - loss_and_grads == 4 * (2 * 4 + 1) * 256 + 4 * (2 * 4 + 1)
