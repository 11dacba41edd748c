"""Engine settings, the KV connector's among them (`KVTransferConfig`, as vLLM keeps it in its config). Names follow
vLLM's engine arguments where vLLM has one."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DEFAULT_MODEL = "smollm2-135m"
DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("auto", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")
FLOAT32_MATMUL_PRECISIONS = ("highest", "high")  # as torch.set_float32_matmul_precision
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the model's dtype; fp8: e4m3 with per-head scales
PREEMPTION_MODES = ("recompute", "swap")  # or None: by the victim's length (engine/swap.py)
CPU_KV_CACHE_SPACE_ENV = "TOKENMILL_CPU_KV_CACHE_SPACE"  # GiB, as vLLM's VLLM_CPU_KVCACHE_SPACE
MIN_SECRET_BYTES = 16  # the KV connector's kv_secret


def default_cpu_kv_cache_space() -> int:
    """The largest KV pool a CPU engine takes by default: $TOKENMILL_CPU_KV_CACHE_SPACE GiB, else 4 GiB."""
    value = os.environ.get(CPU_KV_CACHE_SPACE_ENV, "").strip()
    if not value:
        return 4 << 30
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not 0 < gib < float("inf"):
        raise ValueError(f"{CPU_KV_CACHE_SPACE_ENV} must be a positive number of GiB, got {value!r}")
    return int(gib * 2**30)


KV_CONNECTORS = ("SharedStorageConnector", "RedisConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """`kv_connector`: one of KV_CONNECTORS. `kv_role`: kv_producer saves the full blocks it computes, kv_consumer
    loads the blocks it finds before computing, kv_both does both. `kv_connector_extra_config`: the connector's own
    settings (docs/kv-connector.md): `shared_storage_path` (SharedStorageConnector; a directory or file:// URI),
    `redis_url`, `redis_key_prefix` and `redis_timeout_s` (RedisConnector), `kv_store` (any object with get(key) ->
    bytes | None and put(key, bytes), instead of the connector's own store), `namespace` (a string of the user's,
    added to the model identity that keys every block), and `kv_secret` (required: the deployment's secret, at
    least 16 bytes, that seals every block and keys its name; never shown by repr)."""

    kv_connector: str = "SharedStorageConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {KV_CONNECTORS}, got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {KV_ROLES}, got {self.kv_role!r}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        store = extra.get("kv_store")
        if store is not None and not (callable(getattr(store, "get", None)) and callable(getattr(store, "put", None))):
            raise ValueError("kv_connector_extra_config['kv_store'] must have get(key) and put(key, data) methods")
        if store is None and self.kv_connector == "SharedStorageConnector" and not extra.get("shared_storage_path"):
            raise ValueError("SharedStorageConnector needs kv_connector_extra_config['shared_storage_path'] "
                             "(a directory or file:// URI) or a 'kv_store' object")
        if store is None and self.kv_connector == "RedisConnector" and not extra.get("redis_url"):
            raise ValueError("RedisConnector needs kv_connector_extra_config['redis_url'], e.g. redis://localhost:6379/0")
        secret_bytes(extra.get("kv_secret"))

    def __repr__(self) -> str:
        extra = {k: "***" if k == "kv_secret" else v for k, v in self.kv_connector_extra_config.items()}
        return (f"KVTransferConfig(kv_connector={self.kv_connector!r}, kv_role={self.kv_role!r}, "
                f"kv_connector_extra_config={extra!r})")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def of(cls, value: KVTransferConfig | dict[str, Any] | None) -> KVTransferConfig | None:
        """A config from itself, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a KVTransferConfig or a dict, got {type(value).__name__}")
        unknown = sorted(set(value) - {"kv_connector", "kv_role", "kv_connector_extra_config"})
        if unknown:
            raise ValueError(f"unknown kv_transfer_config field(s): {', '.join(unknown)}")
        return cls(**value)


def secret_bytes(secret: str | bytes) -> bytes:
    """The deployment's KV secret as bytes; ValueError when it is missing or shorter than MIN_SECRET_BYTES."""
    raw = secret.encode() if isinstance(secret, str) else secret if isinstance(secret, bytes) else b""
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV secret (kv_connector_extra_config['kv_secret']) must be at least "
                         f"{MIN_SECRET_BYTES} bytes, e.g. secrets.token_urlsafe(32), the same on every engine that "
                         f"shares blocks")
    return raw


