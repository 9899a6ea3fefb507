"""common/ep.py on a one-rank group: the gradient norm and clipping of expert parallelism against clip_grad_norm_,
the bucketed sum of the dense gradients against common.comm's count of its calls, and the dispatch counts kept for
summary.json. tests/test_ep_ft.py holds ep-ft on two ranks to single-ft's steps (slow tier)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from common.comm import dense_buckets
from common.ep import Dispatches, clip_expert_parallel_grad_norm, grouped_linear
from common.step import all_reduce_in_buckets


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    dist.destroy_process_group()


def test_the_expert_parallel_norm_and_clipping_are_clip_grad_norm_s(group_of_one):
    generator = torch.Generator().manual_seed(0)
    dense = [torch.randn(shape, generator=generator) for shape in ((6, 4), (4,))]
    experts = torch.randn(2, 3, 4, generator=generator)
    grads = [torch.randn(p.shape, generator=generator) * 3 for p in [*dense, experts]]
    plain = [p.clone().requires_grad_() for p in [*dense, experts]]
    for p, g in zip(plain, grads):
        p.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(plain, 1.0)
    assert want > 1.0  # the clipping does something

    params = [p.clone().requires_grad_() for p in dense]
    params.append(torch.nn.Parameter(DTensor.from_local(experts.clone(), group_of_one, [Shard(0)])))
    for p, g in zip(params, grads):
        p.grad = DTensor.from_local(g.clone(), group_of_one, [Shard(0)]) if isinstance(p, DTensor) else g.clone()
    got = clip_expert_parallel_grad_norm(params, 1.0)
    assert got == pytest.approx(want.item(), rel=1e-6)
    for p, q in zip(params, plain):
        grad = p.grad.to_local() if isinstance(p, DTensor) else p.grad
        torch.testing.assert_close(grad, q.grad)


def test_dense_gradients_go_in_the_buckets_common_comm_counts(group_of_one, monkeypatch):
    tensors = [torch.full((n,), float(n)) for n in (10, 300, 5, 200, 7)]
    sizes = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: (sizes.append(t.numel() * 4), all_reduce(t, **kw)))
    all_reduce_in_buckets(tensors, bucket_bytes=1000)
    assert sizes == dense_buckets([t.numel() * 4 for t in tensors], 1000) == [1240, 848]
    assert all(torch.equal(t, torch.full_like(t, t.numel())) for t in tensors)  # one rank: the sum is the tensor


@pytest.mark.parametrize("kernel", ["grouped_mm", "loop"])  # the loop: older torch, or fp32 on a GPU
def test_grouped_linear_multiplies_each_expert_s_rows_by_its_weight(kernel, monkeypatch):
    if kernel == "loop":
        monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    elif not hasattr(torch.nn.functional, "grouped_mm"):
        pytest.skip("this torch has no torch.nn.functional.grouped_mm")
    generator = torch.Generator().manual_seed(0)
    counts = [3, 0, 2]
    rows, weight = torch.randn(5, 4, generator=generator), torch.randn(3, 6, 4, generator=generator)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    want = torch.cat([rows[:3] @ weight[0].T, rows[3:] @ weight[2].T])
    torch.testing.assert_close(grouped_linear(rows, weight, offsets, counts), want)


def test_dispatches_count_the_training_forwards_once_and_keep_the_profiled_steps():
    class Block:
        forwards: list

    blocks = [Block(), Block()]
    for block in blocks:
        block.forwards = [([9, 9], 9)]  # an evaluation's forward, before the step
    dispatches = Dispatches(blocks, world_size=2)
    for step, profiled in ((0, False), (1, True)):
        dispatches.begin()
        for i, block in enumerate(blocks):
            block.forwards.append(([1 + step, 2 + i], 3))
        dispatches.end()
        blocks[0].forwards.append(([100, 100], 100))  # activation checkpointing's recomputation, in backward
        dispatches.end_step(profiled=profiled)
    summary = dispatches.summary()
    assert summary["dispatched_rows"] == [[1 + 1 + 2 + 2, 2 + 3 + 2 + 3]]  # no process group: this process's alone
    assert summary["routed_rows_profiled"] == [[([2, 2], 3), ([2, 3], 3)]]
