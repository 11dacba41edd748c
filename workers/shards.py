"""A shard's rows as the engine takes them and gives them back: `prepare_row` renders and tokenizes a row that
passed its checks (`ingest.row_checks`) and checks its length (or gives its error), `collect_row` turns the
engine's output into part-file records; `ShardOutcome` gathers a shard's records and errors. Embedding rows
(`/v1/embeddings`, on an embedding model's engine) go through `prepare_embedding_row` and `EmbeddingRow`. The
engine loop (`workers.engine_loop`) runs them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ingest.row_checks import CheckedRow
from storage.formats import CHAT, EMBEDDINGS, Request, RowError
from storage.formats.responses import request_echo

if TYPE_CHECKING:
    from engine import EmbeddingRequestOutput, LLMEngine, RequestOutput, SamplingParams
    from storage.models import Job


@dataclass
class ShardOutcome:
    records: list[dict[str, Any]] = field(default_factory=list)  # rows of the part file
    errors: list[RowError] = field(default_factory=list)
    cancelled: bool = False
    spec_draft_tokens: int = 0  # speculative decoding while this shard ran
    spec_accepted_tokens: int = 0
    completed_job: bool = False  # this shard was the job's last to complete: the job is now finalizing
    lost: bool = False  # another worker claimed the shard meanwhile: this one stopped and wrote nothing
    embedding_size: int | None = None  # set when an embedding model ran it: its records are embeddings

    def totals(self) -> dict[str, int]:
        if self.embedding_size is not None:  # a record per input; a row's inputs all count
            rows = sum(1 for r in self.records if r["input_index"] == 0)
            prompt, completion, cached = sum(r["prompt_tokens"] for r in self.records), 0, 0
        else:  # a record per choice (n)
            rows = sum(1 for r in self.records if r["choice_index"] == 0)
            prompt = sum(r["prompt_tokens"] for r in self.records if r["choice_index"] == 0)
            completion = sum(r["completion_tokens"] for r in self.records)
            cached = sum(r["cached_tokens"] for r in self.records if r["choice_index"] == 0)
        return {
            "rows_completed": rows,
            "rows_failed": len(self.errors),
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cached_tokens": cached,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
        }


def prepare_row(engine: LLMEngine, checked: CheckedRow, token_ids: list[int] | None = None
                ) -> tuple[list[int], SamplingParams] | RowError:
    """A checked row (`ingest.row_checks`) as the engine runs it, its token ids and sampling parameters, or its
    error when its content cannot be tokenized or is too long for the model. `token_ids`: the row's, tokenized
    already (`tokenize_rows`)."""
    request, params = checked.request, checked.params

    def error(code: str, message: str) -> RowError:
        return RowError(request.row, request.custom_id, code, message)

    try:
        if token_ids is None:
            token_ids = _tokenize(engine, request)
    except Exception as problem:  # a chat template or tokenizer refusing this row's content
        code = "invalid_messages" if request.messages is not None else "invalid_prompt"
        return error(code, f"could not tokenize the row: {problem}")
    from engine.sampling_params import context_length_error  # the engine's own check, imported lazily

    if too_long := context_length_error(len(token_ids), params.max_tokens, engine.max_model_len):
        return error("context_length_exceeded", too_long)
    return token_ids, params


def is_embedding_engine(engine) -> bool:
    return getattr(engine, "embedding_size", None) is not None


@dataclass
class EmbeddingRow:
    """An embeddings row in the engine: its inputs' token ids go in as one request each; its records are
    written once every input has its vector."""

    request: Request
    token_ids: list[list[int]]
    params: Any  # engine.pooling.PoolingParams
    vectors: dict[int, tuple[list[float], int, float | None]] = field(default_factory=dict)
    failed: bool = False

    def collect(self, outcome: ShardOutcome, index: int, output: EmbeddingRequestOutput) -> bool:
        """Keep one input's vector; True (and the row's records or error in `outcome`) once the row is done."""
        request = self.request
        if self.failed:
            return False
        if output.error:
            self.failed = True
            outcome.errors.append(RowError(request.row, request.custom_id, "engine_error", output.error))
            return True
        latency = None if output.arrival_time is None else _ms(output.arrival_time, output.finish_time)
        self.vectors[index] = (output.outputs.embedding, len(output.prompt_token_ids), latency)
        if len(self.vectors) < len(self.token_ids):
            return False
        outcome.records.extend({
            "custom_id": request.custom_id, "embedding": vector, "prompt_tokens": tokens, "latency_ms": latency,
            "row_index": request.row, "input_index": i, "endpoint": EMBEDDINGS,
            "encoding_format": request.params.get("encoding_format", "float"), "model": request.model,
        } for i, (vector, tokens, latency) in sorted(self.vectors.items()))
        return True


def prepare_embedding_row(engine, checked: CheckedRow, truncate: bool) -> EmbeddingRow | RowError:
    """A checked embeddings row as the engine runs it (its inputs tokenized, over-long ones cut when `truncate`),
    or its error: an input it cannot tokenize, or over the model's max_seq_length."""
    request = checked.request

    def error(code: str, message: str) -> RowError:
        return RowError(request.row, request.custom_id, code, message)

    texts = [text for text in request.inputs if isinstance(text, str)]
    try:
        encoded = iter(engine.encode_batch(texts, truncate=truncate))
        token_ids = [next(encoded) if isinstance(item, str) else engine.encode(item) for item in request.inputs]
    except Exception as problem:
        return error("invalid_input", f"could not tokenize the row: {problem}")
    for i, ids in enumerate(token_ids):
        if truncate and len(ids) > engine.max_model_len:
            token_ids[i] = ids[:engine.max_model_len - 1] + ids[-1:]
        elif too_long := engine.length_error(len(ids)):
            where = f"input[{i}]: " if len(token_ids) > 1 else ""
            return error("context_length_exceeded", where + too_long)
    return EmbeddingRow(request, token_ids, checked.params)


