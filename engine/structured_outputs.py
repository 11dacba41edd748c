"""Constrained decoding with xgrammar: a request's JSON schema, regex, choice list or EBNF grammar becomes a
token bitmask applied to its logits rows before sampling (and before draft verification). Grammars are
compiled once per spec and cached; each sequence has its own matcher (by id), advanced lazily by its output
tokens, so forks (n > 1), preemption and prefix-cache hits need nothing special."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch

    from engine.sequence import Sequence
    from engine.step_types import SampleLayout

__all__ = ["StructuredOutputs", "StructuredOutputsParams", "check_json_schema"]


class StructuredOutputs:
    """The engine's grammar compiler and cache; builds per-sequence matchers and applies their masks."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_cached: int = 512) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.max_cached = max_cached
        self._compiler = None  # built on first use: the tokenizer's vocabulary takes ~0.7 s to analyse
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # cache misses, for tests and stats
        self._matchers: dict[int, tuple[Any, int]] = {}  # seq_id -> (matcher, output tokens it has accepted)

    def compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params (cached); ValueError when the schema, regex or grammar is invalid."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = self._compile(params)
        with self._lock:
            self._cache[key] = grammar
            self.compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, params: StructuredOutputsParams):
        compiler = self.compiler()
        kind = params.kind
        any_whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                try:
                    schema = json.loads(params.json) if isinstance(params.json, str) else params.json
                except ValueError as problem:
                    raise ValueError(f"invalid structured_outputs.json: not JSON ({problem})") from None
                check_json_schema(schema)
                return compiler.compile_json_schema(json.dumps(schema), any_whitespace=any_whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except ValueError:
            raise
        except Exception as problem:  # xgrammar reports bad input as RuntimeError with the parser's message
            message = str(problem).strip().splitlines()[-1] if str(problem).strip() else type(problem).__name__
            raise ValueError(f"invalid structured_outputs.{kind}: {message}") from None

    def matcher(self, seq: Sequence):
        """The sequence's matcher, advanced through the output tokens it has not seen yet."""
        import xgrammar as xgr

        matcher, seen = self._matchers.get(seq.seq_id) or (
            xgr.GrammarMatcher(self.compile(seq.params.structured_outputs)), 0)
        outputs = seq.token_ids[seq.num_prompt_tokens + seen:]
        for token in outputs:
            if not matcher.is_terminated():
                matcher.accept_token(token)
        self._matchers[seq.seq_id] = matcher, seen + len(outputs)
        return matcher

    def release(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            self._matchers.pop(seq_id, None)

    @staticmethod
    def constrains(seqs: Iterable[Sequence]) -> bool:
        return any(s.params.structured_outputs is not None for s in seqs)

    def mask(self, logits: torch.Tensor, layout: SampleLayout) -> torch.Tensor:
        """logits with every constrained row's disallowed tokens at -inf. A sequence with drafts gets, at draft
        position i, the mask after accepting drafts[:i]; positions past a draft the grammar rejects stay open
        (verification stops at that draft, since the target gives it probability 0)."""
        import xgrammar as xgr

        logits = logits.float()
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        rows: list[int] = []
        for seq_id, seq in layout.seqs.items():
            if seq.params.structured_outputs is None or (matcher := self.matcher(seq)).is_terminated():
                continue  # terminated: only with ignore_eos, left free
            start = layout.first_row[seq_id]
            matcher.fill_next_token_bitmask(bitmask, start)
            rows.append(start)
            accepted = 0
            for draft in layout.drafts.get(seq_id, ()):
                if matcher.is_terminated() or not matcher.accept_token(draft):
                    break
                accepted += 1
                matcher.fill_next_token_bitmask(bitmask, start + accepted)
                rows.append(start + accepted)
            if accepted:
                matcher.rollback(accepted)
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=min(self.vocab_size, logits.shape[-1]), indices=rows)
        return logits


def check_json_schema(schema: Any) -> None:
    """ValueError naming the problem when schema is not a valid JSON Schema (checked by its own metaschema)."""
    import jsonschema

    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as problem:
        raise ValueError(f"invalid JSON schema: {problem.message}") from None
