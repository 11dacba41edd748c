"""The speculative decoders an engine keeps ready, one per setting, so that jobs switching settings reload no draft."""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.decoder import SpecDecoder, draft_key
from engine.spec_decode.draft import DraftSetup
from engine.step_hooks import StepHook

if TYPE_CHECKING:
    from engine.metrics import EngineStats
    from engine.sequence import Sequence
    from engine.step_types import ModelRunnerOutput, SchedulerOutput

MAX_SPEC_DECODERS = 4  # speculative settings kept ready (jobs switch between them)
MAX_DRAFT_PROPOSERS = 2  # distinct draft models (or self-draft depths) kept, each with its own KV pool


def settings_key(settings: dict[str, Any] | None) -> str | None:
    """A speculative setting's key: its JSON (None: no speculation)."""
    return json.dumps(settings, sort_keys=True) if settings else None


class SpecDecoderCache(StepHook):
    """Decoders keyed by the JSON of their settings, least recently used first. Decoders of the same draft share
    its proposer (model and KV pool). At most MAX_SPEC_DECODERS decoders and MAX_DRAFT_PROPOSERS distinct drafts
    are kept: the least recently used go first (the engine's own, `default`, is never dropped). A hook of the engine
    step (engine/step_hooks.py): the current decoder proposes drafts before the runner and observes after it."""

    def __init__(self, default: dict[str, Any] | None, setup: DraftSetup, tensor_parallel: bool,
                 stats: EngineStats) -> None:
        """`setup`: what a draft proposer takes from the target's side; `stats`: the engine's, counting drafts."""
        self.default = default
        self.setup, self.tensor_parallel, self.stats = setup, tensor_parallel, stats
        self.decoders: OrderedDict[str, SpecDecoder] = OrderedDict()
        self.current: SpecDecoder | None = None
        self.key: str | None = None  # the setting of `current`

    def key_of(self, settings: dict[str, Any] | None) -> str | None:
        return settings_key(settings if settings is not None else self.default)

    def matches(self, settings: dict[str, Any] | None) -> bool:
        """Is `settings` (None: the default) the setting of the current decoder?"""
        return self.key_of(settings) == self.key

    def select(self, settings: dict[str, Any] | None) -> SpecDecoder | None:
        """Make the decoder of `settings` (None: the default) current, built unless kept; None: no speculation."""
        key = self.key_of(settings)
        if key is not None and key not in self.decoders:
            self.decoders[key] = self._new_decoder(SpeculativeConfig.from_dict(
                settings if settings is not None else self.default))
        if key is not None:
            self.decoders.move_to_end(key)
        self.current = self.decoders.get(key) if key else None
        self.key = key
        return self.current

    def lookahead(self, running: list[Sequence]) -> int:
        """Draft tokens the scheduler makes room for this step (0: no speculation)."""
        return self.current.lookahead(running) if self.current else 0

    def before_execute(self, plan: SchedulerOutput) -> None:
        if self.current:
            plan.spec_token_ids, plan.spec_draft_probs = self.current.propose(plan)

    def after_execute(self, plan: SchedulerOutput, output: ModelRunnerOutput, started: float) -> None:
        if self.current:
            self.stats.record_spec(*self.current.observe(plan, output, time.perf_counter() - started))

    def _new_decoder(self, config: SpeculativeConfig) -> SpecDecoder:
        if config.method == "medusa" and self.tensor_parallel:
            raise ValueError("Medusa heads read the target's hidden states, which tensor parallelism keeps on its "
                             "ranks: use method ngram or draft")
        if config.method == "self" and self.tensor_parallel:
            raise ValueError("self-speculation runs the target's own sharded layers, which tensor parallelism "
                             "does not support: use method ngram or draft (a draft model runs whole on rank 0)")
        wanted = draft_key(config)
        decoders = self.decoders
        shared = next((d.draft for d in decoders.values() if wanted is not None and draft_key(d.config) == wanted),
                      None)
        default_key = settings_key(self.default)

        def victims(with_draft: bool) -> list[str]:
            return [k for k, d in decoders.items() if k != default_key and (d.draft is not None or not with_draft)]

        while len(decoders) >= MAX_SPEC_DECODERS and (oldest := victims(False)):
            del decoders[oldest[0]]
        while (shared is None and wanted is not None and (oldest := victims(True))
               and len({draft_key(d.config) for d in decoders.values() if d.draft is not None}) >= MAX_DRAFT_PROPOSERS):
            dropped = draft_key(decoders[oldest[0]].config)
            for key in [k for k in oldest if draft_key(decoders[k].config) == dropped]:
                del decoders[key]
        return SpecDecoder(config, self.setup, draft=shared)
