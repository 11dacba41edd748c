"""`LLM`: the offline API, modelled on vLLM's, over an `LLMEngine`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search_output
from engine.chat import chat_token_ids
from engine.config import DEFAULT_MODEL, EngineConfig
from engine.embedding_engine import EmbeddingEngine, create_engine
from engine.llm_engine import Prompt
from engine.lora.request import LoRARequest
from engine.outputs import EmbeddingRequestOutput, RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

Conversation = list[dict[str, str]]


class LLM:
    """Generate completions for many prompts at once.

    >>> llm = LLM()  # the bundled smollm2-135m; any engine setting as a keyword
    >>> outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))

    An embedding model (an encoder, e.g. the bundled all-minilm-l6-v2) embeds instead:

    >>> LLM(model="all-minilm-l6-v2").embed(["a sentence"])[0].outputs.embedding  # 384 floats
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_config: Any) -> None:
        self.engine = create_engine(EngineConfig.from_kwargs(model=model, **engine_config))

    def embed(self, prompts: Prompt | Seq[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a string or token ids), in input order. An input longer than the model's
        max_seq_length raises ValueError unless `pooling_params.truncate`."""
        engine = self.engine
        if not isinstance(engine, EmbeddingEngine):
            raise ValueError(f"model {engine.config.model!r} generates text and has no embeddings; use an "
                             f"embedding model such as all-minilm-l6-v2")
        params = pooling_params or PoolingParams()
        prompts = normalize_prompts(prompts)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(engine.encode_batch(texts, truncate=params.truncate))
        token_ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
        ids = [f"embed-{id(prompts):x}-{i}" for i in range(len(prompts))]
        results: dict[str, EmbeddingRequestOutput] = {}
        try:
            for i in sorted(range(len(ids)), key=lambda i: len(token_ids[i])):  # steps of like lengths
                try:
                    engine.add_request(ids[i], token_ids[i], params)
                except ValueError as problem:
                    raise ValueError(f"prompt {i}: {problem}") from None
            progress = _progress(use_tqdm, len(prompts), "embedding")
            while engine.has_unfinished_requests():
                outputs = engine.step()
                results.update((o.request_id, o) for o in outputs)
                if progress is not None:
                    progress.update(len(outputs))
            if progress is not None:
                progress.close()
        finally:
            for request_id in ids:
                engine.abort(request_id)
        return [results[i] for i in ids]

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Seq[int] | None = None,
                 cache_salt: str | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Strings or token-id lists; one SamplingParams for all or one per prompt. Outputs in input order.
        `priority`: one int per prompt, lower first (with `scheduling_policy="priority"`); `cache_salt`:
        these prompts share prefix-cache blocks only with requests of the same salt. `lora_request`: the LoRA
        adapter for all prompts, or one per prompt (None: the base model); needs `LLM(enable_lora=True)`."""
        if isinstance(self.engine, EmbeddingEngine):
            raise ValueError(f"model {self.engine.config.model!r} is an embedding model: use LLM.embed")
        prompts = normalize_prompts(prompts)
        params = per_prompt_params(sampling_params, len(prompts))
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        loras = per_prompt_loras(lora_request, len(prompts))
        return self._run(prompts, params, use_tqdm, priority, cache_salt, loras)

    def beam_search(self, prompts: Prompt | Seq[Prompt | dict], params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """Beam search, as vLLM's: one `BeamSearchOutput` per prompt, in input order, its `sequences` the
        `params.beam_width` best beams, best first. Prompts are strings, token-id lists or vLLM's
        {"prompt": ...} / {"prompt_token_ids": [...]} dicts. The beams of a prompt share KV blocks copy-on-write
        and run in the same continuous batch as everything else (engine/beam_search.py)."""
        if isinstance(self.engine, EmbeddingEngine):
            raise ValueError(f"model {self.engine.config.model!r} is an embedding model: use LLM.embed")
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, dict) or isinstance(prompts, list) and prompts and isinstance(prompts[0], dict):
            prompts = [p.get("prompt_token_ids", p.get("prompt")) for p in ([prompts] if isinstance(prompts, dict)
                                                                          else prompts)]
        prompts = normalize_prompts(prompts)
        outputs = self._run(prompts, [params] * len(prompts), use_tqdm,
                            loras=per_prompt_loras(lora_request, len(prompts)))
        return [beam_search_output(output) for output in outputs]

    def chat(self, conversations: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(self, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
        return chat_token_ids(self.engine.tokenizer, conversation, add_generation_prompt)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams] | list[BeamSearchParams], use_tqdm: bool,
             priority: list[int] | None = None, cache_salt: str | None = None,
             loras: list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        engine = self.engine
        first_id = f"gen-{id(prompts):x}-"
        ids = [f"{first_id}{i}" for i in range(len(prompts))]
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(prompts), desc="generating", unit="req")
        try:
            priority = priority or [0] * len(prompts)
            loras = loras or [None] * len(prompts)
            requests = list(zip(ids, prompts, params, priority, [cache_salt] * len(prompts), loras, strict=True))
            if engine.config.scheduling_policy == "priority":  # the engine holds only some at a time: feed by priority
                requests.sort(key=lambda request: request[3])
            for output in engine.stream(requests):
                results[output.request_id] = output
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()
            for request_id in ids:
                if request_id not in results:
                    engine.abort(request_id)
        return [results[i] for i in ids]


def _progress(use_tqdm: bool, total: int, what: str):
    if not use_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=what, unit="req")


def normalize_prompts(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one token-id prompt
    for prompt in prompts:
        if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return prompts


def per_prompt_loras(lora_request: LoRARequest | Seq[LoRARequest | None] | None,
                     count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras


def per_prompt_params(params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
