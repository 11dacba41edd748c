"""The engine's output side (as vLLM v1's output processor): each request's state while it runs, the text its
stop strings are looked for in, its logprobs, and its `RequestOutput` once it finished."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer, find_stop
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SampleLogprobs

if TYPE_CHECKING:
    from engine.metrics import EngineStats
    from engine.sampler import Sampler
    from engine.sequence import FinishReason, Sequence
    from engine.step_types import ModelRunnerOutput, SchedulerOutput

KeptTokens = Callable[["Sequence", list[int]], tuple[list[int], "FinishReason | None"]]  # Scheduler.kept_tokens


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)  # only with stop strings
    logprobs: dict[int, SampleLogprobs] = field(default_factory=dict)  # seq_id -> per output token, if asked

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs) and len(self.seqs) == self.seqs[0].params.n

    def add_sample(self, seq: Sequence, tokenizer) -> None:
        self.seqs.append(seq)
        if seq.params.stop:
            self.detokenizers[seq.seq_id] = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)


class OutputProcessor:
    """The requests in the engine by id. Dropping one (finished or aborted) frees its sampler state; a finished
    one counts in `stats` as finished or failed."""

    def __init__(self, tokenizer, sampler: Sampler, stats: EngineStats) -> None:
        self.tokenizer, self.sampler, self.stats = tokenizer, sampler, stats
        self.requests: dict[str, RequestState] = {}
        self.rejected: list[RequestState] = []  # refused by the scheduler: they fail at the next step

    def add_request(self, request_id: str, prompt: str | None, seq: Sequence, accepted: bool) -> None:
        request = RequestState(request_id, prompt, [])
        request.add_sample(seq, self.tokenizer)
        self.requests[request_id] = request
        if not accepted:
            self.rejected.append(request)

    def add_forks(self, plan: SchedulerOutput) -> None:
        for children in plan.forks.values():
            request = self.requests.get(children[0].request_id)
            for child in children if request is not None else []:
                request.add_sample(child, self.tokenizer)

    def drop(self, request_id: str) -> RequestState | None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.sampler.release(s.seq_id for s in request.seqs)
        return request

    def stop_strings(self, plan: SchedulerOutput, output: ModelRunnerOutput, kept_tokens: KeptTokens
                     ) -> dict[int, str]:
        """{seq_id: stop string} for the sequences whose new tokens' text reaches one of their stop strings."""
        stopped = {}
        for seq in plan.sampled_seqs():
            request = self.requests.get(seq.request_id)
            detok = request.detokenizers.get(seq.seq_id) if request is not None else None
            if detok is None:
                continue
            kept, _ = kept_tokens(seq, output.tokens_of(seq.seq_id))
            new_text = detok.update(seq.token_ids + kept)
            hit = find_stop(detok.text, len(new_text), seq.params.stop) if new_text else None
            if hit is not None:
                detok.stop_at(hit[0])
                stopped[seq.seq_id] = hit[1]
        return stopped

    def keep_logprobs(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> None:
        if not output.logprobs:
            return
        for seq in plan.sampled_seqs():
            request = self.requests.get(seq.request_id)
            if request is not None and seq.seq_id in output.logprobs:
                request.logprobs.setdefault(seq.seq_id, []).extend(output.logprobs[seq.seq_id])

    def finish_rejected(self) -> list[RequestOutput]:
        done = [self._finish(r) for r in self.rejected]
        self.rejected = []
        return done

    def finish_failed(self, failed: Iterable[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests that sequences failing to be scheduled finished (one failing before its
        forks were made finishes its request)."""
        return [self._finish(request) for seq in failed
                if (request := self.requests.get(seq.request_id)) is not None
                and (request.finished or seq.fork_pending)]

    def finish(self, finished: Iterable[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose last sequence is among `finished`."""
        return [self._finish(request) for seq in finished
                if (request := self.requests.get(seq.request_id)) is not None and request.finished]

    def _finish(self, request: RequestState) -> RequestOutput:
        self.drop(request.request_id)
        outputs = []
        error = None
        for seq in sorted(request.seqs, key=lambda s: s.sample_index):
            detok = request.detokenizers.get(seq.seq_id)
            if detok is not None:
                detok.update(seq.token_ids)
                text = detok.text
            else:
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            reason = seq.finish_reason.value if seq.finish_reason else None
            completion = CompletionOutput(seq.sample_index, text, seq.output_token_ids, reason, seq.stop_reason)
            if seq.params.logprobs is not None:
                self._attach_logprobs(completion, request.logprobs.get(seq.seq_id, []))
            outputs.append(completion)
            error = error or seq.error
        if error:
            self.stats.num_requests_failed += 1
        else:
            self.stats.num_requests_finished += 1
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=True,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            error=error,
            metrics=RequestMetrics(first.arrival_time, first.first_token_time, first.finish_time,
                                   first.num_preemptions),
        )

    def _attach_logprobs(self, completion: CompletionOutput, logprobs: SampleLogprobs) -> None:
        logprobs = logprobs[:len(completion.token_ids)]  # tokens dropped past a stop or max_tokens
        for entry in logprobs:
            for token, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([token])
        completion.logprobs = logprobs
        completion.cumulative_logprob = sum(entry[token].logprob
                                            for entry, token in zip(logprobs, completion.token_ids, strict=True))
