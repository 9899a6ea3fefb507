"""Which attention kernel to use on this device, decided once and printed with its reason.

Every experiment calls `setup_attention(device, config.attn)` before building the model and passes
`choice.impl` to transformers as `attn_implementation`. The choice, per device:

- CPU: transformers' "sdpa", i.e. PyTorch's fused CPU kernel with the math kernel as fallback.
- NVIDIA: "sdpa" with every PyTorch backend enabled (flash, memory-efficient, cuDNN, math); PyTorch picks
  the fastest one that applies to each call.
- AMD MI200 (gfx90a), MI300 (gfx942), MI350 (gfx950): "sdpa" with flash, memory-efficient and math.
  PyTorch's ROCm flash and memory-efficient kernels come from AOTriton, which is built for these archs.
  cuDNN does not exist on ROCm.
- AMD MI100 (gfx908) and MI50/MI60 (gfx906): AOTriton is not built for them, so PyTorch rejects its flash
  and memory-efficient kernels there ("Flash attention was not compiled for current AMD GPU architecture",
  `check_flash_attention_hardware_support` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp). Even
  where they exist, PyTorch's ROCm memory-efficient kernel takes no grouped-query attention (it is built with
  `supports_gqa = false` in that file), and Qwen3 uses GQA. So these archs get only the math backend, through
  "sdpa_math_expanded_kv": a copy of transformers' SDPA path that first expands the KV heads to the query
  head count (like `repeat_kv`) and then runs SDPA pinned to the math kernel. What goes into the kernel
  is then the same on every device: full-head q, k, v and the same mask.
- Any other ROCm arch: not in the table above, so we assume nothing and take the gfx908 path.

`--attn sdpa|eager|flash` overrides "auto". "flash" is transformers' "flash_attention_2" and needs the
`flash_attn` package. An override that cannot work on the device (flash on CPU) stops the run with a clear
error instead of falling back without saying so.

Packed rows (several conversations in one row) rely on transformers building a block-diagonal mask from
position_ids that restart at 0, which it only does when attention_mask is None and the attention
implementation has a mask function registered. The custom attention therefore registers transformers' own
`sdpa_mask` under its name (see `register_math_expanded_kv_attention`).
"""

import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VALID_REQUESTS = ("auto", "sdpa", "eager", "flash")
MATH_EXPANDED_KV = "sdpa_math_expanded_kv"  # name under which the custom attention is registered

# SDPA backends per ROCm arch (gcnArchName without its feature flags). An arch missing here gets the math-only
# path with a reason saying it is not in this table.
ROCM_AOTRITON_ARCHS = {"gfx90a": "MI200", "gfx942": "MI300", "gfx950": "MI350"}
ROCM_MATH_ONLY_ARCHS = {"gfx906": "MI50/MI60", "gfx908": "MI100"}

ALL_CUDA_BACKENDS = ("flash", "efficient", "cudnn", "math")
ROCM_FUSED_BACKENDS = ("flash", "efficient", "math")
CPU_BACKENDS = ("flash", "math")  # PyTorch's CPU SDPA has a fused (flash-style) kernel and the math kernel
MATH_ONLY = ("math",)


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # "cpu", "cuda" (NVIDIA) or "rocm" (AMD, torch.version.hip set)
    name: str  # e.g. "NVIDIA H100 80GB HBM3", "AMD Instinct MI100", "cpu"
    arch: str | None  # "gfx908" on ROCm, "sm_90" on NVIDIA, None on CPU

    def label(self) -> str:
        """How reasons name the device, e.g. "AMD Instinct MI100 (gfx908)"."""
        return "CPU" if self.kind == "cpu" else f"{self.name} ({self.arch})"


def describe_device(device: torch.device) -> DeviceInfo:
    if device.type == "cpu":
        return DeviceInfo(kind="cpu", name="cpu", arch=None)
    if device.type != "cuda":
        raise ValueError(f"unsupported device type {device.type!r}: expected cpu or cuda (NVIDIA or ROCm)")
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        # ROCm builds still use the "cuda" device type; gcnArchName carries feature flags after the arch,
        # e.g. "gfx908:sramecc+:xnack-", and only the arch decides which kernels exist.
        return DeviceInfo(kind="rocm", name=props.name, arch=props.gcnArchName.split(":")[0])
    return DeviceInfo(kind="cuda", name=props.name, arch=f"sm_{props.major}{props.minor}")


@dataclass(frozen=True)
class AttentionChoice:
    impl: str  # the attn_implementation passed to transformers' from_pretrained / from_config
    sdpa_backends: tuple[str, ...]  # SDPA backends left enabled; empty when impl does not go through SDPA
    reason: str  # one sentence, printed at start


