"""tokenmill's inference engine: paged KV cache, continuous batching, prefix caching.

Offline use mirrors vLLM: `LLM(model=...).generate(prompts, SamplingParams(...))`.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
