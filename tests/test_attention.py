"""common/attention.py: the per-device choice, device description, global switches, the custom expanded-KV math
attention, the variable-length attention (document boundaries, every kernel's adapter, the CPU reference) and
FlexAttention with a document block mask, checked numerically on a tiny Qwen3 with packed rows; neither packed path
reads the device, and neither recompiles a compiled layer when the document count changes."""

import importlib.util
from importlib.machinery import ModuleSpec
from types import SimpleNamespace

import pytest
import torch
import transformers

from common import attention
from common.attention import (
    MATH_EXPANDED_KV,
    AttentionChoice,
    DeviceInfo,
    apply_attention_choice,
    choose_attention,
    describe_device,
    setup_attention,
)

CPU = DeviceInfo("cpu", "cpu", None)
H100 = DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", "sm_90")
MI100 = DeviceInfo("rocm", "AMD Instinct MI100", "gfx908")
MI50 = DeviceInfo("rocm", "AMD Instinct MI50", "gfx906")
MI250 = DeviceInfo("rocm", "AMD Instinct MI250X", "gfx90a")
MI300 = DeviceInfo("rocm", "AMD Instinct MI300X", "gfx942")
RADEON = DeviceInfo("rocm", "AMD Radeon RX 7900 XTX", "gfx1100")
NO_FAST_VARLEN = ("flex", "reference")  # an install with neither torch's varlen_attn nor flash-attn
ALL_VARLEN = ("torch", "flash_attn", "flex", "reference")

SWITCHES = {
    "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    "efficient": (torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.enable_mem_efficient_sdp),
    "cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    "math": (torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
}


@pytest.fixture
def restore_sdp_switches():
    """apply_attention_choice changes process-wide switches; put them back for the other tests."""
    saved = {name: is_enabled() for name, (is_enabled, _) in SWITCHES.items()}
    yield
    for name, (_, enable) in SWITCHES.items():
        enable(saved[name])


def enabled_switches() -> set[str]:
    return {name for name, (is_enabled, _) in SWITCHES.items() if is_enabled()}


def fake_flash_attn(monkeypatch, installed: bool) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "flash_attn":
            return ModuleSpec("flash_attn", None) if installed else None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


# --- choose_attention: auto --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "info, impl, backends, mentions",
    [
        (CPU, "sdpa", ("flash", "math"), "CPU"),
        (H100, "sdpa", ("flash", "efficient", "cudnn", "math"), "sm_90"),
        (MI100, MATH_EXPANDED_KV, ("math",), "gfx908"),
        (MI50, MATH_EXPANDED_KV, ("math",), "gfx906"),
        (MI250, "sdpa", ("flash", "efficient", "math"), "gfx90a"),
        (MI300, "sdpa", ("flash", "efficient", "math"), "gfx942"),
        (DeviceInfo("rocm", "AMD Instinct MI355X", "gfx950"), "sdpa", ("flash", "efficient", "math"), "gfx950"),
        (RADEON, MATH_EXPANDED_KV, ("math",), "gfx1100"),
    ],
)
def test_auto_choice_per_device(info, impl, backends, mentions):
    choice = choose_attention(info, varlen_kernels=NO_FAST_VARLEN)
    assert choice.impl == impl
    assert choice.sdpa_backends == backends
    assert mentions in choice.reason


def test_math_only_reasons_say_why():
    assert "GQA" in choose_attention(MI100).reason
    assert "not known to this table" in choose_attention(RADEON).reason
    assert "not known" not in choose_attention(MI100).reason


# --- choose_attention: explicit requests -------------------------------------------------------------------


@pytest.mark.parametrize("info", [CPU, H100, MI100, MI300, RADEON])
def test_eager_request_overrides_auto(info):
    choice = choose_attention(info, "eager")
    assert (choice.impl, choice.sdpa_backends) == ("eager", ())
    assert info.label() in choice.reason


