"""Which attention kernel to use on this device, decided once and printed with its reason.

Every experiment calls `setup_attention(device, config.attn)` before building the model and passes
`choice.impl` to transformers. The choice per device, varlen and flex: see common/README.md."""

import functools
import importlib.util
import inspect
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

VALID_REQUESTS = ("auto", "sdpa", "eager", "flash", "varlen", "flex")
MATH_EXPANDED_KV = "sdpa_math_expanded_kv"  # name under which the custom attention is registered
VARLEN = "varlen"  # attn_implementation name of the variable-length attention (one registration per kernel)
FLEX = "flex"  # attn_implementation name of FlexAttention with a document block mask
# Variable-length kernels, in order of preference on NVIDIA; "reference" is the per-document SDPA loop.
VARLEN_KERNELS = ("torch", "flash_attn", "flex", "reference")

# SDPA backends per ROCm arch (gcnArchName without its feature flags); an arch missing here gets math only.
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
        # ROCm uses the "cuda" device type; "gfx908:sramecc+:xnack-": only the arch decides the kernels.
        return DeviceInfo(kind="rocm", name=props.name, arch=props.gcnArchName.split(":")[0])
    return DeviceInfo(kind="cuda", name=props.name, arch=f"sm_{props.major}{props.minor}")


@dataclass(frozen=True)
class AttentionChoice:
    impl: str  # the attn_implementation passed to transformers' from_pretrained / from_config
    sdpa_backends: tuple[str, ...]  # SDPA backends left enabled; empty when impl does not go through SDPA
    reason: str  # one sentence, printed at start
    varlen_kernel: str | None = None  # with impl "varlen": one of VARLEN_KERNELS
    expands_kv: bool = False  # varlen: K/V heads repeated to every query head first (common.memory prices it)

    def forward_kwargs(self, position_ids: torch.Tensor, device: torch.device) -> dict:
        """The model call's extra kwargs for this micro-batch (varlen and flex), from host position_ids."""
        if self.impl == VARLEN:
            return document_kwargs(position_ids, device)
        if self.impl == FLEX:
            return flex_kwargs(position_ids, device)
        return {}


def available_varlen_kernels() -> tuple[str, ...]:
    """The variable-length kernels the installed packages provide (the reference always exists)."""
    found = []
    if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        found.append("torch")
    if importlib.util.find_spec("flash_attn") is not None:
        found.append("flash_attn")
    found += ["flex", "reference"]
    return tuple(found)


def choose_attention(info: DeviceInfo, requested: str = "auto",
                     varlen_kernels: tuple[str, ...] | None = None) -> AttentionChoice:
    """Which attention implementation and SDPA backends suit `info`, honouring `requested` (pure)."""
    if requested not in VALID_REQUESTS:
        raise ValueError(f"unknown attention {requested!r}: expected one of {', '.join(VALID_REQUESTS)}")
    device = info.label()
    if varlen_kernels is None:
        varlen_kernels = available_varlen_kernels()

    if requested == "varlen" or (requested == "auto" and info.kind == "cuda"
                                 and {"torch", "flash_attn"} & set(varlen_kernels)):
        return _choose_varlen(info, requested, varlen_kernels)

    if requested == "eager":
        return AttentionChoice("eager", (), f"eager attention requested on {device} (plain matmul + softmax)")

    if requested == "flex":
        if info.kind == "cpu" and not flex_trains_on_cpu():
            raise ValueError(f"--attn flex trains on a GPU only: FlexAttention has no backward on CPU in torch "
                             f"{torch.__version__} (its forward runs: the tests check it); on CPU use --attn varlen "
                             "or sdpa")
        compiled = "compiled to a fused kernel" if info.kind != "cpu" else "uncompiled on CPU"
        return AttentionChoice(FLEX, (), f"{device}: FlexAttention requested, a block mask from the packed rows' "
                                         f"document ids ({compiled}; static shapes whatever the document count)")

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


