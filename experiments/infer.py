"""infer: talk to a model that any experiment exported with --save-hf, or measure its held-out loss.

    uv run python experiments/infer.py --model runs/sft-model --prompt "Spell 'cat' backwards."
    uv run python experiments/infer.py --model runs/sft-model --prompts prompts.txt    # one prompt per line (or JSONL)
    uv run python experiments/infer.py --model runs/sft-model                            # interactive chat
    uv run python experiments/infer.py --model runs/lora-adapter --base Qwen/Qwen3-0.6B-Base --prompt "Hi"
    uv run python experiments/infer.py --model runs/sft-model --eval-data assets/data/sft_en.jsonl

Every export is a standard Hugging Face folder: a full model (single-ft, ddp-ft, fsdp-ft, ... and merged LoRA)
loads with from_pretrained; a LoRA adapter folder (adapter_config.json) loads its base first, from --base or from
the base the adapter names (an absolute folder or a hub id), then the adapter with peft. An adapter trained on a
preset (random init, never saved) names the preset and its seed: its base is rebuilt from them, as training built
it. The prompt goes through the tokenizer's chat template with the assistant's generation prompt; generation stops
at <|im_end|>, the end of turn training taught; greedy unless --temperature is above 0. --eval-data computes the
export's loss on the held-out conversations of a data file, the split training made with the same --seq-len,
--eval-fraction and --seed: the number training printed as `eval: loss`.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer
from transformers.utils import logging as transformers_logging

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from common.cli import run  # noqa: E402
from common.data import DataError, build_data, evaluate  # noqa: E402
from common.generate import generate  # noqa: E402
from common.models import PRESET_BASE_FILE, PRESETS, hub_options, is_preset, load_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an --save-hf folder: full model, merged LoRA or LoRA adapter")
    parser.add_argument("--base", help="with an adapter folder: the base model (hub id or folder) it was trained on")
    parser.add_argument("--prompt", help="one prompt; without --prompt or --prompts: an interactive chat")
    parser.add_argument("--prompts", help="a file of prompts: one per line, or JSONL with a 'prompt' field")
    parser.add_argument("--system", help="a system message before every conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, with --temperature > 0")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cuda, cpu, ...")
    parser.add_argument("--eval-data", help="report the held-out loss on this --data (as training computed it)")
    parser.add_argument("--seq-len", type=int, help="as in training; default 256 for qwen3-tiny's geometry, else 1024")
    parser.add_argument("--eval-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-split", default="train")
    parser.add_argument("--data-config")
    parser.add_argument("--data-columns")
    return parser.parse_args(None if argv is None else [str(arg) for arg in argv])


def load(model_dir: str, base: str | None, device: torch.device):
    """(model, tokenizer) from an export folder; fp32 weights (bf16 compute under autocast on a GPU, as training)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise SystemExit(f"{folder}: no such folder (--model takes a folder written by --save-hf)")
    adapter = folder / "adapter_config.json"
    if not adapter.exists() and not (folder / "config.json").exists():
        raise SystemExit(f"{folder}: neither config.json (a model) nor adapter_config.json (a LoRA adapter) in it")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if adapter.exists():
        from peft import PeftModel

        base = base or json.loads(adapter.read_text()).get("base_model_name_or_path")
        preset_base = folder / PRESET_BASE_FILE
        if base and is_preset(base) and preset_base.exists():
            # A preset is random init under the run's seed: the same seed builds the same weights.
            seed = json.loads(preset_base.read_text())["seed"]
            torch.manual_seed(seed)
            model = load_model(base, tokenizer, "sdpa", dtype=torch.float32)
            print(f"base: the {base} preset rebuilt from seed {seed} (random init, as training built it)")
        elif not base or is_preset(base):
            raise SystemExit(f"{folder}: a LoRA adapter of {base or 'an unnamed base'}, which is not a saved model "
                             f"(a preset is random init) and records no seed ({PRESET_BASE_FILE}); pass --base with "
                             f"the folder or hub id of its base weights")
        else:
            try:
                model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **hub_options(base))
            except OSError as error:
                reason = (str(error).strip().splitlines() or [""])[0]
                raise SystemExit(f"{folder}: cannot load its base model '{base}' ({reason}); pass --base") from None
        model = PeftModel.from_pretrained(model, folder)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to(device).eval(), tokenizer


def default_seq_len(config) -> int:
    """The experiments' default: 256 for qwen3-tiny, 1024 otherwise."""
    tiny = PRESETS["qwen3-tiny"]
    same = all(getattr(config, key, None) == value for key, value in tiny.items() if isinstance(value, int))
    return 256 if same else 1024


def read_prompts(path: str) -> list[str]:
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                line = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SystemExit(f"{path}:{number}: a JSON line needs a 'prompt' field") from None
        prompts.append(line)
    if not prompts:
        raise SystemExit(f"{path}: no prompts in it")
    return prompts


def main(argv: list[str] | None = None) -> list[str] | float:
    args = parse_args(argv)
    transformers_logging.disable_progress_bar()  # a weight-loading bar between the prompt and the answer is noise
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else \
        torch.device(args.device)
    model, tokenizer = load(args.model, args.base, device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext

    if args.eval_data:
        seq_len = args.seq_len or default_seq_len(model.config)
        try:
            data = build_data(args.eval_data, tokenizer, seq_len, eval_fraction=args.eval_fraction, seed=args.seed,
                              split=args.data_split, subset=args.data_config, columns=args.data_columns)
        except DataError as error:
            raise SystemExit(f"bad data: {error}") from None
        loss = evaluate(model, data, 1, device, autocast)
        if loss is None:
            raise SystemExit("--eval-data: no held-out conversations (--eval-fraction is 0)")
        print(f"eval: loss {loss:.4f} over {data.stats['n_eval_conversations']} held-out conversations "
              f"(seq_len {seq_len}, eval_fraction {args.eval_fraction}, seed {args.seed})")
        return loss

    system = [{"role": "system", "content": args.system}] if args.system else []
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   autocast=autocast)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if args.prompt or args.prompts:
        replies = []
        for prompt in [args.prompt] if args.prompt else read_prompts(args.prompts):
            print(f"> {prompt}")
            replies.append(generate(model, tokenizer, system + [{"role": "user", "content": prompt}], device,
                                    streamer=streamer, **options))
        return replies

    # Interactive: the conversation grows turn by turn (each answer sees the turns before it); "exit" or the end of
    # the input (Ctrl-D) ends it, an empty line is skipped.
    print(f"chat with {args.model} ('exit' or Ctrl-D to end)")
    messages, replies = list(system), []
    while True:
        print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "exit":  # readline() gives "" only at the end of the input
            return replies
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        replies.append(generate(model, tokenizer, messages, device, streamer=streamer, **options))
        messages.append({"role": "assistant", "content": replies[-1]})


if __name__ == "__main__":
    run(main)  # a stop is one line (common/cli.py)