def test_sdpa_request_matches_auto_where_auto_is_sdpa():
    for info in (CPU, H100, MI250, MI300):
        assert choose_attention(info, "sdpa") == choose_attention(info, "auto", varlen_kernels=NO_FAST_VARLEN)


@pytest.mark.parametrize("info", [MI100, MI50, RADEON])
def test_sdpa_request_on_math_only_arch_keeps_stock_sdpa_on_math(info):
    choice = choose_attention(info, "sdpa")
    assert (choice.impl, choice.sdpa_backends) == ("sdpa", ("math",))
    assert info.arch in choice.reason


@pytest.mark.parametrize("info", [H100, MI300])
def test_flash_request_with_flash_attn_installed(monkeypatch, info):
    fake_flash_attn(monkeypatch, installed=True)
    choice = choose_attention(info, "flash")
    assert (choice.impl, choice.sdpa_backends) == ("flash_attention_2", ())
    assert info.arch in choice.reason


def test_flash_request_without_flash_attn_says_what_to_do(monkeypatch):
    fake_flash_attn(monkeypatch, installed=False)
    with pytest.raises(ImportError, match=r"flash_attn.*--attn sdpa"):
        choose_attention(H100, "flash")


def test_flash_request_on_cpu_is_an_error_even_with_flash_attn(monkeypatch):
    fake_flash_attn(monkeypatch, installed=True)
    with pytest.raises(ValueError, match="needs a GPU"):
        choose_attention(CPU, "flash")


@pytest.mark.parametrize("requested", ["flash_attention_2", "SDPA", "", "math"])
def test_invalid_request_lists_valid_values(requested):
    with pytest.raises(ValueError, match="auto, sdpa, eager, flash, varlen"):
        choose_attention(H100, requested)


# --- describe_device ---------------------------------------------------------------------------------------


def test_describe_cpu():
    assert describe_device(torch.device("cpu")) == DeviceInfo("cpu", "cpu", None)


def test_describe_rocm_strips_feature_flags_from_arch(monkeypatch):
    props = SimpleNamespace(name="AMD Instinct MI100", gcnArchName="gfx908:sramecc+:xnack-", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    assert describe_device(torch.device("cuda", 1)) == MI100


def test_describe_nvidia_uses_compute_capability(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.version, "hip", None)
    assert describe_device(torch.device("cuda", 0)) == H100


def test_describe_rejects_other_device_types():
    with pytest.raises(ValueError, match="mps"):
        describe_device(torch.device("mps"))


# --- apply_attention_choice / setup_attention --------------------------------------------------------------


@pytest.mark.usefixtures("restore_sdp_switches")
def test_apply_sets_exactly_the_chosen_backends():
    apply_attention_choice(choose_attention(MI100))
    assert enabled_switches() == {"math"}
    apply_attention_choice(choose_attention(H100))
    assert enabled_switches() == {"flash", "efficient", "cudnn", "math"}
    apply_attention_choice(choose_attention(MI300))
    assert enabled_switches() == {"flash", "efficient", "math"}


@pytest.mark.usefixtures("restore_sdp_switches")
def test_apply_leaves_switches_alone_for_non_sdpa_impl():
    apply_attention_choice(choose_attention(MI100))
    apply_attention_choice(choose_attention(H100, "eager"))
    assert enabled_switches() == {"math"}


@pytest.mark.usefixtures("restore_sdp_switches")
def test_apply_registers_custom_attention_and_its_mask():
    apply_attention_choice(choose_attention(MI100))
    assert transformers.AttentionInterface._global_mapping[MATH_EXPANDED_KV] is attention.sdpa_math_expanded_kv_forward
    # transformers looks the mask function up in the class-wide mapping; without it packed rows are not isolated.
    mask_functions = transformers.masking_utils.AttentionMaskInterface._global_mapping
    assert mask_functions[MATH_EXPANDED_KV] is transformers.masking_utils.sdpa_mask


@pytest.mark.usefixtures("restore_sdp_switches")
def test_setup_on_cpu_prints_one_line_and_applies():
    lines = []
    choice = setup_attention(torch.device("cpu"), print_fn=lines.append)
    assert choice == AttentionChoice("sdpa", ("flash", "math"), choice.reason)
    assert lines == [f"attention: sdpa (flash, math): {choice.reason}"]
    assert enabled_switches() == {"flash", "math"}


@pytest.mark.usefixtures("restore_sdp_switches")
def test_setup_eager_prints_no_sdpa():
    lines = []
    setup_attention(torch.device("cpu"), "eager", print_fn=lines.append)
    assert lines[0].startswith("attention: eager (no SDPA): ")


# --- the custom attention, numerically ---------------------------------------------------------------------

FIRST_DOC_LEN, SECOND_DOC_LEN = 10, 14


def tiny_qwen3(attn_implementation: str) -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: two query heads per KV head, the case the custom attention expands
        head_dim=16,
        intermediate_size=128,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    return model.eval()


def logits(model, input_ids, position_ids, attention_mask=None) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False)
    return out.logits


