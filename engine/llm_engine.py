"""`LLMEngine`: requests in, finished `RequestOutput`s out, one `step()` at a time."""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.block_pool import KVCacheManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, find_stop
from engine.distributed.group import RankFailure
from engine.metrics import EngineStats
from engine.model_loader import resolve_model
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, SampleLogprobs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import FinishReason, Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.decoder import SpecDecoder, draft_key
from engine.spec_decode.draft import DraftSetup
from engine.step_types import ModelRunnerOutput, SchedulerOutput
from engine.structured_outputs import StructuredOutputs

log = logging.getLogger("tokenmill.engine")

Prompt = str | list[int]
MAX_SPEC_DECODERS = 4  # speculative settings kept ready (jobs switch between them)
MAX_DRAFT_PROPOSERS = 2  # distinct draft models (or self-draft depths) kept, each with its own KV pool


@dataclass
class _Request:
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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        self.model_dir = resolve_model(config.model)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context ({model_len})")
        self.max_model_len = config.max_model_len or model_len
        eos = eos_token_ids(self.model_dir, self.tokenizer)
        self.structured = StructuredOutputs(self.tokenizer, hf_config.vocab_size, eos)
        self.sampler = Sampler(config.seed, frozenset(eos), self.structured)
        self.ranks = None  # the other tensor-parallel ranks' processes (engine/distributed/)
        if config.tensor_parallel_size > 1:
            from engine.distributed.ranks import Ranks
            from engine.distributed.sharding import check_divisible

            check_divisible(hf_config, config.tensor_parallel_size)
            self.ranks = Ranks.start(config, self.model_dir, self.max_model_len)
            weakref.finalize(self, self.ranks.stop)
        try:
            self.runner = ModelRunner(config, self.model_dir, hf_config, self.max_model_len, self.sampler,
                                      self.ranks.group if self.ranks else None)
        except BaseException:
            self.shutdown()
            raise
        kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                            watermark_blocks=max(1, self.runner.num_blocks // 100))
        limits = SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                 config.enable_chunked_prefill, config.admission_lookahead,
                                 config.scheduling_policy, config.long_prefill_token_threshold)
        self._seq_ids = itertools.count()
        self.scheduler = Scheduler(limits, kv, frozenset(eos),
                                   next_seq_id=self._seq_ids.__next__)
        self.requests: dict[str, _Request] = {}
        self.stats = EngineStats()
        self.step_observers: list[Callable[[list[RequestOutput]], None]] = []
        self.spec: SpecDecoder | None = None
        self._spec_decoders: OrderedDict[str, SpecDecoder] = OrderedDict()  # least recently used first
        self._spec_key: str | None = None
        self._request_ids = itertools.count()
        self._rejected: list[_Request] = []
        self.set_speculative_config(None)

    def _speculation_key(self, settings: dict[str, Any] | None) -> str | None:
        settings = settings if settings is not None else self.config.speculative_config
        return json.dumps(settings, sort_keys=True) if settings else None

    def speculation_matches(self, settings: dict[str, Any] | None) -> bool:
        """Is `settings` (None: the engine's own) the speculative setting the engine runs now? Requests of
        another setting wait until the engine is idle, since `set_speculative_config` switches only then."""
        return self._speculation_key(settings) == self._spec_key

    def set_speculative_config(self, settings: dict[str, Any] | None) -> None:
        """Speculative decoding for the requests that follow (a job's own setting); None restores the
        engine's `speculative_config`. Decoders are kept, so switching back reloads no draft model."""
        key = self._speculation_key(settings)
        settings = settings if settings is not None else self.config.speculative_config
        if key == self._spec_key:
            return
        if self.has_unfinished_requests():
            raise RuntimeError("speculative decoding can only be switched while no request is running")
        if key is not None and key not in self._spec_decoders:
            self._spec_decoders[key] = self._new_decoder(SpeculativeConfig.from_dict(settings))
        if key is not None:
            self._spec_decoders.move_to_end(key)
        self.spec = self._spec_decoders.get(key) if key else None
        self._spec_key = key

    def set_batch_invariant(self, on: bool | None) -> None:
        """Batch-invariant mode for the requests that follow (a job's own setting; None: the engine's
        `batch_invariant`). Only while idle; the prefix cache is dropped, its blocks were computed the other way."""
        on = self.config.batch_invariant if on is None else on
        if on == self.runner.batch_invariant:
            return
        if self.has_unfinished_requests():
            raise RuntimeError("batch-invariant mode can only be switched while no request is running")
        self.runner.set_batch_invariant(on)
        self.kv_manager.pool.reset_prefix_cache()

    def batch_invariance_matches(self, on: bool | None) -> bool:
        return (self.config.batch_invariant if on is None else on) == self.runner.batch_invariant

    def _new_decoder(self, config: SpeculativeConfig) -> SpecDecoder:
        """A decoder that reuses the draft proposer (model and KV pool) of a kept decoder with the same draft.
        At most MAX_SPEC_DECODERS decoders and MAX_DRAFT_PROPOSERS distinct drafts are kept: the least
        recently used go first (the engine's own, from its config, is never dropped)."""
        if config.method == "self" and self.ranks is not None:
            raise ValueError("self-speculation runs the target's own sharded layers, which tensor parallelism "
                             "does not support: use method ngram or draft (a draft model runs whole on rank 0)")
        wanted = draft_key(config)
        decoders = self._spec_decoders
        shared = next((d.draft for d in decoders.values() if wanted is not None and draft_key(d.config) == wanted),
                      None)
        own = self.config.speculative_config
        own_key = json.dumps(own, sort_keys=True) if own else None

        def victims(with_draft: bool) -> list[str]:
            return [k for k, d in decoders.items() if k != own_key and (d.draft is not None or not with_draft)]

        while len(decoders) >= MAX_SPEC_DECODERS and (oldest := victims(False)):
            del decoders[oldest[0]]
        while (shared is None and wanted is not None and (oldest := victims(True))
               and len({draft_key(d.config) for d in decoders.values() if d.draft is not None}) >= MAX_DRAFT_PROPOSERS):
            dropped = draft_key(decoders[oldest[0]].config)
            for key in [k for k in oldest if draft_key(decoders[k].config) == dropped]:
                del decoders[key]
        runner = self.runner
        setup = DraftSetup(runner.model, runner.num_blocks, runner.block_size, runner.max_model_len, runner.dtype,
                           runner.device, runner.kv_plan.draft_bytes_per_block, runner.make_backend, runner.tensor,
                           self.sampler)
        return SpecDecoder(config, setup, draft=shared)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (they also stop when this process ends)."""
        if self.ranks is not None:
            self.ranks.stop()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.scheduler.kv

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if not all(isinstance(t, int) and 0 <= t < self.runner.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.runner.vocab_size})")
        return list(prompt)

    def add_request(self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Queue a request. One that can never run comes back from the next `step()` with an error.
        `priority` orders admission under `scheduling_policy="priority"` (lower first); requests share
        prefix-cache blocks only with requests of the same `cache_salt` (None: the shared, unsalted cache)."""
        params = params or SamplingParams()
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # an invalid schema fails here, as a ValueError
        seq = Sequence(next(self._seq_ids), request_id, self.encode(prompt), params, priority=priority,
                       cache_salt=cache_salt)
        request = _Request(request_id, prompt if isinstance(prompt, str) else None, [])
        request.add_sample(seq, self.tokenizer)
        self.requests[request_id] = request
        if not self.scheduler.add(seq):
            self._rejected.append(request)
        return request_id

    def _drop(self, request_id: str) -> _Request | None:
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.sampler.release(s.seq_id for s in request.seqs)
        return request

    def abort(self, request_id: str) -> bool:
        """Stop a request now; it is dropped without an output. False when it is unknown or done."""
        request = self._drop(request_id)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns the requests that finished in this step.
        Each of `step_observers` is then called with those outputs (metrics exporters use this)."""
        outputs = self._step()
        for observer in self.step_observers:
            observer(outputs)
        return outputs

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        done = [self._finalize(r) for r in self._rejected]
        self._rejected = []
        plan = self.scheduler.schedule(self.spec.lookahead(self.scheduler.running) if self.spec else 0)
        done += self._failed(plan)
        if plan.is_empty:  # everything was preempted or failed: the next step admits again
            return done
        self._add_forks(plan)
        num_decode_tokens = sum(1 for s in plan.scheduled
                                if s.num_new_tokens == 1 and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens)
        if self.spec:
            plan.spec_token_ids, plan.spec_draft_probs = self.spec.propose(plan)
        ran = time.perf_counter()
        try:
            output = self.runner.execute(plan)
        except RankFailure:  # a tensor-parallel rank is gone: the engine is down, the other ranks stop too
            self.shutdown()
            raise
        if self.spec:
            self._record_spec(*self.spec.observe(plan, output, time.perf_counter() - ran))
        finished = self.scheduler.update(plan, output, self._stop_strings(plan, output))
        self._keep_logprobs(plan, output)
        self._record(plan, plan.num_batched_tokens - num_decode_tokens, output.num_tokens, started)
        for seq in finished:
            request = self.requests.get(seq.request_id)
            if request is not None and request.finished:
                done.append(self._finalize(request))
        return done

    def _failed(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """The outputs of requests that a sequence failing to be scheduled has finished."""
        done = []
        for seq in plan.failed:
            request = self.requests.get(seq.request_id)
            if request is not None and (request.finished or seq.fork_pending):
                done.append(self._finalize(request))
        return done

    def _add_forks(self, plan: SchedulerOutput) -> None:
        for children in plan.forks.values():
            request = self.requests.get(children[0].request_id)
            for child in children if request is not None else []:
                request.add_sample(child, self.tokenizer)

    def _stop_strings(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> dict[int, str]:
        """{seq_id: stop string} for the sequences whose new tokens' text reaches one of their stop strings."""
        stopped = {}
        for seq in plan.sampled_seqs():
            request = self.requests.get(seq.request_id)
            detok = request.detokenizers.get(seq.seq_id) if request is not None else None
            if detok is None:
                continue
            kept, _ = self.scheduler.kept_tokens(seq, output.tokens_of(seq.seq_id))
            new_text = detok.update(seq.token_ids + kept)
            hit = find_stop(detok.text, len(new_text), seq.params.stop) if new_text else None
            if hit is not None:
                detok.stop_at(hit[0])
                stopped[seq.seq_id] = hit[1]
        return stopped

    def _keep_logprobs(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> None:
        if not output.logprobs:
            return
        for seq in plan.sampled_seqs():
            request = self.requests.get(seq.request_id)
            if request is not None and seq.seq_id in output.logprobs:
                request.logprobs.setdefault(seq.seq_id, []).extend(output.logprobs[seq.seq_id])

    def _record(self, plan, num_prefill_tokens: int, num_sampled: int, started: float) -> None:
        stats = self.stats
        stats.computed_prefill_tokens += num_prefill_tokens
        stats.prompt_tokens += sum(s.seq.num_prompt_tokens for s in plan.scheduled
                                   if s.sample and s.seq.num_output_tokens == 1)
        stats.generation_tokens += num_sampled
        elapsed = time.perf_counter() - started
        stats.num_steps += 1
        stats.step_time_total += elapsed
        stats.step_times.append(elapsed)

    def _record_spec(self, drafted: int, accepted: int, by_position: list[int]) -> None:
        stats = self.stats
        stats.spec_draft_tokens += drafted
        stats.spec_accepted_tokens += accepted
        if len(stats.spec_accepted_by_position) < len(by_position):
            stats.spec_accepted_by_position += [0] * (len(by_position) - len(stats.spec_accepted_by_position))
        for position, count in enumerate(by_position):
            stats.spec_accepted_by_position[position] += count

    def get_stats(self) -> EngineStats:
        stats, kv = self.stats, self.scheduler.kv
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = len(self.scheduler.waiting)
        stats.kv_cache_usage = kv.pool.usage
        stats.num_preemptions = self.scheduler.num_preemptions
        stats.prefix_cache_queries = kv.stats.queries
        stats.prefix_cache_hits = kv.stats.hits
        return stats

    def _finalize(self, request: _Request) -> RequestOutput:
        self._drop(request.request_id)
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

    def stream(self, requests: Iterable[tuple], max_pending: int | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[RequestOutput]:
        """Feed requests as they come (lazily, keeping at most `max_pending` in the engine) and yield
        each finished output as soon as it is ready. Each request is `add_request`'s arguments:
        (request_id, prompt, params), optionally followed by priority and cache_salt. `should_stop` is asked
        before each step; when it says so, or the caller stops iterating, the requests this stream added
        that have not finished are aborted."""
        max_pending = max_pending or 2 * self.config.max_num_seqs
        source = iter(requests)
        exhausted = False
        added: set[str] = set()
        try:
            while True:
                while not exhausted and self.num_unfinished_requests < max_pending:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                    else:
                        added.add(self.add_request(*item))
                if not self.has_unfinished_requests() or (should_stop is not None and should_stop()):
                    return
                for output in self.step():
                    added.discard(output.request_id)
                    yield output
        finally:
            for request_id in added:
                self.abort(request_id)


def eos_token_ids(model_dir, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (what `generate` stops on) and the tokenizer."""
    ids: set[int] = set()
    path = model_dir / "generation_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
