"""Generation from a model being trained or exported (--sample-every, experiments/infer.py): the chat prompt,
the end-of-turn stop, greedy or sampled, with transformers' KV cache."""

from __future__ import annotations

import torch

from common.data import end_of_turn, render_template


def chat_prompt(tokenizer, messages: list[dict], device: torch.device) -> torch.Tensor:
    """The conversation so far, rendered with the tokenizer's template and the assistant's generation prompt."""
    text = tokenizer.apply_chat_template(messages, chat_template=render_template(tokenizer), tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)


def stop_token_ids(tokenizer) -> list[int]:
    """<|im_end|> closes an assistant turn (what training teaches); the eos token ends the text."""
    ids = [end_of_turn(tokenizer)[1]]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate(model, tokenizer, messages: list[dict], device: torch.device, max_new_tokens: int = 32,
             temperature: float = 0.0, top_p: float = 1.0, streamer=None, autocast=None,
             synced_gpus: bool = False) -> str:
    """The assistant's next turn, greedy when temperature is 0. Under FSDP or ZeRO-3 every rank calls it with
    synced_gpus=True (common/README.md)."""
    was_training = model.training
    model.eval()
    prompt = chat_prompt(tokenizer, messages, device)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if temperature > 0 else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)
    with autocast() if autocast is not None else torch.autocast(device.type, enabled=False):
        output = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                max_new_tokens=max_new_tokens, eos_token_id=stop_token_ids(tokenizer),
                                pad_token_id=tokenizer.pad_token_id, streamer=streamer, synced_gpus=synced_gpus,
                                **sampling)
    model.train(was_training)
    return tokenizer.decode(output[0, prompt.shape[1]:], skip_special_tokens=True)


def sample_prompt(data) -> list[dict] | None:
    """--sample-every's fixed prompt: the turns before the first assistant turn of the first held-out conversation."""
    if not data.eval_messages:
        return None
    messages = data.eval_messages[0]
    first_answer = next(i for i, message in enumerate(messages) if message["role"] == "assistant")
    return messages[:first_answer]