@pytest.fixture
def packed_row():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (1, FIRST_DOC_LEN + SECOND_DOC_LEN), generator=generator)
    position_ids = torch.cat([torch.arange(FIRST_DOC_LEN), torch.arange(SECOND_DOC_LEN)]).unsqueeze(0)
    return input_ids, position_ids


@pytest.mark.usefixtures("restore_sdp_switches")
def test_expanded_kv_math_matches_sdpa_and_eager_on_a_packed_row(packed_row):
    attention.register_math_expanded_kv_attention()
    model = tiny_qwen3(MATH_EXPANDED_KV)
    assert model.config._attn_implementation == MATH_EXPANDED_KV
    custom = logits(model, *packed_row)

    for reference_impl in ("sdpa", "eager"):
        model.set_attn_implementation(reference_impl)
        assert model.config._attn_implementation == reference_impl
        torch.testing.assert_close(custom, logits(model, *packed_row), rtol=0, atol=1e-5)


@pytest.mark.usefixtures("restore_sdp_switches")
def test_expanded_kv_math_keeps_packed_documents_isolated(packed_row):
    attention.register_math_expanded_kv_attention()
    model = tiny_qwen3(MATH_EXPANDED_KV)
    input_ids, position_ids = packed_row
    packed = logits(model, input_ids, position_ids)
    second_alone = logits(model, input_ids[:, FIRST_DOC_LEN:], torch.arange(SECOND_DOC_LEN).unsqueeze(0))
    torch.testing.assert_close(packed[:, FIRST_DOC_LEN:], second_alone, rtol=0, atol=1e-5)
    # The check has teeth: a 2D attention_mask turns off transformers' packed-row detection, leaving one causal
    # mask over the whole row (what a missing mask function would give), and then the second document sees the first.
    whole_row_causal = logits(model, input_ids, position_ids, attention_mask=torch.ones_like(input_ids))
    assert (whole_row_causal[:, FIRST_DOC_LEN:] - second_alone).abs().max() > 1e-3


# --- varlen: the choice --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "info, requested, kernels, kernel, backends",
    [
        (CPU, "varlen", ALL_VARLEN, "reference", ("flash", "math")),
        (H100, "varlen", ALL_VARLEN, "torch", ("flash", "efficient", "cudnn", "math")),
        (H100, "varlen", ("flash_attn", "flex", "reference"), "flash_attn", ("flash", "efficient", "cudnn", "math")),
        (H100, "varlen", NO_FAST_VARLEN, "flex", ("flash", "efficient", "cudnn", "math")),
        (H100, "auto", ("torch", "flex", "reference"), "torch", ("flash", "efficient", "cudnn", "math")),
        (H100, "auto", ("flash_attn", "flex", "reference"), "flash_attn", ("flash", "efficient", "cudnn", "math")),
        (MI100, "varlen", ("torch", "flex", "reference"), "reference", ("math",)),
        (MI300, "varlen", ("torch", "flex", "reference"), "torch", ("flash", "efficient", "math")),
        (MI300, "varlen", NO_FAST_VARLEN, "reference", ("math",)),
    ],
)
def test_varlen_kernel_per_device_and_install(info, requested, kernels, kernel, backends):
    choice = choose_attention(info, requested, varlen_kernels=kernels)
    assert (choice.impl, choice.varlen_kernel, choice.sdpa_backends) == ("varlen", kernel, backends)
    assert info.label() in choice.reason


