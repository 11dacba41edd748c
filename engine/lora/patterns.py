"""PEFT's `rank_pattern` / `alpha_pattern` keys, matched in linear time.

PEFT (`peft.utils.other.get_pattern_key`) takes the first key for which `re.match(rf"(.*\\.)?({key})$", module)`
holds, `module` the full name in the base model (`model.layers.0.self_attn.q_proj`). Running an adapter's keys
through `re` lets one key (`(a+)+$`) backtrack for hours holding the GIL. Here a key is parsed into the regular
expressions PEFT users write and run as an automaton, one pass over the name: literal characters, `.`, `\\d`, `\\w`,
escaped punctuation, `[...]` classes, each optionally followed by `*`, `+` or `?`; `|` between alternatives; `^` at
an alternative's start, `$` at its end. Groups, counted repeats, backreferences and lookarounds are refused with a
PatternError (a ValueError), so a module matches a key here exactly when it does in PEFT."""

from __future__ import annotations

import string
from dataclasses import dataclass

MAX_KEYS = 128  # keys in one pattern
MAX_KEY_CHARS = 200
_DIGITS = frozenset(string.digits)
_WORD = frozenset(string.ascii_letters + string.digits + "_")
_CLASS_ESCAPES = {"d": _DIGITS, "w": _WORD}
_SPECIAL = set("()|*+?{}[]^$\\.")
_NEWLINE = frozenset("\n")


class PatternError(ValueError):
    """A pattern key outside the forms served, or malformed."""


@dataclass(frozen=True)
class _Atom:
    chars: frozenset[str]
    negated: bool = False
    optional: bool = False  # `?` or `*`
    repeats: bool = False  # `*` (a `+` is the atom once, then again with `*`)

    def accepts(self, char: str) -> bool:
        return (char in self.chars) != self.negated


@dataclass(frozen=True)
class _Alternative:
    atoms: tuple[_Atom, ...]
    anchored: bool  # `^`: the whole module name, never a suffix after a '.'


class PatternKey:
    """One key of `rank_pattern` / `alpha_pattern`; `matches(module)` is PEFT's `(.*\\.)?(key)$` match."""

    def __init__(self, key: str) -> None:
        if not isinstance(key, str):
            raise PatternError(f"pattern key {key!r} is not a string")
        if not key or len(key) > MAX_KEY_CHARS:
            raise PatternError(f"pattern key {key[:40]!r} must be 1 to {MAX_KEY_CHARS} characters")
        self.key = key
        self.automata = tuple(_Automaton(_parse_alternative(part, key)) for part in _split_alternatives(key))

    def matches(self, module: str) -> bool:
        return any(automaton.matches(module) for automaton in self.automata)


def compile_pattern(pattern, what: str) -> list[tuple[PatternKey, object]]:
    """A config's `rank_pattern` / `alpha_pattern` (a JSON object of key -> value, or null) as (key, value) pairs in
    the config's order; PatternError when it is not one or a key is not served."""
    if pattern is None:
        return []
    if not isinstance(pattern, dict):
        raise PatternError(f"{what} must be an object of module pattern -> value, got {type(pattern).__name__}")
    if len(pattern) > MAX_KEYS:
        raise PatternError(f"{what} has {len(pattern)} keys, over the limit of {MAX_KEYS}")
    compiled = []
    for key, value in pattern.items():
        try:
            compiled.append((PatternKey(key), value))
        except PatternError as error:
            raise PatternError(f"{what}: {error}") from None
    return compiled


def first_match(pattern: list[tuple[PatternKey, object]], module: str):
    """The value of the first key matching `module` (PEFT's order), or None."""
    return next((value for key, value in pattern if key.matches(module)), None)


# ---- parsing -----------------------------------------------------------------------------------------

def _split_alternatives(key: str) -> list[str]:
    parts, current, index, in_class = [], [], 0, False
    while index < len(key):
        char = key[index]
        if char == "\\" and index + 1 < len(key):
            current.append(key[index:index + 2])
            index += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class and current and current[-1] != "[":
            in_class = False
        if char == "|" and not in_class:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        index += 1
    parts.append("".join(current))
    return parts


