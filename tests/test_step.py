"""common/step.py: the garbage-collection schedule, and clipping folded into fused AdamW's step (the same update as
clip_grad_norm_ followed by the step, without writing the clipped gradients)."""

import gc
import json

import pytest
import torch

from common.step import GarbageCollection, clip_grad_norm, folds_clipping
from conftest import load_experiment


def parameters_and_grads(seed=0):
    """Three tensors of parameters and, for three steps, their gradients: norms above, below and far above 1."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(shape, generator=generator) for shape in ((7, 5), (5,), (3, 4, 2))]
    grads = [[torch.randn(p.shape, generator=generator) * scale for p in params] for scale in (1.0, 0.05, 30.0)]
    return params, grads


def train(params, grads, max_norm, clip, **adamw):
    """Three AdamW steps from copies of `params`; `clip(optimizer, params)` returns the step's gradient norm."""
    params = [p.clone().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, **adamw)
    norms = []
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        norms.append(clip(optimizer, params))
        optimizer.step()
    return [p.detach() for p in params], torch.stack(norms)


def test_clipping_folded_into_fused_adamw_is_clip_grad_norm_then_the_step():
    params, grads = parameters_and_grads()
    norms_seen = torch.stack([torch.linalg.vector_norm(torch.cat([g.flatten() for g in step])) for step in grads])
    assert norms_seen[1] < 1.0 < norms_seen[0] < norms_seen[2]  # clipping off, on, on
    reference, reference_norms = train(params, grads, 1.0, lambda opt, ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
                                       fused=True)
    unfused, _ = train(params, grads, 1.0, lambda opt, ps: torch.nn.utils.clip_grad_norm_(ps, 1.0), foreach=True)
    written = []

    def folded_clip(optimizer, ps):
        assert folds_clipping(optimizer)
        before = [p.grad.clone() for p in ps]
        norm = clip_grad_norm(optimizer, ps, 1.0)
        written.append(any(not torch.equal(p.grad, b) for p, b in zip(ps, before)))
        return norm

    folded, folded_norms = train(params, grads, 1.0, folded_clip, fused=True)
    torch.testing.assert_close(folded_norms, reference_norms, rtol=1e-6, atol=0)
    for mine, theirs, other in zip(folded, reference, unfused):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-6)  # the unfused AdamW: the same update
    assert written == [False] * 3  # the clipped gradients were never written
    # The test has teeth: without the clipping the steps differ.
    unclipped, _ = train(params, grads, 1.0, lambda opt, ps: torch.zeros(()), fused=True)
    assert max(float((a - b).abs().max()) for a, b in zip(unclipped, folded)) > 1e-3


def test_without_a_fused_optimizer_it_clips_in_place_as_clip_grad_norm_does():
    params, grads = parameters_and_grads(seed=1)
    reference, reference_norms = train(params, grads, 0.5, lambda opt, ps: torch.nn.utils.clip_grad_norm_(ps, 0.5))
    mine, norms = train(params, grads, 0.5, lambda opt, ps: clip_grad_norm(opt, ps, 0.5))
    torch.testing.assert_close(norms, reference_norms, rtol=1e-6, atol=0)
    for a, b in zip(mine, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    off, _ = train(params, grads, float("inf"), lambda opt, ps: clip_grad_norm(opt, ps, float("inf")), fused=True)
    plain, _ = train(params, grads, float("inf"), lambda opt, ps: torch.zeros(()), fused=True)
    for a, b in zip(off, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # max_norm inf: no clipping at all


@pytest.fixture
def restore_gc():
    yield
    gc.unfreeze()
    gc.enable()


@pytest.mark.usefixtures("restore_gc")
def test_garbage_collection_runs_on_its_schedule_only(monkeypatch):
    collections = []
    collector = GarbageCollection(every_steps=3)
    assert not gc.isenabled() and gc.get_freeze_count() > 0  # set-up frozen, automatic collection off
    monkeypatch.setattr(gc, "collect", lambda generation=2: collections.append(generation))
    for step in range(10):
        collector.step(step)
    assert collections == [1, 1, 1] and collector.summary()["collections"] == 3  # before steps 3, 6 and 9
    collector.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="every_steps"):
        GarbageCollection(every_steps=0)


def test_single_ft_records_the_schedule_and_gives_the_collector_back(tmp_path, small_data):
    single_ft = load_experiment("single-ft")
    summary = single_ft.main(["--data", str(small_data), "--seq-len", "64", "--steps", "4", "--out-dir", str(tmp_path),
                              "--eval-fraction", "0", "--comm-profile-steps", "0", "--timing-warmup-steps", "1"])
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert summary["garbage_collection"]["every_steps"] == 20 and summary["garbage_collection"]["collections"] == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(record["gc_ms"] >= 0 and record["compiles"] == 0 for record in records)
    assert summary["recompiles"] == 0 and summary["warmup_steps_observed"] is not None