def choose_attention(info: DeviceInfo, requested: str = "auto") -> AttentionChoice:
    """Pure decision: which attention implementation and SDPA backends suit `info`, honouring `requested`."""
    if requested not in VALID_REQUESTS:
        raise ValueError(f"unknown attention {requested!r}: expected one of {', '.join(VALID_REQUESTS)}")
    device = info.label()

    if requested == "eager":
        return AttentionChoice("eager", (), f"eager attention requested on {device} (plain matmul + softmax)")

    if requested == "flash":
        if info.kind == "cpu":
            raise ValueError("--attn flash needs a GPU; on CPU use --attn sdpa (or auto)")
        if importlib.util.find_spec("flash_attn") is None:
            raise ImportError(
                "--attn flash needs the flash_attn package, which is not installed: "
                "install it (pip install flash-attn --no-build-isolation) or use --attn sdpa"
            )
        return AttentionChoice(
            "flash_attention_2", (), f"flash attention requested on {device}; packed rows use its varlen path"
        )

    # "auto" and "sdpa" both go through PyTorch's SDPA; they differ only on archs that need the custom path.
    if info.kind == "cpu":
        return AttentionChoice("sdpa", CPU_BACKENDS, f"{device}: PyTorch SDPA CPU kernels (fused, math fallback)")
    if info.kind == "cuda":
        return AttentionChoice(
            "sdpa", ALL_CUDA_BACKENDS, f"{device}: PyTorch SDPA picks flash, cuDNN or memory-efficient where they apply"
        )
    if info.kind != "rocm":
        raise ValueError(f"unknown device kind {info.kind!r}: expected cpu, cuda or rocm")

    if info.arch in ROCM_AOTRITON_ARCHS:
        return AttentionChoice(
            "sdpa",
            ROCM_FUSED_BACKENDS,
            f"{device}, {ROCM_AOTRITON_ARCHS[info.arch]}: PyTorch's AOTriton flash and memory-efficient SDPA "
            "kernels support this arch",
        )
    if info.arch in ROCM_MATH_ONLY_ARCHS:
        why = (
            f"{ROCM_MATH_ONLY_ARCHS[info.arch]}: PyTorch has no flash or memory-efficient SDPA kernel for this "
            "arch (AOTriton is not built for it), and its ROCm memory-efficient kernel does not take GQA"
        )
    else:
        why = "arch not known to this table, so only the math backend is assumed to work"
    if requested == "sdpa":
        return AttentionChoice(
            "sdpa", MATH_ONLY, f"{device}, {why}; sdpa requested, so transformers' SDPA runs on the math backend"
        )
    return AttentionChoice(
        MATH_EXPANDED_KV, MATH_ONLY, f"{device}, {why}; math backend with KV heads expanded to all query heads"
    )


def sdpa_math_expanded_kv_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa_attention_forward restricted to what Qwen3 training needs, with GQA expanded up front.

    Same contract as transformers' version: query (batch, heads, q_len, head_dim), key and value
    (batch, kv_heads, kv_len, head_dim), attention_mask from `sdpa_mask` (a boolean (batch, 1, q_len, kv_len)
    mask, or None when plain causal attention is enough); returns ((batch, q_len, heads, head_dim), None).
    Extra keyword arguments (e.g. Qwen3's sliding_window, already folded into the mask) are ignored, as there.
    """
    heads_per_kv_head = query.shape[1] // key.shape[1]
    key = repeat_kv(key, heads_per_kv_head)
    value = repeat_kv(value, heads_per_kv_head)

    # As in transformers: a None mask means plain causal attention. A single query token (decoding) attends
    # to the whole cache, so it must not get SDPA's upper-left-aligned causal mask.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal

    with sdpa_kernel([SDPBackend.MATH]):
        attn_output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
        )
    return attn_output.transpose(1, 2).contiguous(), None


def register_math_expanded_kv_attention() -> None:
    """Make MATH_EXPANDED_KV a valid attn_implementation, with SDPA's masks (and so packed-row isolation).

    Both go into the class-wide registries (`register`, not item assignment): transformers only builds a mask,
    packed or not, for names in `AttentionMaskInterface._global_mapping`. Without the mask entry a packed row
    would silently get one causal mask over all its conversations.
    """
    AttentionInterface.register(MATH_EXPANDED_KV, sdpa_math_expanded_kv_forward)
    AttentionMaskInterface.register(MATH_EXPANDED_KV, sdpa_mask)


def apply_attention_choice(choice: AttentionChoice) -> None:
    """Set PyTorch's global SDPA backend switches to `choice` and register custom attention it names."""
    if choice.impl == MATH_EXPANDED_KV:
        register_math_expanded_kv_attention()
    # eager and flash_attention_2 never call SDPA, so there is no backend to choose; leave the switches alone.
    if not choice.sdpa_backends:
        return
    # These switches are process-wide and also steer SDPA on CPU (its fused kernel is the "flash" one).
    torch.backends.cuda.enable_flash_sdp("flash" in choice.sdpa_backends)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in choice.sdpa_backends)
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in choice.sdpa_backends)
    torch.backends.cuda.enable_math_sdp("math" in choice.sdpa_backends)


def setup_attention(device: torch.device, requested: str = "auto", print_fn=print) -> AttentionChoice:
    """Describe the device, choose, apply, and print the one-line decision (pass print0 under torchrun)."""
    choice = choose_attention(describe_device(device), requested)
    apply_attention_choice(choice)
    backends = ", ".join(choice.sdpa_backends) or "no SDPA"
    print_fn(f"attention: {choice.impl} ({backends}): {choice.reason}")
    return choice
