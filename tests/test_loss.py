"""common/loss.py's chunked LM-head cross-entropy: same loss and gradients as the plain one, same training steps."""

import json
import time

import pytest
import torch

from common.data import IGNORE_INDEX, token_loss_sum
from common.loss import chunked_token_loss_sum
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


def test_no_loss_tokens_gives_zero_and_zero_gradients():
    hidden, weight, labels = problem()
    labels[:] = IGNORE_INDEX
    loss, hidden_grad, weight_grad = loss_and_grads(chunked(labels, 8), hidden, weight)
    assert loss.item() == 0.0
    assert hidden_grad.abs().sum() == 0 and weight_grad.abs().sum() == 0


def test_bf16_autocast_matches_the_plain_loss():
    # Under autocast the head runs in bf16 (as the model's nn.Linear would) and the cross-entropy in fp32;
    # checkpoint replays the autocast state when it recomputes a chunk in backward.
    hidden, weight, labels = problem(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = loss_and_grads(lambda h, w: token_loss_sum(torch.nn.functional.linear(h, w), labels),
                                   hidden, weight)
        result = loss_and_grads(chunked(labels, 5), hidden, weight)
    for got, want in zip(result, reference):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_bad_chunk_size_is_refused():
    hidden, weight, labels = problem()
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_loss_sum(hidden, weight, labels, 0)


# ---------------------------------------------------------------------------------------------------------------
# single-ft with the flags: the same training steps


def run(tmp_path, name, data, *args):
    out = tmp_path / name
    single_ft.main(["--data", str(data), "--seq-len", "128", "--out-dir", str(out), "--dtype", "fp32",
                    "--eval-fraction", "0", *map(str, args)])
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_single_ft_chunked_loss_gives_the_same_steps(tmp_path, small_data, monkeypatch):
    args = ("--steps", 3, "--micro-batch-size", 2, "--grad-accum", 2)
    plain_losses = run(tmp_path, "plain", small_data, *args)
    calls = []
    monkeypatch.setattr(single_ft, "chunked_token_loss_sum",
                        lambda *a: calls.append(a[3]) or chunked_token_loss_sum(*a))
    # 100 does not divide the loss tokens of a micro-batch of 2 x 128 slots: several chunks and a remainder.
    chunked_losses = run(tmp_path, "chunked", small_data, *args, "--loss-chunk-tokens", 100)
    assert calls == [100] * 6  # the flag really switched the loss: 3 steps x 2 micro-batches
    assert len(plain_losses) == 3
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-5)
    assert plain_losses[-1] != pytest.approx(plain_losses[0], rel=1e-3)  # the steps really trained


@pytest.mark.slow
def test_single_ft_chunked_loss_with_lora(tmp_path, small_data):
    args = ("--steps", 3, "--micro-batch-size", 2, "--lora-rank", 4)
    plain_losses = run(tmp_path, "plain", small_data, *args)
    chunked_losses = run(tmp_path, "chunked", small_data, *args, "--loss-chunk-tokens", 64)
    assert chunked_losses == pytest.approx(plain_losses, rel=1e-5)
    assert plain_losses[-1] != pytest.approx(plain_losses[0], rel=1e-4)


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