def test_auto_never_picks_varlen_off_nvidia_or_without_a_fast_kernel():
    assert choose_attention(H100, "auto", varlen_kernels=NO_FAST_VARLEN).impl == "sdpa"  # flex only on request
    for info in (CPU, MI100, MI300):
        assert choose_attention(info, "auto", varlen_kernels=ALL_VARLEN).impl != "varlen"


def test_forward_kwargs_are_empty_except_for_varlen(packed_row):
    _, position_ids = packed_row
    assert choose_attention(CPU, "sdpa").forward_kwargs(position_ids, torch.device("cpu")) == {}
    kwargs = choose_attention(CPU, "varlen").forward_kwargs(position_ids, torch.device("cpu"))
    assert kwargs["cu_seq_lens_q"].tolist() == [0, FIRST_DOC_LEN, FIRST_DOC_LEN + SECOND_DOC_LEN]
    assert kwargs["cu_seq_lens_k"] is kwargs["cu_seq_lens_q"]
    assert kwargs["longest_document"].shape == (SECOND_DOC_LEN, 0)  # the length as a size: no data


# --- varlen: document boundaries -----------------------------------------------------------------------------


def test_document_boundaries_over_rows_restarts_and_pad_slots():
    position_ids = torch.tensor([
        [0, 1, 2, 0, 1, 0, 1, 2, 3, 0],  # three conversations, then one pad slot (its own restarted position)
        [0, 1, 2, 3, 4, 5, 0, 1, 2, 3],  # a row always starts a document, even if positions ran on
        [5, 6, 7, 8, 9, 3, 4, 0, 1, 2],  # restarts at any value, not only 0, split documents
    ])
    cu_seq_lens, longest = attention.document_boundaries(position_ids)
    assert cu_seq_lens.dtype == torch.int32
    assert cu_seq_lens.tolist() == [0, 3, 5, 9, 10, 16, 20, 25, 27, 30]
    assert longest == 6


# --- varlen: numerically -----------------------------------------------------------------------------------


@pytest.fixture
def packed_rows():
    """Two packed rows: documents of 10 + 14 tokens and 5 + 12 + 7 tokens (the last ones like pad slots)."""
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 64, (2, 24), generator=generator)
    position_ids = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]),
                                torch.cat([torch.arange(5), torch.arange(12), torch.arange(7)])])
    return input_ids, position_ids


def loss_and_grads(model, input_ids, position_ids, **kwargs):
    model.zero_grad()
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False, **kwargs)
    loss = out.logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.usefixtures("restore_sdp_switches")
