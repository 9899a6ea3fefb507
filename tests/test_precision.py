"""common/precision.py: bf16 weights for compute, fp32 masters that AdamW updates, gradients accumulated in fp32."""

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from common.precision import MasterWeights
from common.step import clip_grad_norm


class TiedModel(nn.Module):
    """An embedding whose matrix is also the output head (as Qwen3's tied LM head), a norm weight between."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.norm = nn.Parameter(torch.ones(16))
        self.proj = nn.Linear(16, 16, bias=False)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        hidden = self.proj(self.embed(ids) * self.norm)
        return self.head(hidden).float().logsumexp(-1).sum()


def make_model(seed=0):
    torch.manual_seed(seed)
    return TiedModel()


def test_the_step_is_adamw_on_fp32_masters_with_gradients_summed_in_fp32():
    model = make_model()
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}  # fp32, a tied one once
    masters = MasterWeights(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.head.weight is model.embed.weight  # still one parameter
    assert [m.dtype for m in masters.parameters] == [torch.float32] * 3
    assert all(torch.equal(m, reference[name]) for m, name in zip(masters.parameters, reference))

    summed = [torch.zeros_like(m) for m in masters.parameters]
    for k in range(3):  # three micro-batches
        ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(k))
        # The bf16 gradients backward will accumulate (autograd.grad leaves .grad and the hooks alone), summed in fp32.
        for total, grad in zip(summed, torch.autograd.grad(model(ids), list(model.parameters()))):
            assert grad.dtype == torch.bfloat16
            total += grad.float()
        model(ids).backward()
        assert all(p.grad is None for p in model.parameters())  # freed once added into the master
    for master, total in zip(masters.parameters, summed):
        assert master.grad.dtype == torch.float32 and torch.equal(master.grad, total)

    # The update: AdamW (with clipping) on fp32 copies given the same fp32 gradients, exactly.
    copies = [nn.Parameter(reference[name].clone()) for name in reference]
    for copy, master in zip(copies, masters.parameters):
        copy.grad = master.grad.clone()
    settings = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    optimizer, expected = torch.optim.AdamW(masters.parameters, **settings), torch.optim.AdamW(copies, **settings)
    assert clip_grad_norm(optimizer, masters.parameters, 0.5) == clip_grad_norm(expected, copies, 0.5)
    masters.free_weights()  # not held at the step
    assert all(p.untyped_storage().size() == 0 for p in model.parameters())
    optimizer.step()
    expected.step()
    optimizer.zero_grad(set_to_none=True)
    masters.copy_to_model()
    for master, copy, param in zip(masters.parameters, copies, model.parameters()):
        assert torch.equal(master, copy)  # fp32, not rounded to bf16 between steps
        assert param.dtype == torch.bfloat16 and torch.equal(param, copy.to(torch.bfloat16))
    assert not torch.equal(masters.parameters[0].to(torch.bfloat16).float(), masters.parameters[0])


def test_micro_batches_accumulate_in_fp32_not_in_bf16():
    """1 + 1/512 is not a bf16 number (its spacing at 1 is 1/128): summed in bf16 the second gradient is lost."""
    weight = nn.Parameter(torch.zeros(1))
    holder = nn.Module()
    holder.weight = weight
    masters = MasterWeights(holder)
    (weight * 1.0).sum().backward()
    (weight * (1 / 512)).sum().backward()
    assert masters.parameters[0].grad.item() == 1 + 1 / 512
    assert torch.tensor(1.0, dtype=torch.bfloat16) + 1 / 512 == 1  # what a bf16 .grad would hold


def test_the_checkpoint_module_holds_the_masters_under_the_model_s_names():
    model = make_model()
    masters = MasterWeights(model)
    state = masters.module.state_dict()
    assert state.keys() == model.state_dict().keys()  # the tied weight under both names, as the model's own
    assert state["head.weight"].data_ptr() == state["embed.weight"].data_ptr()
    assert {v.dtype for v in state.values()} == {torch.float32}
    assert all(a is b for a, b in zip(masters.module.parameters(), masters.parameters, strict=True))
    masters.module.load_state_dict({k: torch.full_like(v, 0.5) for k, v in state.items()})
    masters.copy_to_model()  # a resume: the loaded masters, rounded into the weights the forward reads
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters())


def test_frozen_parameters_and_fp32_are_left_alone():
    model = make_model()
    model.proj.weight.requires_grad_(False)
    masters = MasterWeights(model)
    assert model.proj.weight.dtype == torch.float32 and len(masters.parameters) == 2
    assert masters.module.proj.weight is model.proj.weight  # a frozen weight is saved as it is
    off = make_model()
    before = [p.detach().clone() for p in off.parameters()]
    masters = MasterWeights(off, None)
    assert masters.module is off and masters.parameters == list(off.parameters()) and masters.summary() is None
    masters.copy_to_model()
    masters.restore_masters()
    assert all(torch.equal(p, b) and p.dtype == torch.float32 for p, b in zip(off.parameters(), before))


def test_restore_masters_gives_the_export_the_fp32_weights():
    model = make_model()
    masters = MasterWeights(model)
    master_of = dict(zip((name for name, _ in model.named_parameters()), masters.parameters))
    master_of["norm"].data.add_(1e-3)  # an update below bf16's resolution at 1
    masters.restore_masters()
    assert model.norm.dtype == torch.float32 and torch.equal(model.norm, torch.ones(16).add_(1e-3))
    assert masters.summary() == dict(compute_dtype="bfloat16", master_dtype="float32", tensors=3,
                                     elements=32 * 16 + 16 + 16 * 16)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_from_the_masters_tracks_fp32_within_bf16_rounding(accumulate):
    model, fp32 = make_model(), make_model()
    masters = MasterWeights(model)
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(7))
    for _ in range(accumulate):
        model(ids).backward()
        fp32(ids).backward()
    for master, p in zip(masters.parameters, fp32.parameters()):
        assert (master.grad - p.grad).norm() / p.grad.norm() < 2e-2  # bf16 products: about 1%


def test_state_bytes_count_the_masters_gradients():
    """common.metrics.state_bytes with the masters passed as `master`: bf16 weights 2, fp32 gradients 4 (on the
    masters: the bf16 ones are freed), fp32 masters 4 bytes a parameter; what summary.json's state_bytes_per_rank
    holds and common.memory's MASTER_BF16 prices."""
    from common.metrics import state_bytes

    model = make_model()
    masters = MasterWeights(model)
    n = sum(m.numel() for m in masters.parameters)
    model(torch.randint(0, 32, (2, 4))).backward()
    held = state_bytes(model.parameters(), None, masters.copies)
    assert held == dict(weights=2 * n, grads=4 * n, optimizer=0, master=4 * n)


