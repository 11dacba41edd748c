"""`EmbeddingEngine`: an encoder model's requests in, one vector each out. No KV cache and no decode: a step
takes waiting requests up to the token budget (`max_num_batched_tokens`), orders them by length and runs them as
one packed batch (see `engine.models.bert`). Like `LLMEngine`, it is a `BatchEngine` (engine/protocol.py), the
surface the job loop needs (`add_request`, `step`, `abort`, speculation and batch invariance as "none")."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import malloc_tuning
from engine.config import EngineConfig
from engine.kernels import cpu_kernel
from engine.model_loader import materialize, pick_device, pick_dtype, resolve_model
from engine.models.bert import SUPPORTED_MODEL_TYPES, BertEncoder, PackedBatch
from engine.outputs import EmbeddingOutput, EmbeddingRequestOutput
from engine.pooling import PoolingConfig, PoolingParams

log = logging.getLogger("tokenmill.engine")


def is_embedding_model(name_or_path: str) -> bool:
    """Does this model (a bundled name or a directory) embed rather than generate? Reads config.json only;
    a model that is not pulled yet is pulled."""
    config = json.loads((resolve_model(name_or_path) / "config.json").read_text())
    return config.get("model_type") in SUPPORTED_MODEL_TYPES


@dataclass
class _Waiting:
    request_id: str
    token_ids: list[int]
    params: PoolingParams
    arrival_time: float


class EmbeddingEngine:
    """Embeds requests in packed, length-ordered batches of at most `max_num_batched_tokens` tokens."""

    spec = None  # no speculative decoding (`BatchEngine.spec`)

    def __init__(self, config: EngineConfig) -> None:
        from engine.hf_files import load_config, load_tokenizer

        if config.speculative_config:
            raise ValueError("speculative decoding does not apply to an embedding model")
        self.config = config
        self.model_dir = resolve_model(config.model)
        hf_config = load_config(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.pooling = PoolingConfig.from_model_dir(self.model_dir)
        positions = hf_config.max_position_embeddings
        self.max_model_len = config.max_model_len or min(self.pooling.max_seq_length or positions, positions)
        if self.max_model_len > positions:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {positions} positions")
        if config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must hold one input of "
                             f"max_model_len ({self.max_model_len}) tokens")
        self.matryoshka_dimensions = getattr(hf_config, "matryoshka_dimensions", None)
        self.is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False) or self.matryoshka_dimensions)
        self._plain = self.tokenizer.backend_tokenizer  # no truncation: an over-long input is refused
        self._plain.no_truncation()
        self._plain.no_padding()
        self._truncating = self._plain.__class__.from_str(self._plain.to_str())
        self._truncating.enable_truncation(self.max_model_len)  # right side, special tokens kept (as HF)
        self.device = pick_device(config.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            malloc_tuning.keep_freed_memory()
        self.dtype = pick_dtype(config.dtype, self.device)
        float32_split = self._float32_split(config.float32_matmul_precision)
        self.model = load_encoder(self.model_dir, hf_config, self.dtype, self.device, float32_split=float32_split)
        self.embedding_size = hf_config.hidden_size
        self.vocab_size = hf_config.vocab_size
        self.waiting: OrderedDict[str, _Waiting] = OrderedDict()
        self.num_batches = self.num_tokens = 0
        log.info("embedding model %s: %s%s, %s, max_model_len %d, pooling %s%s", config.model, self.dtype,
                 ", matmul precision high" if float32_split else "", self.device,
                 self.max_model_len, self.pooling.mode, " + normalize" if self.pooling.normalize else "")

    def _float32_split(self, precision: str) -> bool:
        """Whether float32 matmul precision "high" takes effect: a float32 model on a CPU with AMX tiles."""
        if precision != "high":
            return False
        if self.dtype == torch.float32 and self.device.type == "cpu" and cpu_kernel.amx_ready():
            return True
        log.warning("float32 matmul precision 'high' needs a float32 model on a CPU with AMX; this one (%s on %s) "
                    "runs at 'highest'", self.dtype, self.device)
        return False

    # -- requests -------------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int], truncate: bool = False) -> list[int]:
        """Token ids with [CLS] ... [SEP]; `truncate` cuts a text to max_model_len as sentence-transformers does."""
        if isinstance(prompt, str):
            return (self._truncating if truncate else self._plain).encode(prompt).ids
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return list(prompt)

    def encode_batch(self, texts: list[str], truncate: bool = False) -> list[list[int]]:
        return [e.ids for e in (self._truncating if truncate else self._plain).encode_batch(texts)]

    def length_error(self, num_tokens: int) -> str | None:
        if num_tokens > self.max_model_len:
            return (f"the input has {num_tokens} tokens, more than the model's max_seq_length of "
                    f"{self.max_model_len}; shorten it, or let the job truncate inputs (truncate_inputs)")
        if num_tokens == 0:
            return "the input is empty"
        return None

    def check_params(self, params: PoolingParams) -> None:
        """ValueError for `dimensions` this model cannot give."""
        dims = params.dimensions
        if dims is None or dims == self.embedding_size and not self.is_matryoshka:
            return
        if not self.is_matryoshka:
            raise ValueError(f"model {self.config.model} does not support 'dimensions' (it is not a Matryoshka "
                             f"model): its embeddings have {self.embedding_size} dimensions")
        allowed = self.matryoshka_dimensions
        if not 1 <= dims <= self.embedding_size or (allowed and dims not in allowed):
            raise ValueError(f"dimensions must be one of {allowed or f'1..{self.embedding_size}'}, got {dims}")

    def add_request(self, request_id: str, prompt: str | list[int], params: PoolingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> str:
        """Queue one input. ValueError for an input over max_model_len (unless params truncate) or bad params."""
        params = params or PoolingParams()
        if request_id in self.waiting:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self.check_params(params)
        token_ids = self.encode(prompt, truncate=params.truncate)
        if params.truncate and len(token_ids) > self.max_model_len:  # token ids given: keep the first, and the last
            token_ids = token_ids[:self.max_model_len - 1] + token_ids[-1:]
        if problem := self.length_error(len(token_ids)):
            raise ValueError(problem)
        self.waiting[request_id] = _Waiting(request_id, token_ids, params, time.time())
        return request_id

    def abort(self, request_id: str) -> bool:
        return self.waiting.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.waiting)

    def speculation_matches(self, settings: dict[str, Any] | None) -> bool:
        return not settings

    def set_speculative_config(self, settings: dict[str, Any] | None) -> None:
        if settings:
            raise ValueError("speculative decoding does not apply to an embedding model")

    def batch_invariance_matches(self, on: bool | None) -> bool:
        return not on

    def set_batch_invariant(self, on: bool | None) -> None:
        if on:
            raise ValueError("the batch-invariant mode applies to generation, not to an embedding model")

    # -- running --------------------------------------------------------------------------------------

    def step(self) -> list[EmbeddingRequestOutput]:
        """Embed the oldest waiting inputs that fit the token budget; returns their outputs (all finished)."""
        batch, budget = [], self.config.max_num_batched_tokens
        for request in self.waiting.values():
            if len(request.token_ids) > budget or len(batch) >= self.config.max_num_seqs:
                break
            batch.append(request)
            budget -= len(request.token_ids)
        for request in batch:
            del self.waiting[request.request_id]
        if not batch:
            return []
        vectors = self.embed_token_ids([r.token_ids for r in batch])
        finished = time.time()
        return [self._output(r, v, finished) for r, v in zip(batch, vectors, strict=True)]

    def _output(self, request: _Waiting, vector: torch.Tensor, finished: float) -> EmbeddingRequestOutput:
        dims = request.params.dimensions
        normalize = self.pooling.normalize if request.params.normalize is None else request.params.normalize
        if dims is not None and dims < vector.shape[0]:  # Matryoshka: the leading dimensions, normalised again
            vector = vector[:dims]
            normalize = True
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return EmbeddingRequestOutput(request.request_id, EmbeddingOutput(vector.tolist()), request.token_ids,
                                      finished=True, arrival_time=request.arrival_time, finish_time=finished)

    @torch.inference_mode()
    def embed_token_ids(self, rows: list[list[int]]) -> torch.Tensor:
        """[rows, hidden] float32 pooled (not yet normalised) vectors of token-id rows, in their order; run as
        one packed batch ordered by length (see `engine.models.bert`)."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        batch = PackedBatch.of([rows[i] for i in order], self.device)
        pooled = self.model(batch, self.pooling.mode)
        self.num_batches += 1
        self.num_tokens += len(batch.token_ids)
        result = torch.empty_like(pooled)
        result[torch.tensor(order, device=pooled.device)] = pooled
        return result.cpu()


def load_encoder(model_dir: Path, hf_config, dtype: torch.dtype, device: torch.device,
                 float32_split: bool = False) -> BertEncoder:
    from safetensors import safe_open

    with torch.device("meta"):
        model = BertEncoder(hf_config)
    materialize(model, device)

    def weights():
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    model.load_hf_weights(weights())
    model = model.to(dtype).eval()
    if device.type == "cpu":
        model.pack_for_cpu(float32_split)
    return model


def create_engine(config: EngineConfig):
    """The engine for the config's model: an `EmbeddingEngine` for an encoder, else an `LLMEngine`."""
    if is_embedding_model(config.model):
        return EmbeddingEngine(config)
    from engine.llm_engine import LLMEngine

    return LLMEngine(config)
