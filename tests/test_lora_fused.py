"""--lora-fused (common/lora.py): the same LoRA steps as peft's path in fewer kernels. Per step the same loss and
adapter gradients (fp32, also with grad accumulation, activation checkpointing and torch.compile); the same adapter
on disk, loadable by peft; fewer thin products per decoder layer, counted (the claim the GPU suite's fused rung
measures); what it cannot compute is refused."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from common.lora import LoraFusionError, fuse_lora
from common.models import add_lora, load_model, load_tokenizer
from conftest import load_experiment, load_infer

RANK = 4
PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
ELEMENTWISE = {torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor, torch.ops.aten.mul.Tensor,
               torch.ops.aten.mul.Scalar}


def tiny_lora(fused: bool, seed: int = 0):
    """qwen3-tiny with rank-4 adapters whose B is not zero (peft starts B at zero, which would hide the up product's
    gradient), the same values with and without fusion."""
    torch.manual_seed(seed)
    model = add_lora(load_model("qwen3-tiny", load_tokenizer("qwen3-tiny"), "sdpa", device=torch.device("cpu")),
                     RANK, 2.0 * RANK, fused=fused)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.train()


class CountOps(TorchDispatchMode):
    """Matrix products by whether they are thin (a dimension of at most the 3 stacked ranks: an adapter's), and
    element-wise adds and multiplies of activation size (at least tokens x the narrowest projection's width)."""

    def __init__(self, activation_numel: int) -> None:
        super().__init__()
        self.activation_numel = activation_numel
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in PRODUCTS:
            a, b = args[-2], args[-1]
            thin = min(a.shape[-2], a.shape[-1], b.shape[-1]) <= 3 * RANK
            self.counts["thin products" if thin else "wide products"] += 1
        elif func in ELEMENTWISE and out.numel() >= self.activation_numel:
            self.counts["activation-sized adds and multiplies"] += 1
        return out


def count_one_layer(model, tokens: int = 32) -> tuple[Counter, Counter, torch.Tensor, dict]:
    """Forward and backward of the first decoder layer on random hidden states: the ops each issues, its output and
    its adapters' gradients."""
    decoder = model.get_decoder()
    layer = decoder.layers[0]
    hidden = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(2),
                         requires_grad=True)
    position_ids = torch.arange(tokens)[None]
    rotary = decoder.rotary_emb(hidden, position_ids)
    narrowest = model.config.num_key_value_heads * model.config.head_dim
    with CountOps(tokens * narrowest) as forward:
        out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
        out = out[0] if isinstance(out, tuple) else out
    with CountOps(tokens * narrowest) as backward:
        out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.requires_grad}
    return forward.counts, backward.counts, out.detach(), grads


def test_a_fused_decoder_layer_computes_peft_s_layer_with_fewer_thin_products():
    plain, fused = tiny_lora(fused=False), tiny_lora(fused=True)
    assert list(plain.state_dict()) == list(fused.state_dict())  # the same names, in the same order
    plain_forward, plain_backward, plain_out, plain_grads = count_one_layer(plain)
    fused_forward, fused_backward, fused_out, fused_grads = count_one_layer(fused)
    torch.testing.assert_close(fused_out, plain_out, rtol=1e-6, atol=1e-6)
    assert plain_grads.keys() == fused_grads.keys() and len(plain_grads) == 2 * 7
    for name, grad in plain_grads.items():
        assert (fused_grads[name] - grad).abs().max() <= 1e-6 * grad.abs().max(), name
    print("peft :", dict(plain_forward), dict(plain_backward))
    print("fused:", dict(fused_forward), dict(fused_backward))
    # Forward: the 7 base products either way. peft: per projection a down and an up product, then a scale and an add
    # over [tokens x d_out]. Fused: one down product for q/k/v, one for gate/up, one each for o and down (4), and 7
    # up products that add themselves into the base output (addmm): no scale, no add.
    assert plain_forward["wide products"] == fused_forward["wide products"] == 7
    assert (plain_forward["thin products"], fused_forward["thin products"]) == (14, 11)
    assert plain_forward["activation-sized adds and multiplies"] - \
        fused_forward["activation-sized adds and multiplies"] == 2 * 7
    # Backward: per up product two thin products either way (B's gradient, the down output's); per down product
    # two (A's gradient, the input's): 7 x 2 + 7 x 2 for peft, 7 x 2 + 4 x 2 fused.
    assert (plain_backward["thin products"], fused_backward["thin products"]) == (28, 22)
    # And 10 fewer activation-sized passes: peft's 7 scalings of the up products' gradients, and the layer input's
    # gradient summed from 3 fewer uses (q/k/v's input read by 4 products, not 6; gate/up's by 3, not 4).
    assert plain_backward["activation-sized adds and multiplies"] - \
        fused_backward["activation-sized adds and multiplies"] == 7 + 3