def test_under_ddp_the_buckets_carry_the_masters_fp32_gradients_and_are_freed_with_the_weights(tmp_path):
    """ddp-ft's all_reduce_masters: DDP buckets the bf16 weights, and this comm hook all-reduces (mean) each bucket's
    fp32 master gradients, this rank's sum of the micro-batches, once per synchronised backward. In a gloo group of
    one the mean is the sum itself, so the masters end as single-ft's; DDP's bf16 buckets, which its .grad are views
    of, are released by free_weights and allocated again by copy_to_model. The first step reduces one bucket of
    everything (DDP has not seen backward's order yet); then 512-byte buckets in backward's order: the proj weight
    fills one, the norm and the tied embedding (ready last) share the next."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from common.metrics import state_bytes
    from conftest import load_experiment

    ddp_ft = load_experiment("ddp-ft")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model, reference = make_model(), make_model()
        masters, plain = MasterWeights(model), MasterWeights(reference)
        ddp = DistributedDataParallel(model, bucket_cap_mb=512 / 2**20, gradient_as_bucket_view=True)
        ddp.register_comm_hook(masters, ddp_ft.all_reduce_masters)
        n = sum(m.numel() for m in masters.parameters)
        for step in range(2):  # the second after DDP has rebuilt its buckets in backward's order
            batches = [torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(10 * step + k))
                       for k in range(3)]
            for k, ids in enumerate(batches):
                with ddp.no_sync() if k < len(batches) - 1 else nullcontext():
                    ddp(ids).backward()
                reference(ids).backward()
            assert len(masters.buckets) == 1 + step and {b.dtype for b in masters.buckets} == {torch.bfloat16}
            for master, expected in zip(masters.parameters, plain.parameters):
                assert torch.equal(master.grad, expected.grad)  # each micro-batch added once, in fp32
            views = [p.grad for p in model.parameters()]  # what DDP wrote back: views of its buckets, zeros
            assert all(v is not None and v.dtype == torch.bfloat16 and not v.any() for v in views)
            # The bf16 weights 2, DDP's bf16 buckets 2 beside the masters' fp32 gradients 4, the masters 4.
            assert state_bytes(model.parameters(), None, masters.copies) == dict(
                weights=2 * n, grads=(2 + 4) * n, optimizer=0, master=4 * n)
            buckets = masters.buckets
            masters.free_weights()
            assert all(p.grad is None for p in model.parameters())
            assert all(v.untyped_storage().size() == 0 for v in [*views, *buckets])  # the buckets are DDP's own
            for master, expected in zip(masters.parameters, plain.parameters):
                master.grad, expected.grad = None, None
            masters.copy_to_model()
            plain.copy_to_model()
            assert all(b.untyped_storage().size() == b.numel() * 2 for b in buckets) and masters.buckets == []
    finally:
        dist.destroy_process_group()
