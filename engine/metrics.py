"""Engine counters and gauges, in vLLM's meanings. Plain numbers; exporters read `EngineStats`."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.step_types import SchedulerOutput


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1 share of blocks held by running sequences
    num_swapped: int = 0  # requests preempted with their KV in host blocks (engine/swap.py)
    num_preemptions: int = 0  # recomputed and swapped preemptions
    kv_blocks_swapped_out: int = 0  # KV blocks copied to host memory by swap preemption
    kv_blocks_swapped_in: int = 0  # and back
    prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    generation_tokens: int = 0
    computed_prefill_tokens: int = 0  # prompt/recompute tokens actually run through the model
    kv_connector_blocks_loaded: int = 0  # KV blocks written into the pool by the KV connector (engine/kv_connector/)
    kv_connector_blocks_saved: int = 0  # blocks it put in its store
    kv_connector_blocks_rejected: int = 0  # stored blocks that failed their seal (HMAC) or size (computed instead)
    kv_connector_store_errors: int = 0  # its store's get/put calls that raised
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    spec_draft_tokens: int = 0  # speculative drafts verified, whatever decoder was active
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: list[int] = field(default_factory=list)
    num_steps: int = 0
    step_time_total: float = 0.0  # seconds spent in step()
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=4096), repr=False)  # recent steps
    num_requests_finished: int = 0
    num_requests_failed: int = 0

    def record_step(self, plan: SchedulerOutput, num_prefill_tokens: int, num_sampled: int, started: float) -> None:
        """A step that ran `plan` (updated already), begun at `started` (time.perf_counter)."""
        self.computed_prefill_tokens += num_prefill_tokens
        self.prompt_tokens += sum(s.seq.num_prompt_tokens for s in plan.scheduled
                                  if s.sample and s.seq.num_output_tokens == 1)
        self.generation_tokens += num_sampled
        elapsed = time.perf_counter() - started
        self.num_steps += 1
        self.step_time_total += elapsed
        self.step_times.append(elapsed)

    def record_spec(self, drafted: int, accepted: int, by_position: list[int]) -> None:
        """A step's speculative drafts: verified, accepted, and accepted at each draft position."""
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        if len(self.spec_accepted_by_position) < len(by_position):
            self.spec_accepted_by_position += [0] * (len(by_position) - len(self.spec_accepted_by_position))
        for position, count in enumerate(by_position):
            self.spec_accepted_by_position[position] += count

    def snapshot(self) -> dict:
        data = asdict(self)
        data.pop("step_times")
        return data
