"""Model and tokenizer loading (presets, hub ids, local folders), parameter counts and training FLOPs per token.

What --model takes: see common/README.md."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import logging
import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from huggingface_hub import constants, try_to_load_from_cache
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, Qwen3Config, \
    Qwen3MoeConfig
from transformers.utils import logging as transformers_logging

from common.cli import FlagError, InputError

REPO_ROOT = Path(__file__).resolve().parent.parent
# peft asks transformers 5 for a deprecated attribute on every LoRA run: a warning about peft's code, not the user's
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)
# bitsandbytes (imported by peft) warns on AVX512-BF16 CPUs of an optional kernel that no CPU run here needs
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
# "Loading weights" bars on every run: noise between the step lines (a download's progress bar stays)
transformers_logging.disable_progress_bar()
# The presets' tokenizer: in the repository, or inside an installed package (pyproject.toml ships it there).
TOKENIZER_DIR = next((folder for folder in (REPO_ROOT / "assets" / "tokenizer",
                                            Path(__file__).resolve().parent / "assets" / "tokenizer")
                      if folder.is_dir()), REPO_ROOT / "assets" / "tokenizer")
DEFAULT_GPU_MODEL = "Qwen/Qwen3-0.6B-Base"
DEFAULT_CPU_MODEL = "qwen3-tiny"

# Published geometry (config.json of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B}-Base, Qwen/Qwen3-32B); 8B and up: untied head.
PRESETS: dict[str, dict] = {
    "qwen3-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=32, intermediate_size=768, vocab_size=8192),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=9728, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8,
                      head_dim=128, intermediate_size=17408, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, intermediate_size=25600, vocab_size=151936, tie_word_embeddings=False),
}
# Qwen3-MoE (config.json of Qwen/Qwen3-30B-A3B-Base, Qwen/Qwen3-235B-A22B); intermediate_size sizes no layer here.
MOE_PRESETS: dict[str, dict] = {
    "qwen3-moe-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                           head_dim=32, intermediate_size=768, moe_intermediate_size=128, num_experts=8,
                           num_experts_per_tok=2, vocab_size=8192),
    "qwen3-30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, vocab_size=151936),
    "qwen3-235b-a22b": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                            head_dim=128, intermediate_size=12288, moe_intermediate_size=1536, num_experts=128,
                            num_experts_per_tok=8, vocab_size=151936),
}
# The published checkpoints whose geometry the real-size presets copy (32B and 235B-A22B have no base checkpoint).
PRESET_HUB_IDS = {"qwen3-0.6b": "Qwen/Qwen3-0.6B-Base", "qwen3-1.7b": "Qwen/Qwen3-1.7B-Base",
                  "qwen3-4b": "Qwen/Qwen3-4B-Base", "qwen3-8b": "Qwen/Qwen3-8B-Base",
                  "qwen3-14b": "Qwen/Qwen3-14B-Base", "qwen3-32b": "Qwen/Qwen3-32B",
                  "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B-Base", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B"}
MOE_COMMON = dict(tie_word_embeddings=False, norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1,
                  mlp_only_layers=[])
TINY_PRESETS = ("qwen3-tiny", "qwen3-moe-tiny")  # the CPU-sized presets (default --seq-len 256)
PRESET_COMMON = dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                     rms_norm_eps=1e-6, max_position_embeddings=40960, hidden_act="silu", attention_bias=False)


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()


def resolve_model_name(name: str) -> tuple[str, str | None]:
    """(name, notice): `auto` chosen by device, a folder made absolute, a misspelt preset refused."""
    if name != "auto":
        if Path(name).expanduser().is_dir():
            return str(Path(name).expanduser().resolve()), None
        if looks_like_path(name):
            raise FlagError(f"--model {name}: no such folder (--model takes a preset, a hub id such as "
                            f"{DEFAULT_GPU_MODEL}, or a folder written by save_pretrained)")
        if not is_preset(name) and is_preset(name.lower()):
            raise FlagError(f"--model {name}: presets are written in lower case: --model {name.lower()} (random "
                            f"init); the pretrained weights are a hub id, e.g. {DEFAULT_GPU_MODEL}")
        close = difflib.get_close_matches(name, [*PRESETS, *MOE_PRESETS], n=1, cutoff=0.8)
        if not is_preset(name) and "/" not in name and close:
            raise FlagError(f"--model {name}: no such preset; did you mean {close[0]}?")
        return name, None
    if torch.cuda.is_available():
        return DEFAULT_GPU_MODEL, f"--model auto: a GPU is present, using {DEFAULT_GPU_MODEL}"
    return DEFAULT_CPU_MODEL, (f"--model auto: no GPU found, using the built-in {DEFAULT_CPU_MODEL} preset "
                               f"(random init); pass --model {DEFAULT_GPU_MODEL} or a local folder for a real model")


def is_preset(name: str) -> bool:
    return name in PRESETS or name in MOE_PRESETS


def is_moe(config: PretrainedConfig) -> bool:
    """A mixture-of-experts model: its MLPs are routed experts (Qwen3-MoE and its relatives have `num_experts`)."""
    return bool(getattr(config, "num_experts", 0))


def refuse_moe(config: PretrainedConfig) -> None:
    """Stops a mixture of experts before training: only single-ft and ep-ft train one (router loss, idle experts)."""
    if is_moe(config):
        raise InputError(f"this experiment trains dense models; {config.name_or_path or config.model_type} is a "
                         f"mixture of experts ({config.num_experts} experts): use experiments/single-ft or "
                         f"experiments/ep-ft")


def _offline_fix(name: str) -> str:
    return (f"on a machine that is online run `hf download {name}`, copy ~/.cache/huggingface here and set "
            f"HF_HUB_OFFLINE=1; or pass a local folder written by save_pretrained; for a run without downloads use a "
            f"preset: {', '.join([*PRESETS, *MOE_PRESETS])}")


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub's host answers within `timeout_s` (its client retries for most of a minute before failing)."""
    url = urlparse(constants.ENDPOINT)
    return _answers(url.hostname, url.port or (443 if url.scheme == "https" else 80), timeout_s)