def _parse_alternative(text: str, key: str) -> _Alternative:
    anchored = text.startswith("^")
    index = 1 if anchored else 0
    end = len(text) - 1 if text.endswith("$") and not text.endswith("\\$") else len(text)
    atoms: list[_Atom] = []
    while index < end:
        char = text[index]
        if char == ".":
            chars, negated, index = _NEWLINE, True, index + 1  # re's '.': all but a newline
        elif char == "\\":
            chars, index = _escape(text, index, key), index + 2
            negated = False
        elif char == "[":
            chars, negated, index = _char_class(text, index, key)
        elif char in _SPECIAL:
            raise PatternError(f"pattern key {key!r}: {char!r} at {index} is not served (keys may use literal "
                               "characters, '.', '\\d', '\\w', '[...]', '*', '+', '?', '|', a leading '^' and a "
                               "trailing '$'; no groups or counted repeats)")
        else:
            chars, negated, index = frozenset(char), False, index + 1
        quantifier = text[index] if index < end and text[index] in "*+?" else ""
        index += len(quantifier)
        if quantifier and index < end and text[index] == "?":  # lazy: the same names match
            index += 1
        if index < end and text[index] in "*+?{":
            raise PatternError(f"pattern key {key!r}: {text[index]!r} at {index} is not served (no counted repeats "
                               "or repeats of a repeat)")
        atom = _Atom(chars, negated)
        if quantifier == "+":
            atoms.append(atom)
        if quantifier:
            atom = _Atom(chars, negated, optional=True, repeats=quantifier != "?")
        atoms.append(atom)
    return _Alternative(tuple(atoms), anchored)


def _escape(text: str, index: int, key: str) -> frozenset[str]:
    if index + 1 >= len(text):
        raise PatternError(f"pattern key {key!r} ends with a lone '\\'")
    char = text[index + 1]
    if char in _CLASS_ESCAPES:
        return _CLASS_ESCAPES[char]
    if char.isalnum():
        raise PatternError(f"pattern key {key!r}: escape '\\{char}' is not served (only \\d, \\w and escaped "
                           "punctuation)")
    return frozenset(char)


def _char_class(text: str, index: int, key: str) -> tuple[frozenset[str], bool, int]:
    """`[...]` at `index`: its characters, whether negated, and the index after it."""
    index += 1
    negated = index < len(text) and text[index] == "^"
    index += negated
    chars: set[str] = set()
    first = True
    while index < len(text) and (text[index] != "]" or first):
        first = False
        char = text[index]
        if char == "\\":
            chars |= _escape(text, index, key)
            index += 2
            continue
        if char == "[":
            raise PatternError(f"pattern key {key!r}: '[' inside a character class is not served")
        if index + 2 < len(text) and text[index + 1] == "-" and text[index + 2] != "]":
            low, high = char, text[index + 2]
            if low > high or high in "\\[":
                raise PatternError(f"pattern key {key!r}: bad range {low}-{high} in a character class")
            chars |= {chr(code) for code in range(ord(low), ord(high) + 1)}
            index += 3
            continue
        chars.add(char)
        index += 1
    if index >= len(text):
        raise PatternError(f"pattern key {key!r}: '[' without its ']'")
    return frozenset(chars), negated, index + 1


# ---- matching: the set of positions in the key's atoms, one step per character of the name -------------

_MAX_CACHED_STEPS = 1 << 16


class _Automaton:
    """An alternative run as a DFA built on the fly: each (set of positions, character) step is computed once,
    so the names of a model's modules (which share most of their characters) cost a lookup per character."""

    def __init__(self, alternative: _Alternative) -> None:
        self.atoms, self.anchored = alternative.atoms, alternative.anchored
        self.start = self._closure({0})
        self.steps: dict[tuple[frozenset[int], str], frozenset[int]] = {}

    def matches(self, module: str) -> bool:
        states = self.start
        for char in module:
            step = self.steps.get((states, char))
            if step is None:
                step = self._step(states, char)
                if len(self.steps) >= _MAX_CACHED_STEPS:
                    self.steps.clear()
                self.steps[(states, char)] = step
            states = step
            if not states and self.anchored:
                return False
        return len(self.atoms) in states

    def _step(self, states: frozenset[int], char: str) -> frozenset[int]:
        atoms = self.atoms
        moved = {state if atoms[state].repeats else state + 1
                 for state in states if state < len(atoms) and atoms[state].accepts(char)}
        step = self._closure(moved)
        if char == "." and not self.anchored:  # PEFT's `(.*\.)?`: the key may match after any '.'
            step |= self.start
        return step

    def _closure(self, states: set[int]) -> frozenset[int]:
        atoms, todo, seen = self.atoms, list(states), set(states)
        while todo:
            state = todo.pop()
            if state < len(atoms) and atoms[state].optional and state + 1 not in seen:
                seen.add(state + 1)
                todo.append(state + 1)
        return frozenset(seen)