def _choose_varlen(info: DeviceInfo, requested: str, kernels: tuple[str, ...]) -> AttentionChoice:
    device = info.label()
    how = {
        "torch": "PyTorch's varlen_attn",
        "flash_attn": "flash-attn's flash_attn_varlen_func",
        "flex": "FlexAttention with a document mask (compiled; neither torch's varlen_attn nor flash-attn is "
                "installed)",
        "reference": "a reference that runs SDPA once per document",
    }
    if info.kind == "cpu":
        kernel, backends, why = "reference", CPU_BACKENDS, "no variable-length kernel runs on CPU"
    elif info.kind == "cuda":
        kernel = next(k for k in VARLEN_KERNELS if k in kernels)
        backends, why = ALL_CUDA_BACKENDS, "packed documents without a mask"
    elif info.kind == "rocm" and info.arch in ROCM_AOTRITON_ARCHS and "torch" in kernels:
        kernel, backends = "torch", ROCM_FUSED_BACKENDS
        why = f"{ROCM_AOTRITON_ARCHS[info.arch]}, not yet run on ROCm by this project"
    elif info.kind == "rocm":
        kernel, backends = "reference", MATH_ONLY
        why = "no fused variable-length kernel for this arch, so each document runs the math SDPA backend"
    else:
        raise ValueError(f"unknown device kind {info.kind!r}: expected cpu, cuda or rocm")
    gqa = ""
    expands_kv = kernel == "torch" and not torch_varlen_takes_gqa()
    if expands_kv:
        gqa = "; this torch's varlen_attn takes no grouped K/V heads, so they are expanded to all query heads"
    picked = "varlen requested" if requested == "varlen" else "auto picks varlen"
    return AttentionChoice(VARLEN, backends, f"{device}: {picked}, {how[kernel]} ({why}){gqa}", kernel, expands_kv)


# ---------------------------------------------------------------------------------------------------------------
# Packed documents: where they start, and what the varlen and flex attention functions share


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] bool, True where a document starts: a row start or a restarted position. No host read."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def packed_documents_attention(kind: str):
    """Decorator: `attend(query, key, value, scaling, **kwargs)` -> an attention function with transformers'
    sdpa_attention_forward contract. Refuses a padding mask, dropout or a sliding window; sends decoding with a KV
    cache to SDPA; casts q, k, v to the autocast dtype."""

    def decorate(attend):
        @functools.wraps(attend)
        def attention_function(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               sliding_window=None, **kwargs):
            if attention_mask is not None:
                raise ValueError(f"--attn {kind} takes packed rows with restarted position_ids and no padding mask")
            if dropout or sliding_window:
                raise ValueError(f"--attn {kind} supports neither attention dropout nor a sliding window")
            if key.shape[2] != query.shape[2]:
                # decoding with a KV cache: not a packed row
                return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)
            if torch.is_autocast_enabled(query.device.type):
                # Autocast casts SDPA's inputs, not a custom kernel's: Qwen3's q/k norms return fp32 beside bf16 values.
                dtype = torch.get_autocast_dtype(query.device.type)
                query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
            return attend(query, key, value, scaling, **kwargs), None

        return attention_function

    return decorate


# ---------------------------------------------------------------------------------------------------------------
# FlexAttention with a document block mask: --attn flex over rows, and the varlen "flex" kernel through the same code


@functools.cache
def flex_trains_on_cpu() -> bool:
    """Whether the installed torch's FlexAttention has a CPU backward (torch 2.15 has none: a forward-only op)."""
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, 16, 8, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
            flex_attention(q, q, q).sum().backward()
    except NotImplementedError:
        return False
    return True


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] index of each slot's document within its row (document_starts). No host read."""
    return document_starts(position_ids).cumsum(1, dtype=torch.int32) - 1


def block_mask_of_documents(documents: torch.Tensor):
    """FlexAttention's block mask: a query attends to its own document's keys at or before it."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(batch, head, q_index, kv_index):
        return (documents[batch, q_index] == documents[batch, kv_index]) & (q_index >= kv_index)

    rows, seq = documents.shape
    return create_block_mask(same_document_causal, rows, None, seq, seq, device=documents.device)


def flex_kwargs(position_ids: torch.Tensor, device: torch.device) -> dict:
    """{document_block_mask: ...}, the micro-batch's block mask built on the device from the host position_ids."""
    documents = document_ids(position_ids.cpu())
    if device.type == "cuda":
        documents = documents.pin_memory().to(device, non_blocking=True)
    return dict(document_block_mask=block_mask_of_documents(documents))


