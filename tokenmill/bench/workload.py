"""The benchmark workloads: chat prompts with forced output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass
from importlib import resources

from engine.chat import chat_token_ids

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
    return chat_token_ids(tokenizer, [{"role": "user", "content": question}])


def mixed_chat_workload(tokenizer, num_prompts: int = 64, min_tokens: int = 16, max_tokens: int = 192,
                        seed: int = 0) -> Workload:
    """`num_prompts` distinct chat prompts, each forced to a fixed length in [min_tokens, max_tokens]."""
    texts, lengths = mixed_chat_questions(num_prompts, min_tokens, max_tokens, seed)
    return Workload([chat_ids(tokenizer, text) for text in texts], lengths)


def mixed_chat_questions(num_prompts: int = 64, min_tokens: int = 16, max_tokens: int = 192,
                         seed: int = 0) -> tuple[list[str], list[int]]:
    """The questions of `mixed_chat_workload` and the output length forced on each."""
    pool = questions()
    rng = random.Random(seed)
    texts = [pool[i % len(pool)] + ("" if i < len(pool) else f" (take {i // len(pool) + 1})")
             for i in range(num_prompts)]
    return texts, [rng.randint(min_tokens, max_tokens) for _ in range(num_prompts)]


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
    return chat_token_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}])


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


PASSAGES = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could reproduce pages quickly and "
    "cheaply. Before that, books were copied by hand, mostly in monasteries, and a single volume could take months.",
    "Honeybees live in colonies of tens of thousands. A single queen lays the eggs, worker bees gather nectar and "
    "pollen, build the comb and care for the young, and drones exist only to mate. In winter the colony clusters "
    "together and shivers its flight muscles to keep the hive warm.",
    "A compiler translates a program written in a high-level language into machine code. It first reads the source "
    "text into tokens, then parses the tokens into a syntax tree, checks the types, optimises an intermediate "
    "representation, and finally emits instructions for the target processor.",
    "The water cycle moves water between the oceans, the air and the land. Sunlight evaporates water from the sea, "
    "the vapour rises and cools into clouds, the clouds release rain or snow, and rivers carry the water back to "
    "the sea, where the cycle begins again.",
    "Chess is played on a board of sixty-four squares. Each player starts with sixteen pieces: a king, a queen, two "
    "rooks, two bishops, two knights and eight pawns. The goal is to checkmate the opposing king, which means "
    "attacking it so that it has no legal way to escape.",
    "Photosynthesis lets plants turn light into chemical energy. Chlorophyll in the leaves absorbs sunlight, which "
    "drives the splitting of water and the capture of carbon dioxide from the air. The plant builds sugars from the "
    "carbon and releases oxygen as a by-product.",
]


def copy_workload(tokenizer, num_prompts: int = 6, output_len: int = 192) -> Workload:
    """Requests whose answers repeat their prompt: rewrite a given text (two passages) word for word."""
    instruction = "Copy the following text exactly, word for word:\n\n"
    texts = [PASSAGES[i % len(PASSAGES)] + "\n\n" + PASSAGES[(i + 1) % len(PASSAGES)] for i in range(num_prompts)]
    prompts = [chat_ids(tokenizer, instruction + text) for text in texts]
    return Workload(prompts, [output_len] * num_prompts)


def long_tail_workload(tokenizer, num_short: int = 24, num_long: int = 4, short_len: int = 16,
                       long_len: int = 160) -> Workload:
    """A job whose tail runs with few requests: many short answers, then a few long copying ones."""
    mixed = mixed_chat_workload(tokenizer, num_short, short_len, short_len)
    copies = copy_workload(tokenizer, num_long, long_len)
    return Workload(mixed.prompts + copies.prompts, mixed.output_lens + copies.output_lens)