@dataclass
class EngineConfig:
    """Everything `LLM(...)` / `LLMEngine(...)` accept as keyword arguments."""

    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto: bfloat16 on CUDA and on CPUs with avx512_bf16 or AMX, else float32
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int | None = None  # default: derived from the memory budget
    kv_cache_memory: int | None = None  # bytes for the KV pool; default: see memory_utilization
    memory_utilization: float = 0.9  # CUDA: share of device memory for weights + activations + KV
    # CPU: largest KV pool taken by default (bytes; $TOKENMILL_CPU_KV_CACHE_SPACE GiB, else 4 GiB)
    cpu_kv_cache_space: int = field(default_factory=default_cpu_kv_cache_space)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    admission_lookahead: int = 32  # prefix-aware admission window (1: strict first come, first served)
    scheduling_policy: str = "fcfs"  # or "priority": lowest request priority first, then arrival (as vLLM)
    # Cap on one prompt's prefill chunk per step (0: off, only max_num_batched_tokens caps it). vLLM's default
    # is 0 too unless it runs several partial prefills, then 4% of max_model_len.
    long_prefill_token_threshold: int = 0
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    enforce_eager: bool = False  # CUDA: run decode steps eagerly instead of replaying CUDA graphs
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; default: torch's own choice
    speculative_config: dict[str, Any] | None = None
    # A request's output is bit-identical however it is batched (fixed-shape GEMMs, one attention path); "auto":
    # on where it costs nothing, i.e. our own GEMM kernels run the model's dtype (engine/kernels/cpu_gemm.py)
    batch_invariant: bool | str = False
    tensor_parallel_size: int = 1  # processes the model is sharded over (engine/distributed/)
    pipeline_parallel_size: int = 1  # processes the model's layers are split over, in stages (distributed/pipeline.py)
    pipeline_micro_batches: int | None = None  # a step's sequences in up to this many micro-batches (default: stages)
    # float32 encoders: "high" runs their GEMMs as 3 bfloat16 products on AMX tiles (about 16 bits of precision,
    # what PyTorch's "high" allows), where the CPU has AMX; "highest": float32 arithmetic
    float32_matmul_precision: str = "highest"
    # LoRA adapters (engine/lora/): requests may name one with a LoRARequest; at most `max_loras` in one batch
    # (resident on the device), `max_cpu_loras` kept loaded in host memory (LRU), ranks up to `max_lora_rank`
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: max_loras
    # When KV blocks run out, a victim's KV is dropped and recomputed later ("recompute") or copied to host memory
    # and back ("swap", while the swap space has room); None: swap victims with at least 256 computed tokens
    # (engine/swap.py's SWAP_MIN_COMPUTED_TOKENS), recompute shorter ones. As vLLM v0's options.
    preemption_mode: str | None = None
    swap_space: float = 4  # GiB of host memory for swapped-out KV blocks (allocated as used)
    # KV blocks in the model's dtype ("auto") or as FP8 e4m3 bytes with a scale per layer and KV head, calibrated at
    # start-up on a built-in text or given by `kv_cache_scales` (a JSON file or dict): engine/kv_quant.py
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str | dict[str, Any] | None = None
    # Share computed KV blocks with other engines through a store (engine/kv_connector/, docs/kv-connector.md): a
    # KVTransferConfig or a dict of its fields, as vLLM's
    kv_transfer_config: KVTransferConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.kv_transfer_config = KVTransferConfig.of(self.kv_transfer_config)
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        need(self.attention_backend in BACKENDS,
             f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"block_size must be a power of two, got {self.block_size}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be >= 2, got {self.max_model_len}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2,
             f"num_kv_blocks must be >= 2 (one is the null block), got {self.num_kv_blocks}")
        need(self.scheduling_policy in SCHEDULING_POLICIES,
             f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        need(self.long_prefill_token_threshold >= 0,
             f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        need(self.admission_lookahead >= 1, f"admission_lookahead must be >= 1, got {self.admission_lookahead}")
        need(self.batch_invariant in (True, False, "auto"),
             f"batch_invariant must be true, false or 'auto', got {self.batch_invariant!r}")
        need(self.float32_matmul_precision in FLOAT32_MATMUL_PRECISIONS,
             f"float32_matmul_precision must be one of {FLOAT32_MATMUL_PRECISIONS}, "
             f"got {self.float32_matmul_precision!r}")
        need(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        self.validate_pipeline(need)
        need(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        need(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
             f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        need(not (self.enable_lora and self.tensor_parallel_size > 1),
             "enable_lora does not combine with tensor_parallel_size > 1 yet")
        need(self.preemption_mode is None or self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode must be one of {PREEMPTION_MODES} or None, got {self.preemption_mode!r}")
        need(isinstance(self.swap_space, int | float) and self.swap_space >= 0,
             f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        need(self.kv_cache_dtype != "auto" or self.kv_cache_scales is None,
             "kv_cache_scales needs kv_cache_dtype='fp8'")
        need(self.kv_cache_dtype == "auto" or self.tensor_parallel_size == 1,
             "kv_cache_dtype='fp8' does not combine with tensor_parallel_size > 1 yet")
        need(self.kv_transfer_config is None or self.tensor_parallel_size == 1,
             "kv_transfer_config does not combine with tensor_parallel_size > 1 yet (each rank holds a shard of "
             "every block)")
        need(0 < self.memory_utilization <= 1, f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            need(self.max_num_batched_tokens >= self.max_model_len,
                 "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                 f"({self.max_num_batched_tokens} < {self.max_model_len})")

    def validate_pipeline(self, need) -> None:
        stages = self.pipeline_parallel_size
        need(isinstance(stages, int) and stages >= 1, f"pipeline_parallel_size must be >= 1, got {stages!r}")
        need(self.pipeline_micro_batches is None or self.pipeline_micro_batches >= 1,
             f"pipeline_micro_batches must be >= 1, got {self.pipeline_micro_batches}")
        if stages == 1:
            return
        spec = self.speculative_config or {}
        unsupported = {"enable_lora": self.enable_lora, "kv_cache_dtype='fp8'": self.kv_cache_dtype != "auto",
                       "kv_transfer_config": getattr(self, "kv_transfer_config", None) is not None,
                       "speculative_config method 'self'": isinstance(spec, dict) and spec.get("method") == "self"}
        for name, used in unsupported.items():
            need(not used, f"{name} does not combine with pipeline_parallel_size > 1 yet")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine setting(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