_compile = functools.cache(torch.compile)  # each function compiled once per process


def _flex_rows(query, key, value, block_mask, scale):
    """FlexAttention over [batch, heads, seq, d] with grouped K/V heads: [batch, heads, seq, d] out."""
    from torch.nn.attention.flex_attention import flex_attention

    # uncompiled, FlexAttention materialises the scores; compiled, it is one fused kernel
    kernel = _compile(flex_attention) if query.is_cuda else flex_attention
    return kernel(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True)


@packed_documents_attention("flex")
def flex_attention_forward(query, key, value, scaling=None, document_block_mask=None, position_ids=None, **kwargs):
    """FlexAttention over packed rows with `document_block_mask`, else one built from `position_ids`."""
    if document_block_mask is None:
        if position_ids is None:
            raise ValueError("--attn flex needs document_block_mask (flex_kwargs) or position_ids in the call")
        batch, _, seq, _ = query.shape
        document_block_mask = block_mask_of_documents(document_ids(position_ids.expand(batch, seq)))
    return _flex_rows(query, key, value, document_block_mask, scaling).transpose(1, 2).contiguous()


def register_flex_attention() -> None:
    """Make FLEX a valid attn_implementation, without a mask function (common/README.md)."""
    AttentionInterface.register(FLEX, flex_attention_forward)


# ---------------------------------------------------------------------------------------------------------------
# Variable-length attention over packed documents


def document_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens int32 [documents + 1], longest document) of the flattened tokens; give host ids."""
    rows, seq = position_ids.shape
    first = document_starts(position_ids).flatten().nonzero().squeeze(1)
    cu_seq_lens = torch.cat([first, first.new_tensor([rows * seq])]).to(torch.int32)
    return cu_seq_lens, int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())


def document_kwargs(position_ids: torch.Tensor, device: torch.device) -> dict:
    """The model call's kwargs that tell every varlen attention call where the documents are, computed once per
    micro-batch: cu_seq_lens_q/k and `longest_document`, an empty tensor whose length is the longest document's
    (both marked dynamic, so torch.compile does not recompile per document count; common/README.md)."""
    cu_seq_lens, max_length = document_boundaries(position_ids.cpu())
    if device.type == "cuda":
        cu_seq_lens = cu_seq_lens.pin_memory().to(device, non_blocking=True)  # pinned: the copy does not block
    longest_document = torch.empty(max_length, 0, device=device)  # holds no data
    torch._dynamo.mark_dynamic(cu_seq_lens, 0)
    torch._dynamo.mark_dynamic(longest_document, 0)
    return dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, longest_document=longest_document)


@functools.cache
def _parameters(function) -> frozenset[str]:
    """The names of `function`'s parameters, read by inspect.signature once, not in every layer's call."""
    return frozenset(inspect.signature(function).parameters)


def torch_varlen_takes_gqa() -> bool:
    """Whether torch's varlen_attn takes grouped K/V heads (`enable_gqa`)."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in _parameters(varlen_attn)


def _torch_varlen(q, k, v, cu_seq_lens, max_length, scale):
    from torch.nn.attention.varlen import varlen_attn

    params = _parameters(varlen_attn)
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale != q.shape[-1] ** -0.5:
        raise ValueError(f"this torch's varlen_attn takes no scale, and {scale} is not 1/sqrt(head_dim)")
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    else:
        # Query head j reads K/V head j // group, the layout repeat_kv makes.
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, **kwargs)


def _flash_attn_varlen(q, k, v, cu_seq_lens, max_length, scale):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, dropout_p=0.0,
                                  softmax_scale=scale, causal=True)


_flex_varlen_mask: dict = {}  # the block mask of the last cu_seq_lens seen, with its key