def test_fusion_needs_no_bitsandbytes(monkeypatch):
    """bitsandbytes is QLoRA's (the `qlora` group): a machine without it fuses plain LoRA all the same. peft's 4-bit
    layer module imports it at its top, so the fusion asks for that module lazily (a GPU machine without
    bitsandbytes failed here once)."""
    import sys
    model = tiny_lora(fused=False)  # peft's own model building, before bitsandbytes goes
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` raises ImportError
    monkeypatch.delitem(sys.modules, "peft.tuners.lora.bnb", raising=False)  # as where peft never imported it
    monkeypatch.delattr(sys.modules["peft.tuners.lora"], "bnb", raising=False)
    with pytest.raises(ImportError):
        import peft.tuners.lora.bnb  # noqa: F401
    layers = model.config.num_hidden_layers
    assert fuse_lora(model) == {"layers": 7 * layers, "shared_groups": 2 * layers}  # q/k/v and gate/up per layer


def test_fusion_refuses_dropout_and_lora_variants():
    from peft import LoraConfig, get_peft_model

    def peft_model(**options):
        torch.manual_seed(0)
        model = load_model("qwen3-tiny", load_tokenizer("qwen3-tiny"), "sdpa", device=torch.device("cpu"))
        return get_peft_model(model, LoraConfig(r=RANK, target_modules=["q_proj", "k_proj", "v_proj"], **options))

    with pytest.raises(LoraFusionError, match="has LoRA dropout .* cannot share one product"):
        fuse_lora(peft_model(lora_dropout=0.1))
    with pytest.raises(LoraFusionError, match="a LoRA variant .* plain LoRA only"):
        fuse_lora(peft_model(use_dora=True))
    assert fuse_lora(peft_model()) == {"layers": 4 * 3, "shared_groups": 4}


def test_disabled_adapters_take_peft_s_path_and_give_the_base_model():
    model = tiny_lora(fused=True)
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        adapted = model(input_ids=ids, use_cache=False).logits
        with model.disable_adapter():
            base = model(input_ids=ids, use_cache=False).logits
        base_alone = model.get_base_model()
    assert not torch.allclose(adapted, base, atol=1e-3)
    plain = tiny_lora(fused=False)
    with torch.no_grad(), plain.disable_adapter():
        torch.testing.assert_close(base, plain(input_ids=ids, use_cache=False).logits)
    assert base_alone is model.base_model.model
    # A fused layer called outside its attention module (no shared product in flight) computes its own, as peft.
    k_proj = model.get_decoder().layers[0].self_attn.k_proj
    x = torch.randn(1, 8, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(k_proj(x), type(k_proj).forward(k_proj, x), rtol=1e-6, atol=1e-6)


def test_a_mixture_of_experts_fuses_its_attention_and_leaves_the_experts_to_peft():
    torch.manual_seed(0)
    base = load_model("qwen3-moe-tiny", load_tokenizer("qwen3-tiny"), "sdpa", device=torch.device("cpu"),
                      allow_moe=True)
    model = add_lora(base, RANK, 2.0 * RANK)
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
        expected = model(input_ids=ids, use_cache=False).logits
        fused = fuse_lora(model)
        got = model(input_ids=ids, use_cache=False).logits
    layers = model.config.num_hidden_layers
    assert fused == {"layers": 4 * layers, "shared_groups": layers}  # q/k/v/o; the experts' 3-D weights: peft's
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_qlora_s_4bit_layers_fuse_within_bf16_rounding():
    """bitsandbytes quantizes and multiplies on the CPU too (before any evaluation repacks it; common/models.py):
    the fused path on a 4-bit base under bf16 autocast agrees with peft's within bf16 rounding."""
    pytest.importorskip("bitsandbytes")
    from peft.tuners.lora.bnb import Linear4bit

    from common.models import load_model_4bit

    def loss_and_grads(fused: bool):
        torch.manual_seed(0)
        model = add_lora(load_model_4bit("qwen3-tiny", load_tokenizer("qwen3-tiny"), "sdpa", torch.device("cpu")),
                         RANK, 2.0 * RANK, fused=fused).train()
        q_proj = model.get_decoder().layers[0].self_attn.q_proj
        assert type(q_proj) is Linear4bit and ("lora_shared_down" in vars(q_proj)) == fused
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        ids = torch.randint(0, 500, (2, 64), generator=torch.Generator().manual_seed(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])

    plain_loss, plain_grads = loss_and_grads(False)
    fused_loss, fused_grads = loss_and_grads(True)
    assert fused_loss == pytest.approx(plain_loss, rel=1e-3)
    assert (fused_grads - plain_grads).norm() / plain_grads.norm() < 5e-2  # bf16 products, rounded in other places


# ---------------------------------------------------------------------------------------------------------------
# single-ft with --lora-fused

single_ft = load_experiment("single-ft")


def run(tmp_path, name, data, *args):
    """single-ft in fp32; returns the summary, per-step losses and, per step, every trained gradient as the
    optimizer saw it (after clipping)."""
    gradients = []

    def record(optimizer, *_):
        gradients.append([p.grad.clone() for group in optimizer.param_groups for p in group["params"]])

    hook = register_optimizer_step_pre_hook(record)
    try:
        out = tmp_path / name
        summary = single_ft.main(["--data", str(data), "--seq-len", "128", "--out-dir", str(out), "--dtype", "fp32",
                                  "--lora-rank", str(RANK), *map(str, args)])
    finally:
        hook.remove()
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, losses, gradients


def assert_same_steps(fused, plain, loss_rel=1e-6):
    """The losses of every step to `loss_rel`; step 1's gradients, taken at the same weights, to 1e-6 of each tensor's
    largest element; later steps' to 1e-4 in norm: AdamW divides each element by its own size, so rounding in an
    element far below its tensor's largest (relatively large there) moves the weights a little apart."""
    (_, fused_losses, fused_grads), (_, plain_losses, plain_grads) = fused, plain
    assert fused_losses == pytest.approx(plain_losses, rel=loss_rel)
    assert len(fused_grads) == len(plain_grads) == len(plain_losses)
    for step, (mine, theirs) in enumerate(zip(fused_grads, plain_grads)):
        assert len(mine) == len(theirs) == 4 * 7 * 2
        for a, b in zip(mine, theirs):
            if step == 0:
                assert (a - b).abs().max() <= 1e-6 * b.abs().max(), f"step 1, {tuple(b.shape)}"
            else:
                assert (a - b).norm() <= 1e-4 * b.norm(), f"step {step + 1}, {tuple(b.shape)}"


@pytest.mark.slow
def test_single_ft_fused_takes_peft_s_steps_and_saves_peft_s_adapter(tmp_path, small_data):
    """fp32, grad accumulation 2: per step the same loss and the same adapter gradients to ~1e-6; the adapter on disk
    has the same tensors (names, shapes, values to rounding) and config, and peft loads it with the run's eval loss;
    --merge-lora writes the same merged model."""
    args = ("--steps", 4, "--micro-batch-size", 1, "--grad-accum", 2, "--lr", 1e-2)
    plain = run(tmp_path, "plain", small_data, *args, "--save-hf", tmp_path / "plain-adapter")
    fused = run(tmp_path, "fused", small_data, *args, "--lora-fused", "--save-hf", tmp_path / "fused-adapter")
    assert_same_steps(fused, plain)
    assert plain[1][-1] != pytest.approx(plain[1][0], rel=1e-3)  # the steps really trained
    assert fused[0]["eval_loss"] == pytest.approx(plain[0]["eval_loss"], rel=1e-6)
    plain_tensors = load_file(tmp_path / "plain-adapter" / "adapter_model.safetensors")
    fused_tensors = load_file(tmp_path / "fused-adapter" / "adapter_model.safetensors")
    assert list(fused_tensors) == list(plain_tensors) and len(plain_tensors) == 4 * 7 * 2
    for name, tensor in plain_tensors.items():  # four AdamW steps apart by rounding, as the gradients
        assert (fused_tensors[name] - tensor).norm() <= 1e-5 * tensor.norm(), name
    assert (tmp_path / "fused-adapter" / "adapter_config.json").read_text() == \
        (tmp_path / "plain-adapter" / "adapter_config.json").read_text()
    # PeftModel.from_pretrained (experiments/infer.py) on the fused run's adapter: the eval loss the run printed.
    infer = load_infer()
    assert infer.main(["--model", tmp_path / "fused-adapter", "--eval-data", small_data, "--seq-len", 128]) == \
        pytest.approx(fused[0]["eval_loss"], rel=1e-5)
    merged = run(tmp_path, "merged", small_data, *args, "--lora-fused", "--save-hf", tmp_path / "fused-merged",
                 "--merge-lora")
    assert_same_steps(merged, plain)
    merged_plain = run(tmp_path, "merged-plain", small_data, *args, "--save-hf", tmp_path / "plain-merged",
                       "--merge-lora")
    fused_weights = load_file(tmp_path / "fused-merged" / "model.safetensors")
    plain_weights = load_file(tmp_path / "plain-merged" / "model.safetensors")
    assert list(fused_weights) == list(plain_weights)
    for name, tensor in plain_weights.items():
        assert (fused_weights[name] - tensor).norm() <= 1e-6 * tensor.norm(), name
    assert merged_plain[0]["eval_loss"] == pytest.approx(merged[0]["eval_loss"], rel=1e-6)


@pytest.mark.slow
def test_single_ft_fused_with_activation_checkpointing_and_compile(tmp_path, small_data):
    """--activation-checkpointing recomputes the fused layers; torch.compile traces them (also inside the
    checkpointed region) without a graph break, one graph for every decoder layer as without the flag."""
    from torch._dynamo.utils import counters

    args = ("--steps", 3, "--micro-batch-size", 2)
    plain = run(tmp_path, "plain", small_data, *args)
    assert_same_steps(run(tmp_path, "recomputed", small_data, *args, "--lora-fused", "--activation-checkpointing"),
                      plain)
    graphs = {}
    for name, extra in (("plain", ()), ("fused", ("--lora-fused",)),
                        ("fused-recomputed", ("--lora-fused", "--activation-checkpointing"))):
        torch._dynamo.reset()
        counters.clear()
        compiled = run(tmp_path, f"compiled-{name}", small_data, *args, "--compile", *extra)
        assert compiled[1] == pytest.approx(plain[1], rel=1e-4), name  # compiled kernels round differently
        assert not counters["graph_break"], (name, dict(counters["graph_break"]))
        graphs[name] = counters["stats"]["unique_graphs"]
    assert graphs["fused"] == graphs["plain"], graphs
