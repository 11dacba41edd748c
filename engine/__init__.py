"""tokenmill's inference engine: paged KV cache, continuous batching, prefix caching.

Offline use mirrors vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`.
Names are imported lazily so that `engine.config` and friends load without torch.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "BatchEngine": "engine.protocol",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "BeamSearchParams": "engine.beam_search",
    "BeamSearchOutput": "engine.beam_search",
    "BeamSearchSequence": "engine.beam_search",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EmbeddingRequestOutput": "engine.outputs",
    "EmbeddingOutput": "engine.outputs",
    "EmbeddingEngine": "engine.embedding_engine",
    "PoolingParams": "engine.pooling",
    "LoRARequest": "engine.lora.request",
    "KVTransferConfig": "engine.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