@functools.cache  # asked once per process and host: the tokenizer, the config and the weights all ask
def _answers(host: str, port: int, timeout_s: float) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def hub_options(name: str) -> dict:
    """from_pretrained's options for `name`: offline from the cache when the Hub is out of reach."""
    if Path(name).exists() or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or hub_reachable():
        return {}
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return {"local_files_only": True}
    raise SystemExit(f"{name}: the Hugging Face Hub cannot be reached from here and this model is not in this "
                     f"machine's cache: {_offline_fix(name)}")


def _load_failure(name: str, what: str, error: Exception) -> SystemExit:
    """One line: what could not be loaded, why (the error's first line), and the fix."""
    if Path(name).exists():
        fix = (f"the folder exists but holds no loadable {what}: it needs config.json and weights, as written by "
               f"save_pretrained")
    elif looks_like_path(name):
        fix = f"no folder {name}: check the path"
    else:
        fix = f"if this machine is offline: {_offline_fix(name)}"
    reason = (str(error).strip().splitlines() or [""])[0]
    return SystemExit(f"could not load the {what} of '{name}' ({type(error).__name__}: {reason}); fix: {fix}")


def model_config(name: str, tokenizer=None) -> PretrainedConfig:
    """The model's config without its weights (used to count parameters and FLOPs, or to build on meta)."""
    if is_preset(name):
        special = {}
        if tokenizer is not None:
            special = dict(bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                           pad_token_id=tokenizer.pad_token_id)
        if name in MOE_PRESETS:
            return Qwen3MoeConfig(**MOE_PRESETS[name], **{**PRESET_COMMON, **MOE_COMMON}, **special)
        return Qwen3Config(**{**PRESET_COMMON, **PRESETS[name]}, **special)
    try:
        return AutoConfig.from_pretrained(name, **hub_options(name))
    except (OSError, ValueError) as error:
        raise _load_failure(name, "config", error) from error


def load_tokenizer(name: str):
    path = str(TOKENIZER_DIR) if is_preset(name) else name
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **hub_options(path))
    except (OSError, ValueError) as error:
        raise _load_failure(path, "tokenizer", error) from error
    if tokenizer.pad_token is None:
        # padding carries no loss and is attended to by nothing real: any id works
        tokenizer.pad_token = tokenizer.eos_token or "<|endoftext|>"
    return tokenizer


def load_model(name: str, tokenizer, attn_implementation: str, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", allow_moe: bool = False):
    """A preset (random init under the seed) or from_pretrained, in `dtype` on `device`."""
    if is_preset(name):
        config = model_config(name, tokenizer)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn_implementation,
                                                         **hub_options(name))
        except (OSError, ValueError) as error:
            raise _load_failure(name, "model", error) from error
    check_vocabulary(name, tokenizer, model)
    if not allow_moe:
        refuse_moe(model.config)
    if is_moe(model.config) and torch.device(device).type == "cuda" and dtype != torch.bfloat16:
        # CUDA grouped_mm takes bf16 only, the weights are fp32: the per-expert loop runs under autocast instead
        model.set_experts_implementation("eager")
    return model.to(device)


