"""Greedy identity against Hugging Face `generate`, with the allowance for float32 near-ties."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4

PASSAGE = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could reproduce pages quickly and "
    "cheaply. Before that, books were copied by hand, mostly in monasteries, and a single volume could take months. "
    "Within fifty years presses were running in hundreds of European towns, and the price of books fell sharply. "
)


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]  # HF's raw logits at each generated position


def long_prompts(tokenizer, count: int = 4) -> list[list[int]]:
    prompts = []
    for i in range(count):
        text = PASSAGE * (i + 1) + "Summarize the passage above in one sentence."
        messages = [{"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompts


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[Reference]:
    refs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
            refs.append(Reference(out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]))
    return refs


def compare(outputs: list[list[int]], refs: list[Reference]) -> tuple[list[str], int]:
    """Mismatches that are real (not near-ties), and how many prompts needed the near-tie allowance."""
    failures, allowances = [], 0
    for index, (ours, ref) in enumerate(zip(outputs, refs, strict=True)):
        if ours == ref.tokens:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)) if a != b), None)
        if pos is None:
            failures.append(f"prompt {index}: lengths differ ({len(ours)} vs HF {len(ref.tokens)})")
            continue
        logits = ref.logits[pos]
        gap = (logits[ref.tokens[pos]] - logits[ours[pos]]).item()
        if gap < NEAR_TIE:
            allowances += 1
        else:
            failures.append(f"prompt {index}: token {pos} is {ours[pos]}, HF {ref.tokens[pos]} (logit gap {gap:.2e})")
    return failures, allowances