def _flex_varlen(q, k, v, cu_seq_lens, max_length, scale):
    """The flattened tokens as one row of documents, through --attn flex's block mask and kernel."""
    tokens = q.shape[0]
    # One block mask per micro-batch: every layer receives the same cu_seq_lens tensor, so key on it.
    cache_key = (id(cu_seq_lens), cu_seq_lens.data_ptr(), tokens)
    if _flex_varlen_mask.get("key") != cache_key:
        document = torch.searchsorted(cu_seq_lens[1:].long(), torch.arange(tokens, device=q.device), right=True)
        _flex_varlen_mask.update(key=cache_key, mask=block_mask_of_documents(document.unsqueeze(0)))
    row = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [tokens, heads, d] -> [1, heads, tokens, d]
    return _flex_rows(*row, _flex_varlen_mask["mask"], scale).squeeze(0).transpose(0, 1)


@torch.compiler.disable  # a loop over the documents read from cu_seq_lens: it runs eagerly inside a compiled layer
def _reference_varlen(q, k, v, cu_seq_lens, max_length, scale):
    """SDPA once per document with a plain causal mask: what the fused kernels compute, one document at a time."""
    bounds = cu_seq_lens.tolist()  # a host sync on a GPU; free on CPU, where this path is meant to run
    outputs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_doc, k_doc, v_doc = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, d]
        out = F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=True, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


_VARLEN_FUNCTIONS = {"torch": _torch_varlen, "flash_attn": _flash_attn_varlen, "flex": _flex_varlen,
                     "reference": _reference_varlen}


@packed_documents_attention("varlen")
def varlen_attention_forward(query, key, value, scaling=None, cu_seq_lens_q=None, max_length_q=None,
                             longest_document=None, position_ids=None, *, kernel: str, **kwargs) -> torch.Tensor:
    """Packed documents through a varlen kernel, from document_kwargs' or `position_ids`."""
    batch, heads, seq, head_dim = query.shape
    if cu_seq_lens_q is None:
        if position_ids is None:
            raise ValueError("--attn varlen needs cu_seq_lens_q (document_kwargs) or position_ids in the call")
        cu_seq_lens_q, max_length_q = document_boundaries(position_ids.expand(batch, seq))
    elif longest_document is not None:
        max_length_q = longest_document.shape[0]
    elif max_length_q is None:
        raise ValueError("--attn varlen needs the longest document's length with cu_seq_lens_q (document_kwargs)")
    if int(cu_seq_lens_q.shape[0]) < 2:
        raise ValueError("cu_seq_lens_q must hold at least one document")
    scale = scaling if scaling is not None else head_dim ** -0.5
    # [batch, heads, seq, d] -> [tokens, heads, d]: transposing back is free, the flattening a view
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], head_dim) for t in (query, key, value))
    out = _VARLEN_FUNCTIONS[kernel](q, k, v, cu_seq_lens_q, max_length_q, scale)
    return out.view(batch, seq, heads, head_dim)


def register_varlen_attention(kernel: str) -> None:
    """Make VARLEN a valid attn_implementation running `kernel`, with no mask function (common/README.md)."""
    AttentionInterface.register(VARLEN, functools.partial(varlen_attention_forward, kernel=kernel))


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
    """transformers' sdpa_attention_forward with the K/V heads expanded, on SDPA's math kernel."""
    heads_per_kv_head = query.shape[1] // key.shape[1]
    key = repeat_kv(key, heads_per_kv_head)
    value = repeat_kv(value, heads_per_kv_head)

    # a None mask is plain causal; one query token (decoding) attends to the whole cache
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal

    with sdpa_kernel([SDPBackend.MATH]):
        attn_output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
        )
    return attn_output.transpose(1, 2).contiguous(), None


def register_math_expanded_kv_attention() -> None:
    """Make MATH_EXPANDED_KV a valid attn_implementation, with SDPA's (packed) masks."""
    AttentionInterface.register(MATH_EXPANDED_KV, sdpa_math_expanded_kv_forward)
    AttentionMaskInterface.register(MATH_EXPANDED_KV, sdpa_mask)


def apply_attention_choice(choice: AttentionChoice) -> None:
    """Set PyTorch's global SDPA backend switches to `choice` and register custom attention it names."""
    if choice.impl == MATH_EXPANDED_KV:
        register_math_expanded_kv_attention()
    if choice.impl == VARLEN:
        register_varlen_attention(choice.varlen_kernel)
    if choice.impl == FLEX:
        register_flex_attention()
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
