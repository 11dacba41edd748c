"""Greedy identity against Hugging Face, with the allowance for float32 near-ties: against `generate`'s own
tokens (`hf_greedy`, token by token), or teacher-forced (`HFVerdict`: one forward per output)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.engine.references import recording

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


class HFVerdict:
    """Hugging Face's verdict on greedy outputs, teacher-forced: one forward of prompt + output per distinct pair
    (cached across configs), and at every output position HF's argmax must be the engine's token or within
    NEAR_TIE of it. By induction that is `generate`'s greedy output, without its token-by-token loop; a shorter
    output must end at an EOS token."""

    def __init__(self, hf_model, max_tokens: int, recorded_in: str = "greedy_verdicts") -> None:
        """`recorded_in`: the file of tests/engine/references/ that keeps the verdicts (one per model)."""
        self.hf_model, self.max_tokens, self.recorded_in = hf_model, max_tokens, recorded_in
        eos = hf_model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.verdicts: dict[tuple[tuple[int, ...], tuple[int, ...]], str | bool | None] = {}

    def compare(self, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[list[str], int]:
        """Failures (not near-ties), and how many outputs needed the near-tie allowance."""
        failures, allowances = [], 0
        for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            key = (tuple(prompt), tuple(output))
            if key not in self.verdicts:
                self.verdicts[key] = self._verdict(prompt, output)
            verdict = self.verdicts[key]
            if isinstance(verdict, str):
                failures.append(f"prompt {index}: {verdict}")
            allowances += verdict is True
        return failures, allowances

    def _verdict(self, prompt: list[int], output: list[int]) -> str | bool | None:
        """A failure's description, True where a near-tie was allowed, None where HF agrees exactly."""
        if not output or len(output) > self.max_tokens:
            return f"{len(output)} tokens (max_tokens {self.max_tokens})"
        if len(output) < self.max_tokens and output[-1] not in self.eos:
            return f"stopped after {len(output)} tokens without EOS"
        model = getattr(self.hf_model, "fingerprint", None)  # a model of tests/engine/references.py: recorded
        if model is None:
            return teacher_forced_verdict(self.hf_model, prompt, output)
        return recording(self.recorded_in).get({"model": model, "prompt": prompt, "output": output},
                                                lambda: teacher_forced_verdict(self.hf_model, prompt, output))


def teacher_forced_verdict(hf_model, prompt: list[int], output: list[int]) -> str | bool | None:
    """HF's argmax at each output position, given the output so far: a mismatch's description unless within
    NEAR_TIE (True), None where HF agrees exactly."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:]
    near_tie = None
    for pos, (row, token) in enumerate(zip(logits, output, strict=True)):
        best = int(row.argmax())
        if best == token:
            continue
        gap = (row[best] - row[token]).item()
        if gap >= NEAR_TIE:
            return f"token {pos} is {token}, HF {best} (logit gap {gap:.2e})"
        near_tie = True
    return near_tie