def test_varlen_reference_equals_masked_sdpa_in_loss_and_gradients(packed_rows):
    choice = choose_attention(CPU, "varlen")
    apply_attention_choice(choice)
    model = tiny_qwen3("varlen").train()
    with_kwargs = loss_and_grads(model, *packed_rows, **choice.forward_kwargs(packed_rows[1], torch.device("cpu")))
    from_position_ids = loss_and_grads(model, *packed_rows)  # the fallback: documents from the layers' position_ids
    model.set_attn_implementation("sdpa")
    masked = loss_and_grads(model, *packed_rows)
    for candidate in (with_kwargs, from_position_ids):
        torch.testing.assert_close(candidate[0], masked[0], rtol=1e-6, atol=0)
        for name, grad in masked[1].items():
            torch.testing.assert_close(candidate[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The check has teeth: the same positions with each whole row as one document (documents not isolated) give
    # another loss.
    model.set_attn_implementation("varlen")
    whole_rows = loss_and_grads(model, *packed_rows, cu_seq_lens_q=torch.tensor([0, 24, 48], dtype=torch.int32),
                                max_length_q=24)
    assert (whole_rows[0] - masked[0]).abs() > 1e-4


@pytest.mark.usefixtures("restore_sdp_switches")
def test_varlen_and_flex_register_no_mask_function(packed_rows):
    """Without a mask function transformers builds no mask for them and skips its packed-row check (a device read
    per forward, see test_the_packed_paths_read_nothing_back_where_sdpa_does); a mask handed to the attention
    function itself is refused."""
    mask_functions = transformers.masking_utils.AttentionMaskInterface._global_mapping
    for choice in (choose_attention(CPU, "varlen"), FLEX_CHOICE):
        apply_attention_choice(choice)
        assert choice.impl in transformers.AttentionInterface._global_mapping and choice.impl not in mask_functions
    q = torch.zeros(1, 4, 24, 16)
    for function in (attention.flex_attention_forward,
                     transformers.AttentionInterface._global_mapping[attention.VARLEN]):
        with pytest.raises(ValueError, match="no padding mask"):
            function(None, q, q, q, torch.ones(1, 1, 24, 24, dtype=torch.bool))


@pytest.mark.usefixtures("restore_sdp_switches")
def test_varlen_and_flex_hand_decoding_with_a_kv_cache_to_sdpa():
    """A query shorter than the keys (decoding with a KV cache) is not a packed row: both attention functions return
    what transformers' SDPA returns for it, whatever document kwargs the model call carried."""
    apply_attention_choice(choose_attention(CPU, "varlen"))
    generator = torch.Generator().manual_seed(4)
    query = torch.randn(1, 4, 1, 16, generator=generator)
    key, value = (torch.randn(1, 2, 9, 16, generator=generator) for _ in range(2))
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    expected, _ = transformers.integrations.sdpa_attention.sdpa_attention_forward(module, query, key, value, None,
                                                                                 scaling=0.3)
    document_kwargs = dict(cu_seq_lens_q=torch.tensor([0, 1], dtype=torch.int32), position_ids=torch.tensor([[8]]))
    for function in (attention.flex_attention_forward,
                     transformers.AttentionInterface._global_mapping[attention.VARLEN]):
        out, weights = function(module, query, key, value, None, scaling=0.3, **document_kwargs)
        assert weights is None
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # The check has teeth: the query taken as a one-token document would read only the newest key's value.
    assert (expected - value[:, :, -1:].repeat_interleave(2, dim=1).transpose(1, 2)).abs().max() > 1e-3


def qkv_of_packed_rows(heads=4, kv_heads=2, head_dim=16):
    """[tokens, heads, d] queries and [tokens, kv_heads, d] keys/values of two rows of three documents."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(48, heads, head_dim, generator=generator)
    k, v = (torch.randn(48, kv_heads, head_dim, generator=generator) for _ in range(2))
    cu_seq_lens = torch.tensor([0, 10, 24, 29, 41, 48], dtype=torch.int32)
    return q, k, v, cu_seq_lens, 14


def masked_reference(q, k, v, cu_seq_lens, scale):
    """Plain SDPA over all tokens with a block-diagonal causal mask: what every kernel must return."""
    document = torch.searchsorted(cu_seq_lens[1:].long(), torch.arange(q.shape[0]), right=True)
    mask = (document[:, None] == document[None, :]).tril()
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_kernel_forward_equals_the_masked_reference():
    # FlexAttention has no CPU backward: its forward is checked here, its backward on a GPU by the GPU suite.
    q, k, v, cu_seq_lens, longest = qkv_of_packed_rows()
    expected = masked_reference(q, k, v, cu_seq_lens, 0.3)
    torch.testing.assert_close(attention._flex_varlen(q, k, v, cu_seq_lens, longest, 0.3), expected, rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(attention._reference_varlen(q, k, v, cu_seq_lens, longest, 0.3), expected,
                               rtol=1e-5, atol=1e-6)


def fake_varlen_attn(calls):
    """Three generations of torch's varlen_attn signature, each computing with the reference; `calls` records what
    the adapter passed."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, enable_gqa):
        calls.append(dict(kv_heads=k.shape[1], causal=causal, scale=scale, enable_gqa=enable_gqa, max_q=max_q))
        assert causal, "the adapter must ask for causal attention"
        if not enable_gqa:
            assert k.shape[1] == q.shape[1], "without enable_gqa, K/V must come with all query heads"
        return attention._reference_varlen(q, k, v, cu_q, max_q, scale if scale is not None else q.shape[-1] ** -0.5)

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, False)

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale, False)

    def later(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
              window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, tuple(window_size) == (-1, 0), scale,
                   enable_gqa)

    return {"2.10": torch_2_10, "2.11": torch_2_11, "later": later}


