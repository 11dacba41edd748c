"""`BatchEngine`: what the job path's engine loop (workers/engine_loop.py) needs of an engine. `LLMEngine`
generates text (its `step` gives `RequestOutput`s); `EmbeddingEngine` embeds (`EmbeddingRequestOutput`s)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from engine.outputs import EmbeddingRequestOutput, RequestOutput
    from engine.spec_decode.decoder import SpecDecoder


@runtime_checkable
class BatchEngine(Protocol):
    """Requests in by id, finished outputs out, one `step` at a time. A job's speculative and batch-invariant
    settings (None: the engine's own) switch only while no request runs: `*_matches` tells whether they need to."""

    @property
    def embedding_size(self) -> int | None:
        """The size of its vectors; None: the engine generates text."""

    @property
    def spec(self) -> SpecDecoder | None:
        """The speculative decoder of the requests now running (its counters); None: none."""

    def add_request(self, request_id: str, prompt: str | list[int], params: Any = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: Any = None) -> str:
        """`lora_request`: an `engine.LoRARequest`, or the adapter a text engine's `load_adapter` loaded (text engines
        with enable_lora); ValueError when the adapter cannot be served."""

    def abort(self, request_id: str) -> bool: ...

    def step(self) -> list[RequestOutput] | list[EmbeddingRequestOutput]: ...

    def speculation_matches(self, settings: dict[str, Any] | None) -> bool: ...

    def set_speculative_config(self, settings: dict[str, Any] | None) -> None: ...

    def batch_invariance_matches(self, on: bool | None) -> bool: ...

    def set_batch_invariant(self, on: bool | None) -> None: ...
