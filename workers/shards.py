"""Run shards' rows through `LLMEngine.stream`: render and tokenize each row, apply its sampling overrides,
let the engine run them (asking between steps whether to stop), and collect one result or one error per row."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ingest.sampling import ResponseFormatError, check_for_model, sampling_params
from storage.formats import CHAT, Request, RowError
from storage.models import Job

if TYPE_CHECKING:
    from engine import LLMEngine, RequestOutput, SamplingParams


@dataclass
class ShardOutcome:
    records: list[dict[str, Any]] = field(default_factory=list)  # rows of the part file
    errors: list[RowError] = field(default_factory=list)
    cancelled: bool = False
    spec_draft_tokens: int = 0  # speculative decoding while this shard ran
    spec_accepted_tokens: int = 0
    completed_job: bool = False  # this shard was the job's last to complete: the job is now finalizing
    lost: bool = False  # another worker claimed the shard meanwhile: this one stopped and wrote nothing

    def totals(self) -> dict[str, int]:
        return {
            "rows_completed": sum(1 for r in self.records if r["choice_index"] == 0),  # a record per choice (n)
            "rows_failed": len(self.errors),
            "prompt_tokens": sum(r["prompt_tokens"] for r in self.records if r["choice_index"] == 0),
            "completion_tokens": sum(r["completion_tokens"] for r in self.records),
            "cached_tokens": sum(r["cached_tokens"] for r in self.records if r["choice_index"] == 0),
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
        }


@dataclass(eq=False)
class ShardWork:
    """One shard's rows for `ShardsExecution`: `key` is the caller's (e.g. the shard row), `prefix` makes its
    request ids unique in the engine."""

    key: Any
    rows: Iterable[Request | RowError]
    prefix: str
    outcome: ShardOutcome = field(default_factory=ShardOutcome)
    outstanding: int = 0  # rows in the engine
    fed: bool = False  # all its rows were handed to the engine (or became errors)
    done: bool = False


class ShardsExecution:
    """Many shards' rows through one `LLMEngine.stream`, so the next shard's rows are admitted while the
    current one's tail decodes. A shard is started (`on_start`) when its first row is about to be fed, and
    finished (`on_done` with its outcome) as soon as its last row finishes. `should_stop` is asked between
    engine steps; `on_progress(rows, tokens)` reports finished rows and newly generated tokens. `priority` is
    the engine request priority of every row (it orders admission under `scheduling_policy="priority"`);
    rows share prefix-cache blocks only with rows of the same `cache_salt`. A row naming a model outside
    `models` (when given) fails with `model_not_found`."""

    def __init__(self, engine: LLMEngine, defaults: dict[str, Any],
                 should_stop: Callable[[], bool] = lambda: False,
                 on_progress: Callable[[int, int], None] = lambda rows, tokens: None, priority: int = 0,
                 cache_salt: str | None = None, models: Collection[str] = ()) -> None:
        self.engine, self.defaults, self.priority, self.cache_salt = engine, defaults, priority, cache_salt
        self.models = frozenset(models)
        self.should_stop, self.on_progress = should_stop, on_progress
        self.cancelled = False
        self.in_flight: list[ShardWork] = []  # started, not done (oldest first)
        self.pending: dict[str, tuple[ShardWork, Request, int | None]] = {}  # and the row's logprobs top-k
        self._on_start: Callable[[ShardWork], None] = lambda work: None
        self._on_done: Callable[[ShardWork], None] = lambda work: None

    @classmethod
    def for_job(cls, engine: LLMEngine, job: Job, **callbacks: Any) -> ShardsExecution:
        """The execution of a job's rows: its sampling defaults, priority, cache salt and model names."""
        return cls(engine, job.settings.sampling, priority=engine_priority(job), cache_salt=job.settings.cache_salt,
                   models=served_models(job), **callbacks)

    def run(self, works: Iterable[ShardWork], on_start: Callable[[ShardWork], None] = lambda work: None,
            on_done: Callable[[ShardWork], None] = lambda work: None) -> bool:
        """Run the shards; True when a stop request ended it (the shards in `in_flight` did not finish)."""
        self._on_start, self._on_done = on_start, on_done
        self._generated = self.engine.stats.generation_tokens
        self._spec_seen = self._spec_counts()
        outputs = self.engine.stream(self._requests(works), should_stop=self._stop)
        self.engine.step_observers.append(self._observe_step)
        try:
            for output in outputs:
                work, request, top_k = self.pending.pop(output.request_id)
                self._collect(work.outcome, request, output, top_k)
                work.outstanding -= 1
                self._finish_if_done(work)
        finally:
            outputs.close()  # aborts what is still running: a stop request, or an error
            self.engine.step_observers.remove(self._observe_step)
        return self.cancelled

    def _stop(self) -> bool:
        self.cancelled = self.should_stop()
        return self.cancelled

    def _finish_if_done(self, work: ShardWork) -> None:
        if work.fed and work.outstanding == 0 and not work.done:
            work.done = True
            self._on_done(work)
            self.in_flight.remove(work)  # after on_done: a shard whose part could not be written is in flight

    def _spec_counts(self) -> tuple[int, int]:
        spec = self.engine.spec.stats if self.engine.spec else None
        return (spec.draft_tokens, spec.accepted_tokens) if spec else (0, 0)

    def _observe_step(self, finished: list[RequestOutput]) -> None:
        """After each engine step: the progress, and the speculation counts (credited to the oldest shard in
        flight: the engine counts them per step, not per request)."""
        drafted, accepted = self._spec_counts()
        if self.in_flight:
            oldest = self.in_flight[0].outcome
            oldest.spec_draft_tokens += drafted - self._spec_seen[0]
            oldest.spec_accepted_tokens += accepted - self._spec_seen[1]
        self._spec_seen = (drafted, accepted)
        generated = self.engine.stats.generation_tokens
        self.on_progress(len(finished), generated - self._generated)
        self._generated = generated

    def _requests(self, works: Iterable[ShardWork]
                  ) -> Iterator[tuple[str, list[int], SamplingParams, int, str | None]]:
        """The rows the engine should run, shard after shard; a row that cannot run becomes its error here."""
        for work in works:
            self.in_flight.append(work)
            self._on_start(work)
            for item in work.rows:
                prepared = item if isinstance(item, RowError) else self._prepare(item)
                if isinstance(prepared, RowError):
                    work.outcome.errors.append(prepared)
                    self.on_progress(1, 0)
                    continue
                request_id = f"{work.prefix}{item.row}"
                self.pending[request_id] = (work, item, prepared[1].logprobs)
                work.outstanding += 1
                yield request_id, *prepared, self.priority, self.cache_salt
            work.fed = True
            self._finish_if_done(work)  # every row of it was an error, or all finished while feeding

    def _prepare(self, request: Request) -> tuple[list[int], SamplingParams] | RowError:
        def error(code: str, message: str) -> RowError:
            return RowError(request.row, request.custom_id, code, message)

        if self.models and request.model is not None and request.model not in self.models:
            return error("model_not_found", f"The model {request.model!r} does not exist here; this job serves "
                                            f"{', '.join(map(repr, sorted(self.models)))}")
        try:
            params = sampling_params(self.defaults, request.params)
            check_for_model(params, self.engine.runner.vocab_size)
        except ResponseFormatError as problem:
            return error("invalid_response_format", str(problem))
        except (ValueError, TypeError) as problem:
            return error("invalid_parameter", str(problem))
        if params.structured_outputs is not None:
            try:
                self.engine.structured.compile(params.structured_outputs)  # cached per schema
            except ValueError as problem:
                return error("invalid_response_format", str(problem))
        try:
            token_ids = self._tokenize(request)
        except Exception as problem:  # a chat template or tokenizer refusing this row's content
            code = "invalid_messages" if request.endpoint == CHAT else "invalid_prompt"
            return error(code, f"could not tokenize the row: {problem}")
        from engine.sampling_params import context_length_error  # the engine's own check, imported lazily

        if too_long := context_length_error(len(token_ids), params.max_tokens, self.engine.max_model_len):
            return error("context_length_exceeded", too_long)
        return token_ids, params

    def _tokenize(self, request: Request) -> list[int]:
        if request.messages is not None:
            from engine.chat import chat_token_ids

            return chat_token_ids(self.engine.tokenizer, request.messages)
        return self.engine.encode(request.prompt)

    @staticmethod
    def _collect(outcome: ShardOutcome, request: Request, output: RequestOutput, top_k: int | None) -> None:
        if output.error or not output.outputs:
            message = output.error or "the engine returned no completion"
            outcome.errors.append(RowError(request.row, request.custom_id, "engine_error", message))
            return
        metrics = output.metrics
        outcome.records.extend({
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
            "logprobs": None if top_k is None else openai_logprobs(completion, request.endpoint, top_k),
            "choice_index": completion.index,
        } for completion in output.outputs)