@pytest.mark.parametrize("version", ["2.10", "2.11", "later"])
def test_torch_varlen_adapter_follows_each_signature(monkeypatch, version):
    import torch.nn.attention.varlen as varlen_module

    calls = []
    monkeypatch.setattr(varlen_module, "varlen_attn", fake_varlen_attn(calls)[version])
    q, k, v, cu_seq_lens, longest = qkv_of_packed_rows()
    scale = 16 ** -0.5 if version == "2.10" else 0.3  # 2.10 takes no scale: only the default one is accepted
    torch.testing.assert_close(attention._torch_varlen(q, k, v, cu_seq_lens, longest, scale),
                               masked_reference(q, k, v, cu_seq_lens, scale), rtol=1e-5, atol=1e-6)
    (call,) = calls
    assert call["kv_heads"] == (2 if version == "later" else 4)  # grouped K/V heads passed as such where taken
    assert call["max_q"] == longest
    assert attention.torch_varlen_takes_gqa() == (version == "later")
    reason = choose_attention(H100, "varlen", varlen_kernels=("torch", "reference")).reason
    assert ("expanded" in reason) == (version != "later")
    if version == "2.10":
        with pytest.raises(ValueError, match="takes no scale"):
            attention._torch_varlen(q, k, v, cu_seq_lens, longest, 0.3)


def test_torch_varlen_reads_its_signature_once(monkeypatch):
    """The adapter inspects varlen_attn's signature on its first call, not in every layer's call."""
    import inspect

    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(varlen_module, "varlen_attn", fake_varlen_attn([])["later"])
    reads = []
    signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda function: reads.append(function) or signature(function))
    q, k, v, cu_seq_lens, longest = qkv_of_packed_rows()
    for _ in range(3):
        attention._torch_varlen(q, k, v, cu_seq_lens, longest, 0.3)
    assert attention.torch_varlen_takes_gqa()
    assert reads == [varlen_module.varlen_attn]


@pytest.mark.usefixtures("restore_sdp_switches")
def test_varlen_kernels_get_one_dtype_under_autocast(monkeypatch, packed_rows):
    """Under bf16 autocast Qwen3's normed queries and keys are fp32 and its values bf16; SDPA casts them itself, a
    custom kernel does not, and the fused ones take a single 16-bit dtype."""
    seen = []

    def recording(q, k, v, cu_seq_lens, max_length, scale):
        seen.append((q.dtype, k.dtype, v.dtype))
        return attention._reference_varlen(q, k, v, cu_seq_lens, max_length, scale)

    monkeypatch.setitem(attention._VARLEN_FUNCTIONS, "reference", recording)
    choice = choose_attention(CPU, "varlen")
    apply_attention_choice(choice)
    model = tiny_qwen3("varlen")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        varlen = model(input_ids=packed_rows[0], position_ids=packed_rows[1], attention_mask=None, use_cache=False,
                       **choice.forward_kwargs(packed_rows[1], torch.device("cpu"))).logits
        model.set_attn_implementation("sdpa")
        masked = model(input_ids=packed_rows[0], position_ids=packed_rows[1], attention_mask=None,
                       use_cache=False).logits
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    torch.testing.assert_close(varlen.float(), masked.float(), rtol=0, atol=2e-2)


