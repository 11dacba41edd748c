"""`LLMEngine`: requests in, finished `RequestOutput`s out, one `step()` at a time."""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from engine.beam_search import BeamCoordinator, BeamSearchParams, beam_rejection
from engine.block_pool import KVCacheManager
from engine.config import EngineConfig
from engine.distributed.group import RankFailure
from engine.hf_files import eos_token_ids, load_config, load_tokenizer
from engine.kv_connector.factory import create_kv_connector
from engine.lora.adapter import LoRAAdapter
from engine.lora.manager import adapter_for
from engine.lora.request import LoRARequest
from engine.memory_plan import plan_kv_cache
from engine.metrics import EngineStats
from engine.model_loader import resolve_model
from engine.model_runner import ModelRunner
from engine.models import check_supported
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import FinishReason, Sequence
from engine.spec_decode.decoder import SpecDecoder
from engine.spec_decode.decoders import SpecDecoderCache
from engine.spec_decode.draft import DraftSetup
from engine.spec_decode.verifier import verify_drafts
from engine.step_hooks import StepHook
from engine.step_types import StepEdits
from engine.structured_outputs import StructuredOutputs
from engine.swap import SwapSpace

log = logging.getLogger("tokenmill.engine")

Prompt = str | list[int]


class LLMEngine:
    """Generates text; a `BatchEngine` (engine/protocol.py) for the job path."""

    embedding_size: int | None = None  # it generates text

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model)
        hf_config = load_config(self.model_dir)
        check_supported(hf_config, config)  # ValueError now, naming what is supported, before anything loads
        self.tokenizer = load_tokenizer(self.model_dir)
        model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context ({model_len})")
        self.max_model_len = config.max_model_len or model_len
        eos = frozenset(eos_token_ids(self.model_dir, self.tokenizer))
        self.structured = StructuredOutputs(self.tokenizer, hf_config.vocab_size, eos)
        self.sampler = Sampler(config.seed, eos, self.structured, verify_drafts)
        self.ranks, runner_class = None, ModelRunner  # ranks: the other processes of a multi-process engine
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
            from engine.distributed.ranks import start_ranks

            self.ranks, runner_class = start_ranks(config, hf_config, self.model_dir, self.max_model_len)
            weakref.finalize(self, self.ranks.stop)
        try:
            runner = self.runner = runner_class(config, self.model_dir, hf_config, self.max_model_len, self.sampler,
                                                self.ranks.group if self.ranks else None)
            runner.initialize_kv_cache(plan_kv_cache(config, runner.shape, runner.probe))
        except BaseException:
            self.shutdown()
            raise
        kv = KVCacheManager(runner.num_blocks, config.block_size, config.enable_prefix_caching,
                            watermark_blocks=max(1, runner.num_blocks // 100))
        limits = SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                                 config.enable_chunked_prefill, config.admission_lookahead,
                                 config.scheduling_policy, config.long_prefill_token_threshold,
                                 config.max_loras if config.enable_lora else 0, config.preemption_mode)
        self._seq_ids = itertools.count()
        self.kv_connector = create_kv_connector(config.kv_transfer_config, self.model_dir, runner.shape,
                                                runner.transfer, runner.kv_plan.kv_scales, kv)
        self.scheduler = Scheduler(limits, kv, eos, next_seq_id=self._seq_ids.__next__,
                                   swap=SwapSpace(runner.transfer.num_host_blocks), connector=self.kv_connector)
        self.stats = EngineStats()
        self.output = OutputProcessor(self.tokenizer, self.sampler, self.stats)
        self.step_observers: list[Callable[[list[RequestOutput]], None]] = []
        self.beams = BeamCoordinator(eos, self._seq_ids.__next__, self.scheduler, self.output, self.tokenizer)
        self.spec_decoders = SpecDecoderCache(config.speculative_config, DraftSetup(
            runner.model, runner.shape, runner.kv_plan, runner.make_backend, runner.tensor, self.sampler),
            self.ranks is not None, self.stats)
        # the features in the step (engine/step_hooks.py), called in this order at each hook point
        self.hooks: list[StepHook] = [h for h in (self.kv_connector, self.spec_decoders, self.beams) if h is not None]
        self._request_ids = itertools.count()
        self.set_speculative_config(None)

    @property
    def spec(self) -> SpecDecoder | None:
        """The speculative decoder of the requests now running; None: no speculation."""
        return self.spec_decoders.current

    def speculation_matches(self, settings: dict[str, Any] | None) -> bool:
        """Is `settings` (None: the engine's own) the speculative setting the engine runs now? Requests of
        another setting wait until the engine is idle, since `set_speculative_config` switches only then."""
        return self.spec_decoders.matches(settings)

    def set_speculative_config(self, settings: dict[str, Any] | None) -> None:
        """Speculative decoding for the requests that follow (a job's own setting); None restores the
        engine's `speculative_config`. Decoders are kept, so switching back reloads no draft model."""
        if self.spec_decoders.matches(settings):
            return
        if self.has_unfinished_requests():
            raise RuntimeError("speculative decoding can only be switched while no request is running")
        self.spec_decoders.select(settings)

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

    def load_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The LoRA adapter read into host memory (kept in the engine's adapter cache), for `add_request` to take as
        it is: any thread may load it, so that the thread stepping the engine reads no adapter from disk.
        ValueError when the engine cannot serve it, saying why."""
        return adapter_for(self.runner.lora, lora_request)  # given a request, never None

    def add_request(self, request_id: str | None, prompt: Prompt,
                    params: SamplingParams | BeamSearchParams | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: LoRARequest | LoRAAdapter | None = None) -> str:
        """Queue a request. One that can never run comes back from the next `step()` with an error.
        With `BeamSearchParams` it is a beam search (engine/beam_search.py): its output holds the beams, best first.
        `priority` orders admission under `scheduling_policy="priority"` (lower first); requests share
        prefix-cache blocks only with requests of the same `cache_salt` (None: the shared, unsalted cache).
        `lora_request`: the LoRA adapter it runs with (needs `enable_lora`), or the adapter `load_adapter` loaded;
        ValueError when the adapter cannot be served, saying why."""
        params = params or SamplingParams()
        beam = params if isinstance(params, BeamSearchParams) else None
        if beam is not None:
            params = beam.sampling_params(len(self.beams.eos_token_ids))
        request_id = str(next(self._request_ids)) if request_id is None else request_id
        if request_id in self.output.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)  # an invalid schema fails here, as a ValueError
        adapter = adapter_for(self.runner.lora, lora_request)
        seq = Sequence(next(self._seq_ids), request_id, self.encode(prompt), params, priority=priority,
                       cache_salt=cache_salt, lora=adapter)
        too_big = beam and beam_rejection(seq.num_prompt_tokens, beam, self.kv_manager)
        if too_big:
            seq.finish(FinishReason.ERROR, too_big)
        accepted = not too_big and self.scheduler.add(seq)  # False: it can never run, and fails at the next step
        self.output.add_request(request_id, prompt if isinstance(prompt, str) else None, seq, accepted)
        if beam is not None and accepted:
            self.beams.add(request_id, seq, beam)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now; it is dropped without an output. False when it is unknown or done."""
        request = self.output.drop(request_id)
        self.beams.drop(request_id)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.output.requests)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns the requests that finished in this step.
        Each of `step_observers` is then called with those outputs (metrics exporters use this)."""
        outputs = self._step()
        for observer in self.step_observers:
            observer(outputs)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """vLLM v1's step: schedule, execute, the scheduler's update; the hooks around them (`self.hooks`)."""
        started = time.perf_counter()
        plan = self.scheduler.schedule(self.spec_decoders.lookahead(self.scheduler.running))
        done = self.output.finish_rejected() + self.output.finish_failed(plan.failed)
        for hook in self.hooks:
            hook.scheduled(plan)
        if plan.is_empty:  # everything was preempted or failed: the next step admits again
            return done
        self.output.add_forks(plan)
        num_prefill_tokens = plan.num_prefill_tokens
        for hook in self.hooks:
            hook.before_execute(plan)
        ran = time.perf_counter()
        try:
            output = self.runner.execute(plan)
        except RankFailure:  # a tensor-parallel rank or stage is gone: the engine is down, the other ranks stop too
            self.shutdown()
            raise
        edits = StepEdits.merge([hook.after_execute(plan, output, ran) for hook in self.hooks])
        output = output.edited(edits)  # beams' picks in place of what was sampled for them
        stops = self.output.stop_strings(plan, output, self.scheduler.kept_tokens)  # {seq_id: stop string}
        finished = self.scheduler.update_from_output(plan, output, stops, edits.forks)
        self.output.keep_logprobs(plan, output)
        self.stats.record_step(plan, num_prefill_tokens, output.num_tokens, started)
        for hook in self.hooks:
            done += hook.after_update(plan)
        return done + self.output.finish(finished)

    def get_stats(self) -> EngineStats:
        self.scheduler.read_gauges(self.stats)
        return self.stats

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

