"""Run one shard's rows through an `LLMEngine`: render and tokenize each row, apply its sampling overrides,
step the engine (asking between steps whether to stop), and collect one result or one error per row."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from storage.formats import CHAT, Request, RowError

if TYPE_CHECKING:
    from engine import LLMEngine, RequestOutput, SamplingParams

INTEGER_PARAMS = ("max_tokens", "top_k", "seed", "n")


@dataclass
class ShardOutcome:
    records: list[dict[str, Any]] = field(default_factory=list)  # rows of the part file
    errors: list[RowError] = field(default_factory=list)
    cancelled: bool = False
    spec_draft_tokens: int = 0  # speculative decoding while this shard ran
    spec_accepted_tokens: int = 0
    completed_job: bool = False  # this shard was the job's last to complete: the job is now finalizing

    def totals(self) -> dict[str, int]:
        return {
            "rows_completed": len(self.records),
            "rows_failed": len(self.errors),
            "prompt_tokens": sum(r["prompt_tokens"] for r in self.records),
            "completion_tokens": sum(r["completion_tokens"] for r in self.records),
            "cached_tokens": sum(r["cached_tokens"] for r in self.records),
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
        }


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """The job defaults with a row's overrides; ValueError/TypeError name the bad parameter."""
    from engine import SamplingParams

    merged = {**defaults, **{name: _integral(name, value) for name, value in overrides.items()}}
    if merged.get("n", 1) != 1:
        raise ValueError(f"n must be 1 in batch jobs (one completion per row), got {merged['n']!r}")
    return SamplingParams(**merged)


def _integral(name: str, value: Any) -> Any:
    """8.0 -> 8 for integer parameters: pandas turns integer columns with nulls into floats."""
    if name in INTEGER_PARAMS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class ShardExecution:
    """One pass over a shard's rows. `should_stop` is asked between engine steps; `on_progress(rows, tokens)`
    reports finished rows and newly generated tokens."""

    def __init__(self, engine: LLMEngine, defaults: dict[str, Any], request_prefix: str,
                 should_stop: Callable[[], bool] = lambda: False,
                 on_progress: Callable[[int, int], None] = lambda rows, tokens: None) -> None:
        self.engine, self.defaults, self.prefix = engine, defaults, request_prefix
        self.should_stop, self.on_progress = should_stop, on_progress
        self.outcome = ShardOutcome()
        self.pending: dict[str, Request] = {}

    def run(self, rows: Iterable[Request | RowError]) -> ShardOutcome:
        source, exhausted = iter(rows), False
        max_pending = 2 * self.engine.config.max_num_seqs
        try:
            while True:
                while not exhausted and len(self.pending) < max_pending:
                    item = next(source, None)
                    exhausted = item is None
                    if item is not None:
                        self._submit(item)
                if not self.pending:
                    return self.outcome
                if self.should_stop():
                    self.outcome.cancelled = True
                    return self.outcome
                self._step()
        finally:
            for request_id in self.pending:
                self.engine.abort(request_id)

    def _step(self) -> None:
        generated_before = self.engine.stats.generation_tokens
        spec = self.engine.spec.stats if self.engine.spec else None
        drafted, accepted = (spec.draft_tokens, spec.accepted_tokens) if spec else (0, 0)
        finished = self.engine.step()
        if spec:
            self.outcome.spec_draft_tokens += spec.draft_tokens - drafted
            self.outcome.spec_accepted_tokens += spec.accepted_tokens - accepted
        for output in finished:
            self._collect(self.pending.pop(output.request_id), output)
        self.on_progress(len(finished), self.engine.stats.generation_tokens - generated_before)

    def _submit(self, item: Request | RowError) -> None:
        prepared = item if isinstance(item, RowError) else self._prepare(item)
        if isinstance(prepared, RowError):
            self.outcome.errors.append(prepared)
            self.on_progress(1, 0)
            return
        token_ids, params = prepared
        request_id = f"{self.prefix}{item.row}"
        self.engine.add_request(request_id, token_ids, params)
        self.pending[request_id] = item

    def _prepare(self, request: Request) -> tuple[list[int], SamplingParams] | RowError:
        def error(code: str, message: str) -> RowError:
            return RowError(request.row, request.custom_id, code, message)

        try:
            params = sampling_params(self.defaults, request.params)
        except (ValueError, TypeError) as problem:
            return error("invalid_parameter", str(problem))
        try:
            token_ids = self._tokenize(request)
        except Exception as problem:  # a chat template or tokenizer refusing this row's content
            code = "invalid_messages" if request.endpoint == CHAT else "invalid_prompt"
            return error(code, f"could not tokenize the row: {problem}")
        limit = self.engine.max_model_len
        if len(token_ids) + params.max_tokens > limit:
            return error("context_length_exceeded",
                         f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                         f"model's context of {limit} tokens")
        return token_ids, params

    def _tokenize(self, request: Request) -> list[int]:
        if request.messages is not None:
            encoded = self.engine.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True,
                                                                tokenize=True)
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        return self.engine.encode(request.prompt)

    def _collect(self, request: Request, output: RequestOutput) -> None:
        if output.error or not output.outputs:
            message = output.error or "the engine returned no completion"
            self.outcome.errors.append(RowError(request.row, request.custom_id, "engine_error", message))
            return
        completion = output.outputs[0]
        metrics = output.metrics
        self.outcome.records.append({
            "custom_id": request.custom_id,
            "text": completion.text,
            "finish_reason": completion.finish_reason,
            "prompt_tokens": len(output.prompt_token_ids),
            "completion_tokens": len(completion.token_ids),
            "cached_tokens": output.num_cached_tokens,
            "ttft_ms": _ms(metrics.arrival_time, metrics.first_token_time) if metrics else None,
            "latency_ms": _ms(metrics.arrival_time, metrics.finish_time) if metrics else None,
            "row_index": request.row,
            "endpoint": request.endpoint,
        })


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000, 3)