# --- flex: document block mask ---------------------------------------------------------------------------------


FLEX_CHOICE = AttentionChoice(attention.FLEX, (), "FlexAttention on CPU, forward only (tests)")


def test_document_ids_follow_the_boundaries_rule():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0], [5, 6, 7, 8, 9, 3, 4, 0, 1, 2]])
    assert attention.document_ids(position_ids).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2, 2, 3],
                                                             [0, 0, 0, 0, 0, 1, 1, 2, 2, 2]]
    cu_seq_lens, _ = attention.document_boundaries(position_ids)
    lengths = torch.unique_consecutive(attention.document_ids(position_ids) + 10 * torch.arange(2)[:, None],
                                       return_counts=True)[1]
    assert lengths.tolist() == (cu_seq_lens[1:] - cu_seq_lens[:-1]).tolist()


def test_flex_on_cpu_is_refused_for_training_with_the_reason():
    if attention.flex_trains_on_cpu():
        pytest.skip("this torch's FlexAttention has a CPU backward")
    with pytest.raises(ValueError, match="--attn flex trains on a GPU only: FlexAttention has no backward on CPU"):
        choose_attention(CPU, "flex")
    choice = choose_attention(H100, "flex")
    assert choice.impl == "flex" and "static shapes" in choice.reason


