"""common/attention.py: the per-device choice, device description, global switches, and the custom
expanded-KV math attention checked numerically on a tiny Qwen3 with a packed row."""

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
    choice = choose_attention(info)
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
        assert choose_attention(info, "sdpa") == choose_attention(info, "auto")


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
    with pytest.raises(ValueError, match="auto, sdpa, eager, flash"):
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