def checkpoint_activations(model, **checkpoint_kwargs) -> None:
    """transformers' activation checkpointing with these options, under 5.0's or 5.2's name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


LORA_TARGETS = (  # the seven linear projections of a Qwen3 decoder layer
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weights_dtype(dtype: str, lora_rank: int = 0) -> torch.dtype:
    """The dtype a model is loaded in: fp32, or bf16 for a frozen LoRA base under --dtype bf16."""
    return torch.bfloat16 if lora_rank and dtype == "bf16" else torch.float32


def add_lora(model, rank: int, alpha: float, fused: bool = False):
    """fp32 LoRA adapters of rank `rank` on LORA_TARGETS, the rest frozen (`fused`: --lora-fused)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    if fused:
        from common.lora import fuse_lora

        fuse_lora(model)
    return model


PRESET_BASE_FILE = "preset_base.json"  # beside a LoRA adapter trained on a preset: which preset, built from which seed


def share_export(save_dir: str | Path) -> None:
    """Rank 0 gives an export's files the umask's permissions (safetensors writes 0600)."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    umask = os.umask(0)
    os.umask(umask)
    for file in Path(save_dir).rglob("*"):
        if file.is_file():
            file.chmod(0o666 & ~umask)


def record_adapter_base(save_dir: str | Path, model_name: str, seed: int) -> None:
    """adapter_config.json names the base as loaded; a preset's base also its seed."""
    share_export(save_dir)
    config_file = Path(save_dir) / "adapter_config.json"
    if (dist.is_initialized() and dist.get_rank() != 0) or not config_file.exists():
        return
    adapter = json.loads(config_file.read_text())
    adapter["base_model_name_or_path"] = model_name
    config_file.write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n")
    if is_preset(model_name):
        (Path(save_dir) / PRESET_BASE_FILE).write_text(json.dumps({"preset": model_name, "seed": seed}) + "\n")


def check_vocabulary(name: str, tokenizer, model) -> None:
    """The vocabulary may be larger than the tokenizer's (padded for speed, or a preset's unused rows), not smaller."""
    if len(tokenizer) > model.config.vocab_size:
        raise InputError(f"tokenizer of '{name}' has {len(tokenizer)} tokens but the model only "
                         f"{model.config.vocab_size} embedding rows: the model and tokenizer do not belong together")


def qlora_unavailable(merge_lora: bool = False, dtype: str | None = None) -> str | None:
    """Why --qlora cannot run with these flags on this machine (None when it can): checked before anything starts."""
    if merge_lora:
        return ("--merge-lora with --qlora: merging would round the trained adapters into 4-bit weights; save the "
                "adapter (--save-hf) and merge it into the bf16 base model with peft")
    if dtype == "fp32":
        return "--qlora computes in bf16 (its 4-bit weights are dequantized to bf16): drop --dtype fp32"
    if not torch.cuda.is_available():
        return "--qlora needs a CUDA GPU (bitsandbytes' 4-bit kernels); this machine has none, so nothing was loaded"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "--qlora needs bitsandbytes, which is not installed: uv sync --group qlora"
    return None


def load_model_4bit(name: str, tokenizer, attn_implementation: str, device: torch.device):
    """QLoRA's frozen base: the decoder's linear layers in 4-bit NF4 (bitsandbytes), the rest in bf16."""
    import shutil
    import tempfile

    from peft import prepare_model_for_kbit_training
    from safetensors.torch import save_model
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    source, scratch = name, None
    if is_preset(name):
        scratch = tempfile.mkdtemp(prefix=f"{name}-")
        preset = AutoModelForCausalLM.from_config(model_config(name, tokenizer), dtype=torch.bfloat16)
        # not save_pretrained, which writes on rank 0 only: each rank reads its own folder
        preset.config.save_pretrained(scratch)
        save_model(preset, f"{scratch}/model.safetensors", metadata={"format": "pt"})  # the tied LM head once
        source, preset = scratch, None
    try:
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=quantization, dtype=torch.bfloat16,
                                                     attn_implementation=attn_implementation,
                                                     device_map={"": device}, **hub_options(source))
    except (OSError, ValueError) as error:
        raise _load_failure(name, "model", error) from error
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    if scratch:  # a preset's adapter names no base, as with load_model (the temporary folder is gone)
        model.name_or_path = model.config.name_or_path = ""
    check_vocabulary(name, tokenizer, model)
    # the frozen non-quantized weights in fp32 for stable norms; checkpointing stays --activation-checkpointing's
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def count_parameters(config: PretrainedConfig) -> dict[str, int]:
    """Parameter counts from the config alone (formula: common/README.md)."""
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    H, KV = config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // H
    attention = d * H * hd + 2 * d * KV * hd + H * hd * d + 2 * hd
    if getattr(config, "attention_bias", False):
        attention += H * hd + 2 * KV * hd + d
    experts = active_experts = 0
    if is_moe(config):
        E, k, I = config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size
        experts, active_experts = E * 3 * d * I, k * 3 * d * I
        mlp = experts + d * E
    else:
        mlp = 3 * d * config.intermediate_size
    per_layer = attention + mlp + 2 * d
    embedding = V * d
    lm_head = 0 if config.tie_word_embeddings else V * d
    counts = dict(total=embedding + L * per_layer + d + lm_head, embedding=embedding, per_layer=per_layer,
                  layers=L * per_layer, lm_head_untied=lm_head)
    if is_moe(config):
        counts.update(experts=L * experts, active_per_layer=per_layer - experts + active_experts)
    return counts


