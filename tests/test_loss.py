"""common/loss.py's fused and chunked LM-head cross-entropy: same loss and gradients as the plain one, no host read,
same training steps."""

import json
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.data import IGNORE_INDEX, token_loss_sum
from common.loss import fused_linear_cross_entropy
from common.loss_reference import chunked_token_loss_sum
from conftest import load_experiment

single_ft = load_experiment("single-ft")


def problem(seed=0, batch=3, seq=37, d=16, vocab=50):
    """Hidden states, LM head and shifted labels; row 1 carries no loss at all, the others only partly."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, d, generator=generator, dtype=torch.float32)
    weight = torch.randn(vocab, d, generator=generator, dtype=torch.float32) / d ** 0.5
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    labels[torch.rand(batch, seq, generator=generator) < 0.4] = IGNORE_INDEX
    labels[1] = IGNORE_INDEX
    return hidden, weight, labels


def loss_and_grads(loss_fn, hidden, weight):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = loss_fn(hidden, weight)
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


def plain(labels):
    return lambda hidden, weight: token_loss_sum(hidden @ weight.T, labels)


def chunked(labels, chunk_tokens):
    return lambda hidden, weight: chunked_token_loss_sum(hidden, weight, labels, chunk_tokens)


def fused(labels, chunk_tokens, scale):
    return lambda hidden, weight: fused_linear_cross_entropy(hidden, weight, labels, chunk_tokens,
                                                             torch.tensor(scale))


def test_chunked_loss_and_gradients_equal_the_plain_ones():
    hidden, weight, labels = problem()
    n_loss = int((labels != IGNORE_INDEX).sum())
    divisor = next(k for k in range(n_loss // 3, 0, -1) if n_loss % k == 0)
    assert 1 < divisor < n_loss and n_loss % 7 != 0  # chunk sizes that do and do not divide the loss tokens
    reference = loss_and_grads(plain(labels), hidden, weight)
    assert reference[1][1].abs().sum() == 0  # the row without loss tokens gets no gradient
    for chunk_tokens in (1, 7, divisor, n_loss, 10_000):
        result = loss_and_grads(chunked(labels, chunk_tokens), hidden, weight)
        for got, want in zip(result, reference):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"chunk_tokens={chunk_tokens}")


def test_fused_loss_and_gradients_equal_the_plain_ones():
    """The fused loss computes the gradients in its forward pass: its loss (scaled by 1 / loss tokens) and the
    gradients of the hidden states and of the head's weight equal the plain loss's within 1e-5 in fp32, also when
    backward starts from a multiple of it (the data-parallel experiments' (loss * world_size).backward())."""
    hidden, weight, labels = problem()
    n_loss = int((labels != IGNORE_INDEX).sum())
    for factor in (1.0, 3.0):
        reference = loss_and_grads(lambda h, w: token_loss_sum(h @ w.T, labels) / n_loss * factor, hidden, weight)
        for chunk_tokens in (1, 7, n_loss, 10_000):
            loss, hidden_grad, weight_grad = loss_and_grads(
                lambda h, w: fused(labels, chunk_tokens, 1.0 / n_loss)(h, w) * factor, hidden, weight)
            for got, want in ((loss, reference[0]), (hidden_grad, reference[1]), (weight_grad, reference[2])):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"chunk_tokens={chunk_tokens}")
    assert reference[1][1].abs().sum() == 0 and hidden_grad[1].abs().sum() == 0  # the row without loss tokens


def test_fused_loss_with_a_frozen_head_computes_no_weight_gradient():
    hidden, weight, labels = problem(seed=2)
    n_loss = int((labels != IGNORE_INDEX).sum())
    reference_hidden = hidden.clone().requires_grad_()
    (token_loss_sum(reference_hidden @ weight.T, labels) / n_loss).backward()
    frozen = weight.clone()  # requires_grad False: a LoRA run's head
    trained = hidden.clone().requires_grad_()
    fused(labels, 5, 1.0 / n_loss)(trained, frozen).backward()
    assert frozen.grad is None
    torch.testing.assert_close(trained.grad, reference_hidden.grad, rtol=1e-5, atol=1e-7)


def test_fused_loss_holds_one_chunk_of_logits_and_its_gradient_at_a_time(monkeypatch):
    """The [chunk, V] buffers are the loss's memory (common.memory prices two per element: the logits and their
    gradient): each chunk's gradient is freed before the next chunk's logits exist."""
    import weakref

    import common.loss

    hidden, weight, labels = problem(seed=4)
    alive_at_each_chunk, earlier = [], []

    def chunk_math(logits, labels, scale):
        alive_at_each_chunk.append(sum(ref() is not None for ref in earlier))
        loss, grad = common.loss._chunk_loss_and_logit_grad(logits, labels, scale)
        earlier.append(weakref.ref(grad))
        return loss, grad

    monkeypatch.setattr(common.loss, "_chunk_math", lambda device: chunk_math)
    fused(labels, 7, 0.1)(hidden.clone().requires_grad_(), weight.clone().requires_grad_()).backward()
    assert len(alive_at_each_chunk) > 3 and alive_at_each_chunk == [0] * len(alive_at_each_chunk)


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (item(), float(), bool(), int(): _local_scalar_dense)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_fused_loss_reads_nothing_back(monkeypatch):
    """Neither forward nor backward waits for a value from the device: the scale is a tensor, the loss tokens are
    chosen from the labels' host copy, and backward multiplies by its incoming gradient instead of testing it."""
    hidden, weight, labels = problem(seed=3)
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    tolist = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: tolist.append(self) or [])
    with HostReads() as counter:
        loss = fused_linear_cross_entropy(hidden, weight, labels, 8, torch.tensor(0.01))
        loss.backward()
    assert counter.reads == 0 and not tolist
    with HostReads() as counter:
        loss.detach().item()
    assert counter.reads == 1  # the counter does see a read


