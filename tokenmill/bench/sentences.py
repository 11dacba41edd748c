"""Held-out English sentences of mixed length for the embedding checks and `tokenmill bench embed`: made from
a seeded phrase grammar (nothing downloaded), so any count is reproducible and no sentence was seen while
tuning. Lengths run from a few words to paragraphs that pass all-MiniLM's 256-token limit only when asked."""

from __future__ import annotations

import random

SUBJECTS = ["the old librarian", "a small robot", "my neighbour's cat", "the city council", "every student",
            "the night train", "a quiet engineer", "the weather service", "our best customer", "the river",
            "a famous chef", "the museum guard", "two young painters", "the hospital", "a tired pilot"]
VERBS = ["repaired", "described", "forgot", "painted", "measured", "sold", "translated", "photographed", "hid",
         "celebrated", "questioned", "borrowed", "rebuilt", "ignored", "studied"]
OBJECTS = ["the broken bicycle", "a letter from Lisbon", "the annual budget", "three green apples",
           "the lighthouse", "an unfinished symphony", "the morning news", "a map of the harbour",
           "the last ticket", "a jar of honey", "the school garden", "an ancient coin", "the power grid"]
CLAUSES = ["before the storm arrived", "while everyone was asleep", "because nobody else would",
           "after a long argument about money", "during the coldest week of the year",
           "without telling the manager", "as the sun went down over the hills", "for reasons no one understood",
           "with surprising patience", "in front of a curious crowd", "although it was raining heavily",
           "just in time for the festival", "despite the warnings from the engineers"]
EXTRAS = ["Prices rose by 12% in 2023.", "It cost €45, or about $49.", "Nobody expected that!",
          "Was it worth it?", "The report (page 7) says otherwise.", "Café owners were delighted.",
          "See section 4.2 for details.", "Temperatures fell to -8 °C overnight."]


def sentence(rng: random.Random, clauses: int) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    words += [rng.choice(CLAUSES) for _ in range(clauses)]
    text = " ".join(words)
    text = text[0].upper() + text[1:] + "."
    return text + (" " + rng.choice(EXTRAS) if rng.random() < 0.3 else "")


def held_out_sentences(count: int, seed: int = 20260201, max_sentences: int = 10) -> list[str]:
    """`count` distinct texts: mostly one short sentence, some a few, a tail of long paragraphs (up to
    `max_sentences` sentences, about 15 to 250 tokens)."""
    rng = random.Random(seed)
    texts: list[str] = []
    seen: set[str] = set()
    while len(texts) < count:
        parts = 1 if rng.random() < 0.6 else rng.randint(2, max_sentences)
        text = " ".join(sentence(rng, rng.randint(0, 2)) for _ in range(parts))
        if text not in seen:
            seen.add(text)
            texts.append(text)
    return texts