@pytest.mark.usefixtures("restore_sdp_switches")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_masked_sdpa_and_eager(packed_rows):
    """FlexAttention with the block mask from the rows' document ids computes what SDPA and eager attention compute
    with transformers' block-diagonal mask (forward: this torch has no FlexAttention backward on CPU; the GPU suite
    checks the backward), with the mask from the model call's kwargs or built in each layer from position_ids."""
    apply_attention_choice(FLEX_CHOICE)
    model = tiny_qwen3(attention.FLEX).eval()
    input_ids, position_ids = packed_rows

    def logits(**kwargs):
        with torch.no_grad():
            return model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False,
                         **kwargs).logits

    with_kwargs = logits(**FLEX_CHOICE.forward_kwargs(position_ids, torch.device("cpu")))
    from_position_ids = logits()
    references = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        references[impl] = logits()
    for reference in references.values():
        torch.testing.assert_close(with_kwargs, reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(from_position_ids, reference, rtol=1e-5, atol=1e-5)
    # The check has teeth: each row as one document gives other logits.
    model.set_attn_implementation(attention.FLEX)
    one_document = attention.block_mask_of_documents(torch.zeros_like(position_ids, dtype=torch.int32))
    assert (logits(document_block_mask=one_document) - references["sdpa"]).abs().max() > 1e-3


def caller_outside_torch() -> str:
    import traceback

    frame = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and f.filename != __file__][-1]
    return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.name}"


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that copy a tensor's value to the host (item(), bool(), int(), float() all dispatch
    _local_scalar_dense, also when C++ code asks), each with the last Python frame outside torch that led to it."""

    def __init__(self):
        super().__init__()
        self.callers = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.callers.append(caller_outside_torch())
        return func(*args, **(kwargs or {}))


READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.usefixtures("restore_sdp_switches")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_the_packed_paths_read_nothing_back_where_sdpa_does(packed_rows, monkeypatch):
    """On a GPU a value read back from the device stops the host until the device has caught up. transformers'
    SDPA path over packed rows reads one per forward (its packed-row check in masking_utils); varlen and flex do
    not: their mask-free registration skips that check, and flex builds its block mask on the device without a
    read. Counted in two ways: the block mask's construction under a dispatch mode that sees every read, C++ ones
    included; the second forward by wrapping every Tensor method that reads (FlexAttention's eager kernel compiles
    itself on its first calls, which torch.compile refuses under a dispatch mode, and tracing reads host scalars).
    varlen's boundaries come from the batch's host copy by design (tests/test_single_ft.py counts the step's
    reads)."""
    input_ids, position_ids = packed_rows
    forward_reads = []
    torch._dynamo.reset()  # a graph compiled by an earlier test for another attention scale takes it as a tensor

    def counting(method):
        def wrapper(self, *args, **kwargs):
            forward_reads.append(f"{caller_outside_torch()}:{method.__name__}")
            return method(self, *args, **kwargs)
        return wrapper

    counts = {}
    for name, choice in (("sdpa", choose_attention(CPU, "sdpa")), ("flex", FLEX_CHOICE)):
        apply_attention_choice(choice)
        model = tiny_qwen3(choice.impl).eval()
        with HostReads() as build:
            kwargs = choice.forward_kwargs(position_ids, torch.device("cpu"))
        with torch.no_grad():  # a first forward: eager FlexAttention on CPU compiles itself on its first calls
            model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False, **kwargs)
        forward_reads.clear()
        with monkeypatch.context() as patch, torch.no_grad():
            for method in READ_METHODS:
                patch.setattr(torch.Tensor, method, counting(getattr(torch.Tensor, method)))
            model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False, **kwargs)
        counts[name] = (build.callers, list(forward_reads))
    assert counts["sdpa"] == ([], ["masking_utils.py:find_packed_sequence_indices:__bool__"])
    assert counts["flex"] == ([], [])


def compiled_forwards(choice, documents_per_row, int_length=False):
    """Frames torch.compile has compiled after each forward of a tiny Qwen3 whose decoder layers are compiled one
    by one (as --compile does), over micro-batches with different numbers of documents (backend "eager": what
    recompiles is decided by the guards, before any code generation)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    apply_attention_choice(choice)
    model = tiny_qwen3(choice.impl).eval()
    for layer in model.model.layers:
        layer.compile(backend="eager")
    generator = torch.Generator().manual_seed(0)
    compiled = []
    for lengths in documents_per_row:
        position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths])] * 2)
        kwargs = choice.forward_kwargs(position_ids, torch.device("cpu"))
        if int_length:  # the longest document as a plain int (transformers' max_length_q): a constant of the graph
            kwargs = dict(cu_seq_lens_q=kwargs["cu_seq_lens_q"], max_length_q=kwargs["longest_document"].shape[0])
        with torch.no_grad():
            model(input_ids=torch.randint(0, 64, position_ids.shape, generator=generator), position_ids=position_ids,
                  attention_mask=None, use_cache=False, **kwargs)
        compiled.append(counters["frames"]["ok"])
    torch._dynamo.reset()
    return compiled


@pytest.mark.usefixtures("restore_sdp_switches")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_compiled_layers_do_not_recompile_when_the_document_count_changes():
    documents = [(10, 14), (5, 12, 7), (3, 3, 3, 15), (24,), (2, 2, 2, 2, 16)]
    for choice in (choose_attention(CPU, "varlen"), FLEX_CHOICE):
        compiled = compiled_forwards(choice, documents)
        assert compiled[0] > 0 and compiled[1:] == [compiled[0]] * 4, (choice.impl, compiled)
    # The test has teeth: the longest document passed as an int is guarded on, and its first change recompiles.
    compiled = compiled_forwards(choose_attention(CPU, "varlen"), documents, int_length=True)
    assert compiled[1] > compiled[0]