def test_fused_loss_backward_runs_once():
    hidden, weight, labels = problem()
    loss = fused(labels, 8, 0.5)(hidden.clone().requires_grad_(), weight.clone().requires_grad_())
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_no_loss_tokens_gives_zero_and_zero_gradients():
    hidden, weight, labels = problem()
    labels[:] = IGNORE_INDEX
    for loss_fn in (chunked(labels, 8), fused(labels, 8, 0.5)):
        loss, hidden_grad, weight_grad = loss_and_grads(loss_fn, hidden, weight)
        assert loss.item() == 0.0
        assert hidden_grad.abs().sum() == 0 and weight_grad.abs().sum() == 0


def test_bf16_autocast_matches_the_plain_loss():
    # Under autocast the head runs in bf16 (as the model's nn.Linear would) and the cross-entropy in fp32;
    # checkpoint replays the autocast state when it recomputes a chunk in backward.
    hidden, weight, labels = problem(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = loss_and_grads(lambda h, w: token_loss_sum(torch.nn.functional.linear(h, w), labels),
                                   hidden, weight)
        results = [loss_and_grads(chunked(labels, 5), hidden, weight),
                   loss_and_grads(fused(labels, 5, 1.0), hidden, weight)]
    for result in results:
        for got, want in zip(result, reference):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_bad_chunk_size_is_refused():
    hidden, weight, labels = problem()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_loss_sum(hidden, weight, labels, 0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_linear_cross_entropy(hidden, weight, labels, 0, torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------------------------
# single-ft with the flags: the same training steps


def run(tmp_path, name, data, *args):
    out = tmp_path / name
    single_ft.main(["--data", str(data), "--seq-len", "128", "--out-dir", str(out), "--dtype", "fp32",
                    "--eval-fraction", "0", *map(str, args)])
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def records(tmp_path, name):
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def assert_head_counted_on_loss_tokens(tmp_path, head_flops_per_token):
    """The chunked run's steps count the LM head (qwen3-tiny's V x d = 8,192 x 256, times `head_flops_per_token`)
    on their loss tokens alone: the plain run's count of the same steps less the head on every other token."""
    for plain, chunked in zip(records(tmp_path, "plain"), records(tmp_path, "chunked"), strict=True):
        assert (chunked["tokens"], chunked["loss_tokens"]) == (plain["tokens"], plain["loss_tokens"])
        assert 0 < chunked["loss_tokens"] < chunked["tokens"]
        skipped = chunked["tokens"] - chunked["loss_tokens"]
        assert chunked["flops"] == plain["flops"] - head_flops_per_token * 8192 * 256 * skipped


@pytest.mark.slow
def test_single_ft_fused_loss_gives_the_same_steps(tmp_path, small_data, monkeypatch):
    args = ("--steps", 3, "--micro-batch-size", 2, "--grad-accum", 2)
    plain_losses = run(tmp_path, "plain", small_data, *args)
    calls = []
    monkeypatch.setattr(single_ft, "fused_linear_cross_entropy",
                        lambda *a: calls.append(a[3]) or fused_linear_cross_entropy(*a))
    # 100 does not divide the loss tokens of a micro-batch of 2 x 128 slots: several chunks and a remainder.
    chunked_losses = run(tmp_path, "chunked", small_data, *args, "--loss-chunk-tokens", 100)
    assert calls == [100] * 6  # the flag really switched the loss: 3 steps x 2 micro-batches
    assert len(plain_losses) == 3
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-5)
    assert plain_losses[-1] != pytest.approx(plain_losses[0], rel=1e-3)  # the steps really trained
    assert_head_counted_on_loss_tokens(tmp_path, 6)


@pytest.mark.slow
def test_single_ft_fused_loss_with_lora(tmp_path, small_data):
    args = ("--steps", 3, "--micro-batch-size", 2, "--lora-rank", 4)
    plain_losses = run(tmp_path, "plain", small_data, *args)
    chunked_losses = run(tmp_path, "chunked", small_data, *args, "--loss-chunk-tokens", 64)
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-5)
    assert plain_losses[-1] != pytest.approx(plain_losses[0], rel=1e-4)
    assert_head_counted_on_loss_tokens(tmp_path, 4)  # a frozen head: no weight gradient


@pytest.mark.slow
def test_single_ft_compile_gives_the_same_steps(tmp_path, small_data):
    from torch._dynamo.utils import counters

    args = ("--steps", 2, "--micro-batch-size", 2)
    eager = run(tmp_path, "eager", small_data, *args)
    counters.clear()
    start = time.perf_counter()
    compiled = run(tmp_path, "compiled", small_data, *args, "--compile")
    print(f"--compile run (compilation included): {time.perf_counter() - start:.1f} s")
    assert compiled == pytest.approx(eager, rel=1e-4)
    # Per-layer compilation: the decoder layers share one graph (compiled once), with no graph break inside.
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