def tokenize_rows(engine: LLMEngine, rows: list) -> dict[int, list[int]]:
    """The token ids of a shard's text rows by row, as `prepare_row` makes them but in one tokenizer call for its
    chat rows and one for its prompts (a call a row costs twice as much). A call that raises (a row the template
    or tokenizer refuses) leaves its rows out: `prepare_row` tokenizes them one by one, and fails that one alone."""
    tokenizer = engine.tokenizer
    requests = (r.request if isinstance(r, CheckedRow) else r for r in rows)
    text_rows = [r for r in requests if isinstance(r, Request) and r.endpoint != EMBEDDINGS]
    chats = [r for r in text_rows if r.messages is not None]
    prompts = [r for r in text_rows if r.messages is None and isinstance(r.prompt, str)]
    token_ids: dict[int, list[int]] = {}
    for batch, encode in ((chats, lambda: tokenizer.apply_chat_template(
            [list(r.messages) for r in chats], add_generation_prompt=True, tokenize=True)),
                          (prompts, lambda: tokenizer([r.prompt for r in prompts], add_special_tokens=True))):
        if not batch:
            continue
        try:
            encoded = encode()
        except Exception:
            continue
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        if len(ids) == len(batch):
            token_ids.update((r.row, list(i)) for r, i in zip(batch, ids, strict=True))
    return token_ids


def _tokenize(engine: LLMEngine, request: Request) -> list[int]:
    if request.messages is not None:
        from engine.chat import chat_token_ids

        return chat_token_ids(engine.tokenizer, request.messages)
    return engine.encode(request.prompt)


def collect_row(outcome: ShardOutcome, request: Request, output: RequestOutput, top_k: int | None,
                params: Any = None) -> None:
    """The engine's output of one row into the shard's outcome: a record per choice, or the row's error. `params`:
    the sampling it ran with, which a /v1/responses row's records keep for its Response to echo."""
    if output.error or not output.outputs:
        message = output.error or "the engine returned no completion"
        outcome.errors.append(RowError(request.row, request.custom_id, "engine_error", message))
        return
    metrics, echo = output.metrics, request_echo(request, params)
    outcome.records.extend({
        "custom_id": request.custom_id,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason if isinstance(completion.stop_reason, str) else None,  # a stop string
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
        "cached_tokens": output.num_cached_tokens,
        "ttft_ms": _ms(metrics.arrival_time, metrics.first_token_time) if metrics else None,
        "latency_ms": _ms(metrics.arrival_time, metrics.finish_time) if metrics else None,
        "row_index": request.row,
        "endpoint": request.endpoint,
        "logprobs": None if top_k is None else openai_logprobs(completion, request.endpoint, top_k),
        "choice_index": completion.index,
        "model": request.model,
        "request_echo": echo,
    } for completion in output.outputs)


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