def matmul_weights(config: PretrainedConfig) -> dict[str, int]:
    """Per decoder layer: the weights one token multiplies, by projection."""
    d, H, KV = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // H
    weights = dict(q_proj=d * H * hd, k_proj=d * KV * hd, v_proj=d * KV * hd, o_proj=H * hd * d)
    if is_moe(config):
        weights.update(experts=config.num_experts_per_tok * 3 * d * config.moe_intermediate_size,
                       router=d * config.num_experts)
    else:
        I = config.intermediate_size
        weights.update(gate_proj=d * I, up_proj=d * I, down_proj=I * d)
    return weights


def lora_parameters(config: PretrainedConfig, rank: int) -> dict[str, int]:
    """Per decoder layer: the LoRA parameters of each projection a token goes through."""
    d, H, KV = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = getattr(config, "head_dim", None) or d // H
    shapes = dict(q_proj=(d, H * hd), k_proj=(d, KV * hd), v_proj=(d, KV * hd), o_proj=(H * hd, d))
    if not is_moe(config):
        I = config.intermediate_size
        shapes.update(gate_proj=(d, I), up_proj=(d, I), down_proj=(I, d))
    return {name: rank * (inputs + outputs) for name, (inputs, outputs) in shapes.items()}


@dataclass(frozen=True)
class TrainingFlops:
    """Training FLOPs (forward + backward): per token for the weights, per (query, key) pair in a document."""
    per_token: float  # every matrix multiply with a weight, per token, the LM head's included
    per_pair: float  # attention's scores and weighted sum, per (query, key) pair of one document, all layers
    lm_head: float = 0.0  # the LM head's part of per_token: what a token the head does not run on leaves out

    def of_documents(self, lengths, head_tokens: int | None = None) -> float:
        """FLOPs of a step whose documents (packed conversations, all ranks) have these lengths; a row's padding is
        no document and counts nothing. `head_tokens`: how many of those tokens the LM head runs on, where it does
        not run on all of them (the fused loss of --loss-chunk-tokens: the step's loss tokens); None: all."""
        tokens = sum(lengths)
        if head_tokens is not None and not 0 <= head_tokens <= tokens:
            raise ValueError(f"of_documents: the LM head cannot run on {head_tokens:,} of {tokens:,} tokens")
        skipped = 0 if head_tokens is None else tokens - head_tokens
        return self.per_token * tokens - self.lm_head * skipped + self.per_pair * sum(n * n for n in lengths)

    def dense_per_token(self, seq_len: int) -> float:
        """Per token with every token attending to its whole row of seq_len (an upper bound)."""
        return self.per_token + self.per_pair * seq_len


def training_flops(config: PretrainedConfig, lora_rank: int = 0) -> TrainingFlops:
    """The training FLOPs of the work a step does, as MFU counts it: PaLM's model FLOPs (common/README.md)."""
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    H = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or d // H
    weights = matmul_weights(config)
    per_layer, lm_head = sum(weights.values()), V * d
    if not lora_rank:
        per_token = 6.0 * (L * per_layer + lm_head)
        head = 6.0 * lm_head
    else:
        adapters = lora_parameters(config, lora_rank)
        trained_experts = weights.get("experts", 0)  # W + B A: the experts' matrix multiply takes a weight gradient
        first_qkv = sum(weights[name] + lora_rank * d for name in ("q_proj", "k_proj", "v_proj"))  # + their A
        per_token = (4.0 * (L * (per_layer - trained_experts) + lm_head) + 6.0 * L * trained_experts
                     + 6.0 * L * sum(adapters.values()) - 2.0 * first_qkv)
        head = 4.0 * lm_head
    return TrainingFlops(per_token=per_token, per_pair=12.0 * L * H * hd, lm_head=head)


def flops_per_token(config: PretrainedConfig, seq_len: int, lora_rank: int = 0) -> float:
    """Training FLOPs per token with every token attending to its whole row of seq_len (`dense_per_token`)."""
    return training_flops(config, lora_rank).dense_per_token(seq_len)