class ShardExecution:
    """One shard on its own: `ShardsExecution` with a single shard."""

    def __init__(self, execution: ShardsExecution, request_prefix: str) -> None:
        self.execution, self.prefix = execution, request_prefix

    def run(self, rows: Iterable[Request | RowError]) -> ShardOutcome:
        """Feed the rows through `LLMEngine.stream`; a stop request ends it with `cancelled` set."""
        work = ShardWork(None, rows, self.prefix)
        work.outcome.cancelled = self.execution.run([work])
        return work.outcome


def engine_priority(job: Job) -> int:
    """The engine request priority of a job's rows: a higher job priority is admitted first, and the engine
    admits the lowest value first."""
    return -(job.priority or 0)


def served_models(job: Job) -> frozenset[str]:
    """The names an OpenAI row's `model` may give: the job's model and its served names (aliases)."""
    return frozenset([job.model, *job.settings.served_model_names])


def openai_logprobs(completion, endpoint: str, top_k: int) -> str:
    """The completion's logprobs as JSON text in OpenAI's shape for the endpoint (chat: `content` items with
    `top_logprobs`; completions: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""
    import json

    chosen = [entry[token] for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)]
    tops = [sorted((lp for lp in entry.values() if lp.rank <= top_k), key=lambda lp: lp.rank)[:top_k]
            for entry in completion.logprobs]
    if endpoint == CHAT:
        def item(lp) -> dict:
            return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}

        content = [{**item(lp), "top_logprobs": [item(t) for t in top]} for lp, top in zip(chosen, tops, strict=True)]
        return json.dumps({"content": content, "refusal": None}, ensure_ascii=False)
    offsets, offset = [], 0
    for lp in chosen:
        offsets.append(offset)
        offset += len(lp.decoded_token)
    return json.dumps({"tokens": [lp.decoded_token for lp in chosen], "token_logprobs": [lp.logprob for lp in chosen],
                       "top_logprobs": [{t.decoded_token: t.logprob for t in top} for top in tops],
                       "text_offset": offsets}, ensure_ascii=False)


def _ms(start: float, end: float | None) -> float | None:
    return None if end is None else round((end - start) * 1000, 3)
