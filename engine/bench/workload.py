"""The benchmark workloads: chat prompts with forced output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources

EXTRA_QUESTIONS = [
    "Describe how a rainbow forms.", "What is a black hole?", "Give three tips for better sleep.",
    "Explain what an API is.", "Why do cats purr?", "Write a short poem about autumn rain.",
    "What is the Pythagorean theorem?", "How does a vaccine work?", "Name three renewable energy sources.",
    "What is inflation in economics?", "Describe the water cycle.", "What makes a good team leader?",
    "Explain the rules of chess briefly.", "What is the tallest mountain in the world?",
    "How do airplanes stay in the air?", "Give a fun fact about octopuses.", "What is machine learning?",
    "Write a tweet announcing a new coffee shop.", "Why is exercise good for the brain?",
    "What does DNA stand for?", "Explain the difference between a virus and a bacterium.",
    "Suggest a weekend activity for a rainy day.", "How do solar panels generate electricity?",
    "What is the role of the United Nations?",
]


@dataclass
class Workload:
    prompts: list[list[int]]  # chat-rendered token ids
    output_lens: list[int]  # tokens each request must generate (EOS ignored)

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def questions() -> list[str]:
    text = resources.files("tokenmill").joinpath("data/sample_prompts.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()] + EXTRA_QUESTIONS


def chat_ids(tokenizer, question: str) -> list[int]:
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def mixed_chat_workload(tokenizer, num_prompts: int = 64, min_tokens: int = 16, max_tokens: int = 192,
                        seed: int = 0) -> Workload:
    """`num_prompts` distinct chat prompts, each forced to a fixed length in [min_tokens, max_tokens]."""
    pool = questions()
    rng = random.Random(seed)
    prompts = [chat_ids(tokenizer, pool[i % len(pool)] + ("" if i < len(pool) else f" (take {i // len(pool) + 1})"))
               for i in range(num_prompts)]
    return Workload(prompts, [rng.randint(min_tokens, max_tokens) for _ in range(num_prompts)])


GUIDE_SECTION = (
    "Section {index}. Answer as a careful, friendly assistant for a public library. Keep answers short and "
    "concrete, prefer plain words over jargon, and say so when you are not sure. When a question is about "
    "a book, name its author and year if you know them. When a question is about a place, mention where it "
    "is. Never invent quotations, and do not give medical, legal or financial advice beyond general facts. "
)


def system_prompt(min_tokens: int, tokenizer, title: str = "Library assistant guide") -> str:
    """A system prompt of at least `min_tokens` tokens, built from numbered guide sections."""
    text, index = f"{title}.\n", 1
    while len(tokenizer.encode(text)) < min_tokens:
        text += GUIDE_SECTION.format(index=index)
        index += 1
    return text


def _chat(tokenizer, system: str, question: str) -> list[int]:
    encoded = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                             {"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def shared_prefix_workload(tokenizer, num_prompts: int = 64, prefix_tokens: int = 600,
                           output_len: int = 64) -> Workload:
    """Every request: the same long system prompt, then a short distinct question."""
    system = system_prompt(prefix_tokens, tokenizer)
    pool = questions()
    prompts = [_chat(tokenizer, system, pool[i % len(pool)] + ("" if i < len(pool) else f" ({i})"))
               for i in range(num_prompts)]
    return Workload(prompts, [output_len] * num_prompts)


def interleaved_templates_workload(tokenizer, num_templates: int = 4, per_template: int = 16,
                                   prefix_tokens: int = 400, output_len: int = 32) -> Workload:
    """Rows of several templates (distinct long system prompts) interleaved: A B C D A B C D ..."""
    systems = [system_prompt(prefix_tokens, tokenizer, f"Template {t + 1} of {num_templates}")
               for t in range(num_templates)]
    pool = questions()
    prompts = [_chat(tokenizer, systems[i % num_templates], pool[(i // num_templates) % len(pool)])
               for i in range(num_templates * per_template)]
    return Workload(prompts, [output_len] * len(prompts))
