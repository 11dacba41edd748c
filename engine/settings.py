"""The engine's settings as the service carries them, defined once: `ENGINE_SETTINGS` is the table of the knobs a
command line offers (flag, help, the value that means "not given", how a flag's value becomes the engine's), from
which `tokenmill.options.add_engine_options` makes the flags and their help; `EngineSettings` is the typed value
that goes from the command line to the engine: a worker's environment (`TOKENMILL_WORKER_ENGINE`) and a job's
stored settings are its JSON (`to_json`, read back with `from_json`), each value checked against the type of its
`EngineConfig` field, so a bad value fails naming the setting. A setting's type and default are `EngineConfig`'s
(the table says only where the command line differs); its value checks are `EngineConfig.validate`'s.

Quirks kept from the flags: most settings are passed only when given (an engine, and a job's stored settings, as
without the flag); --kv-cache-memory is GiB, the engine's bytes; --kv-transfer-config may not carry the KV secret
(the deployment's, added where an engine is made) and `to_json` never writes one; --speculative-method,
--num-speculative-tokens and --draft-model compose `speculative_config`; the LoRA knobs compose the LoRA settings
from the number of adapters a command serves."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.config import (
    BACKENDS,
    DEFAULT_MODEL,
    DTYPES,
    FLOAT32_MATMUL_PRECISIONS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    EngineConfig,
)

SECRET_KEY = "kv_secret"  # kv_transfer_config's kv_connector_extra_config key that is never stored or sent
INVARIANT_CHOICES = {"auto": "auto", "on": True, "off": False}  # --batch-invariant's words
SPECULATIVE_METHODS = ("ngram", "draft", "self", "medusa")
LORA_DEFAULT_HELP = {"adapters": "on when --lora-modules names adapters", "single-rank": "on unless -tp or -pp > 1, so "
                     "a job may bring adapters of its own"}
MAX_LORAS_DEFAULT = 4  # device slots without --lora-modules
MAX_LORAS_CAP = 8  # slots sized from the --lora-modules count go no higher
_HINTS: dict[str, Any] = typing.get_type_hints(EngineConfig)  # each field's type, resolved once (a constant)


class _Engine:
    def __repr__(self) -> str:
        return "ENGINE_DEFAULT"


ENGINE_DEFAULT: Any = _Engine()  # a flag's default (or type) is its EngineConfig field's
ALWAYS: Any = object()  # `unset` of a setting passed whatever its value
EMPTY: Any = object()  # `unset` of a setting left out when its value is empty (None, "", {})


def _identity(value: Any) -> Any:
    return value


def _gib_to_bytes(gib: float) -> int:
    return int(gib * 2**30)


def _no_secret_given(transfer: dict[str, Any]) -> dict[str, Any]:
    if SECRET_KEY in (transfer.get("kv_connector_extra_config") or {}):
        raise ValueError("give the KV secret in TOKENMILL_KV_SECRET, not in --kv-transfer-config: a command "
                         "line is visible to every user of the host, and a job's settings are stored")
    return transfer


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object; argparse.ArgumentTypeError otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as problem:
        raise argparse.ArgumentTypeError(f"not JSON: {problem}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


@dataclass(frozen=True)
class EngineSetting:
    """One knob of the command line. `dest`: its name there (argparse's dest). `key`: the `EngineConfig` keyword
    it sets (None: composed with others, see `EngineSettings.from_command_line`). `unset`: the value that means not
    given, so the engine's setting is left out (ALWAYS: passed whatever it is). `to_engine`: the flag's value as
    the engine's. `default` and `type`: ENGINE_DEFAULT takes the EngineConfig field's. `lora`: only on commands that
    serve adapters. `help` may use argparse's %(default)s; {lora_default} is the command's LoRA default."""

    dest: str
    flags: tuple[str, ...]
    help: str
    key: str | None = None
    default: Any = ENGINE_DEFAULT
    type: Any = ENGINE_DEFAULT
    choices: Any = None
    metavar: str | None = None
    action: Any = None
    nargs: str | None = None
    const: Any = None
    unset: Any = ALWAYS
    to_engine: Callable[[Any], Any] = _identity
    lora: bool = False

    def argparse_kwargs(self, lora_default: str | None = None) -> dict[str, Any]:
        """add_argument's keywords for this knob."""
        default = _field_default(self.key) if self.default is ENGINE_DEFAULT else self.default
        kwargs: dict[str, Any] = {"dest": self.dest, "default": default,
                                  "help": self.help.replace("{lora_default}", LORA_DEFAULT_HELP.get(lora_default, ""))}
        if self.action is not None:
            kwargs["action"] = self.action
            if self.action in ("store_true", "store_false"):
                return {**kwargs, "default": bool(default)}
        argtype = _flag_type(self.key) if self.type is ENGINE_DEFAULT else self.type
        if argtype is not None:
            kwargs["type"] = argtype
        for name in ("choices", "metavar", "nargs", "const"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs


def _field_default(key: str | None) -> Any:
    for field in dataclasses.fields(EngineConfig):
        if field.name == key:
            return None if field.default is dataclasses.MISSING else field.default
    return None


def _flag_type(key: str | None) -> type | None:
    """int or float for an EngineConfig field of that type (optional or not); None (argparse's str) otherwise."""
    if key is None:
        return None
    members = [t for t in _members(_hints()[key]) if t is not type(None)]
    return members[0] if len(members) == 1 and members[0] in (int, float) else None


# The command line's engine knobs, in the order of their help.
ENGINE_SETTINGS: tuple[EngineSetting, ...] = (
    EngineSetting("model", ("--model",), key="model",
                  help="bundled model name or a local Hugging Face directory (default: %(default)s)"),
    EngineSetting("dtype", ("--dtype",), key="dtype", choices=DTYPES,
                  help="weights and KV dtype (auto: bfloat16 on CUDA and on CPUs with native bf16, avx512_bf16 or "
                       "AMX; float32 elsewhere)"),
    EngineSetting("float32_matmul_precision", ("--float32-matmul-precision",), key="float32_matmul_precision",
                  choices=FLOAT32_MATMUL_PRECISIONS,
                  help="float32 embedding models on CPUs with AMX: high runs each GEMM as three bfloat16 products on "
                       "the AMX tiles (each float32 split into two bfloat16s: about 16 bits kept, PyTorch's 'high'): "
                       "all-MiniLM ran 1.3-1.5x as fast on a 2-core Xeon; highest: float32 arithmetic (default: "
                       "%(default)s)"),
    EngineSetting("block_size", ("--block-size",), key="block_size",
                  help="tokens per KV block (default: %(default)s)"),
    EngineSetting("max_model_len", ("--max-model-len",), key="max_model_len",
                  help="context length limit (default: the model's)"),
    EngineSetting("max_num_seqs", ("--max-num-seqs",), key="max_num_seqs",
                  help="sequences running at once (default: %(default)s)"),
    EngineSetting("max_num_batched_tokens", ("--max-num-batched-tokens",), key="max_num_batched_tokens",
                  help="token budget of one step; prompts longer than it are prefilled in chunks (default: "
                       "%(default)s)"),
    EngineSetting("num_kv_blocks", ("--num-kv-blocks",), key="num_kv_blocks",
                  help="KV pool size in blocks (default: from the memory budget)"),
    EngineSetting("kv_cache_memory", ("--kv-cache-memory",), key="kv_cache_memory", type=float, metavar="GIB",
                  unset=None, to_engine=_gib_to_bytes,
                  help="KV pool size in GiB (default: up to 4 GiB on CPU, 90%% of free memory on CUDA)"),
    EngineSetting("kv_cache_dtype", ("--kv-cache-dtype",), key="kv_cache_dtype", choices=KV_CACHE_DTYPES,
                  unset="auto",
                  help="KV blocks in the model's dtype (auto), or fp8 (= fp8_e4m3): one byte per element with a "
                       "scale per layer and KV head, calibrated at start-up, so about twice the blocks of bfloat16 "
                       "in the same memory (docs/kv-cache-fp8.md) (default: %(default)s)"),
    EngineSetting("kv_cache_scales", ("--kv-cache-scales",), key="kv_cache_scales", default=None, metavar="JSON",
                  unset=EMPTY,
                  help="FP8 KV cache: the scales from this JSON file ({\"k\": [[per head] per layer], \"v\": ...}) "
                       "instead of calibrating (default: calibrate)"),
    EngineSetting("kv_transfer_config", ("--kv-transfer-config",), key="kv_transfer_config", type=json_object,
                  metavar="JSON", unset=EMPTY, to_engine=_no_secret_given,
                  help="share KV blocks with other engines, as vLLM's: e.g. '{\"kv_connector\": "
                       "\"SharedStorageConnector\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": "
                       "{\"shared_storage_path\": \"/mnt/kv\"}}' or RedisConnector with \"redis_url\" "
                       "(docs/kv-connector.md) (default: off)"),
    EngineSetting("no_prefix_caching", ("--no-prefix-caching",), key="enable_prefix_caching", action="store_true",
                  default=False, to_engine=lambda off: not off, help="turn automatic prefix caching off"),
    EngineSetting("admission_lookahead", ("--admission-lookahead",), key="admission_lookahead", metavar="N",
                  help="waiting requests searched for the longest cached prefix when admitting (1: strict first "
                       "come, first served; default: %(default)s)"),
    EngineSetting("scheduling_policy", ("--scheduling-policy",), key="scheduling_policy", choices=SCHEDULING_POLICIES,
                  help="admission order: fcfs, or priority (a request's lower priority value first, then arrival; "
                       "preemption takes the highest value, latest arrival) (default: %(default)s)"),
    EngineSetting("long_prefill_token_threshold", ("--long-prefill-token-threshold",),
                  key="long_prefill_token_threshold", metavar="TOKENS",
                  help="cap on one prompt's prefill chunk per step, so long prompts share steps with other "
                       "prefills and decodes (default: %(default)s, off, as vLLM with one partial prefill)"),
    EngineSetting("preemption_mode", ("--preemption-mode",), key="preemption_mode", choices=PREEMPTION_MODES,
                  unset=None,
                  help="when KV blocks run out, a preempted request's KV is dropped and recomputed later "
                       "(recompute) or copied to host memory and back (swap, while --swap-space has room) "
                       "(default: swap requests with at least 256 computed tokens, recompute shorter ones; "
                       "docs/swap.md)"),
    EngineSetting("swap_space", ("--swap-space",), key="swap_space", default=None, metavar="GIB", unset=None,
                  help=f"host memory for swapped-out KV blocks, taken as used (default: "
                       f"{_field_default('swap_space'):g})"),
    EngineSetting("attention_backend", ("--attention-backend",), key="attention_backend", choices=BACKENDS,
                  help="paged attention implementation (auto: triton on CUDA, torch on CPU)"),
    EngineSetting("threads", ("--threads",), key="num_threads",
                  help="CPU threads for torch, per rank (default: torch's choice; with tensor parallelism on CPU, "
                       "the cores shared out over the ranks)"),
    EngineSetting("tensor_parallel_size", ("--tensor-parallel-size", "-tp"), key="tensor_parallel_size", metavar="N",
                  help="shard the model over N processes (GPUs on CUDA; on CPU this costs time, it does not save "
                       "any) (default: %(default)s)"),
    EngineSetting("pipeline_parallel_size", ("--pipeline-parallel-size", "-pp"), key="pipeline_parallel_size",
                  metavar="N", unset=1,
                  help="split the model's layers into N stages, one process (GPU on CUDA) each, or -tp of them, a "
                       "step's sequences in micro-batches that overlap (docs/pipeline-parallel.md) (default: "
                       "%(default)s)"),
    EngineSetting("batch_invariant", ("--batch-invariant",), key="batch_invariant", choices=INVARIANT_CHOICES,
                  nargs="?", const="on", default="auto", type=None, to_engine=INVARIANT_CHOICES.__getitem__,
                  help="a request's output bit-identical however it is batched or sharded (GEMMs that sum in one "
                       "order at any batch size, one attention path). auto (the default): on where our own GEMM "
                       "kernels run the model's dtype (bfloat16 on AMX or avx512_bf16 CPUs, float32 on AVX-512), "
                       "where it costs about nothing; elsewhere off, as the mode's row tiles cost up to half the "
                       "throughput there (see the README). A bare --batch-invariant means on"),
    EngineSetting("speculative_method", ("--speculative-method",), choices=SPECULATIVE_METHODS,
                  help="speculative decoding proposer: ngram (prompt lookup), draft (--draft-model), self (the "
                       "model's own first layers) or medusa (trained heads: --draft-model DIR, from `tokenmill spec "
                       "train-head`); adaptive, so large batches are not slowed (default: off)"),
    EngineSetting("num_speculative_tokens", ("--num-speculative-tokens",), type=int, default=5,
                  help="draft tokens per step (default: %(default)s)"),
    EngineSetting("draft_model", ("--draft-model",),
                  help="draft model name or directory for --speculative-method draft (a head directory for medusa)"),
    EngineSetting("enable_lora", ("--enable-lora",), lora=True, default=None, action=argparse.BooleanOptionalAction,
                  help="serve LoRA adapters (docs/lora.md) (default: {lora_default})"),
    EngineSetting("max_loras", ("--max-loras",), lora=True, type=int, default=None, metavar="N",
                  help=f"adapters one engine step runs at once, each in a device slot (default: the number of "
                       f"--lora-modules, at most {MAX_LORAS_CAP}; {MAX_LORAS_DEFAULT} without)"),
    EngineSetting("max_lora_rank", ("--max-lora-rank",), lora=True, key="max_lora_rank", metavar="R",
                  help="largest adapter rank served; an adapter of a higher rank fails its rows (default: "
                       "%(default)s)"),
    EngineSetting("max_cpu_loras", ("--max-cpu-loras",), lora=True, type=int, default=None, metavar="N",
                  help="adapters kept loaded in host memory, least recently used dropped (default: the larger of "
                       "--max-loras and the number of --lora-modules)"),
)


@dataclass(frozen=True)
class CommandLineEngine:
    """What a command's flags say beyond the table: its LoRA default ("adapters": on when it serves adapters;
    "single-rank": on unless the model spans ranks; None: no LoRA knobs) and the number of adapters it serves."""

    lora_default: str | None = None
    lora_modules: int = 0


class EngineSettings(Mapping[str, Any]):
    """Engine settings as given: `EngineConfig` keywords, each value checked against its field's type; a setting
    not given is the engine's default. Read-only; a mapping, so `EngineConfig.from_kwargs(**settings)` and
    `settings.get("model")` work. Its repr never shows a KV secret."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any] | None = None, source: str | None = None) -> None:
        values = dict(values or {})
        check_types(values, source)
        self._values = values

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"EngineSettings({without_secret(self._values)!r})"

    @property
    def model(self) -> str:
        return self._values.get("model", DEFAULT_MODEL)

    def replace(self, **changes: Any) -> EngineSettings:
        return EngineSettings({**self._values, **changes})

    def config(self) -> EngineConfig:
        """The engine's config (its value checks run here: ValueError naming the setting)."""
        return EngineConfig.from_kwargs(**self._values)

    def to_json(self) -> dict[str, Any]:
        """The settings fit to store (a job's settings) or pass on (a worker's environment): JSON values, no KV
        secret."""
        return without_secret(self._values)

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def of(cls, value: EngineSettings | Mapping[str, Any] | None, source: str | None = None) -> EngineSettings:
        return value if isinstance(value, EngineSettings) else cls(value, source)

    @classmethod
    def from_json(cls, value: str | Mapping[str, Any] | None, source: str | None = None) -> EngineSettings:
        """Settings from their JSON (text, or the decoded object of a job's stored settings); ValueError naming
        `source` (where they were read) and the setting for anything else."""
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as error:
                raise ValueError(f"{source or 'engine settings'} must be a JSON object of engine settings: "
                                 f"{error}") from None
        if value is not None and not isinstance(value, Mapping):
            raise ValueError(f"{source or 'engine settings'} must be a JSON object of engine settings, got "
                             f"{type(value).__name__}")
        return cls(value, source)

    @classmethod
    def from_command_line(cls, values: Mapping[str, Any], command: CommandLineEngine = CommandLineEngine()
                          ) -> EngineSettings:
        """The settings the flags give (`values`: the parsed flags by dest, e.g. vars(args)): each table knob with
        an EngineConfig keyword, left out where it is unset; then the LoRA and speculative settings they compose.
        ValueError for flags that contradict each other."""
        settings: dict[str, Any] = {}
        for knob in ENGINE_SETTINGS:
            if knob.key is None or knob.lora or knob.dest not in values:
                continue
            value = values[knob.dest]
            if (not value) if knob.unset is EMPTY else knob.unset is not ALWAYS and (
                    value is None if knob.unset is None else value == knob.unset):
                continue
            settings[knob.key] = knob.to_engine(value)
        settings.update(_lora_settings(values, command))
        if values.get("speculative_method"):
            speculative = {"method": values["speculative_method"],
                           "num_speculative_tokens": values["num_speculative_tokens"]}
            if values.get("draft_model"):
                speculative["model"] = values["draft_model"]
            settings["speculative_config"] = speculative
        return cls(settings, "the engine options")  # a flag's type is its field's: a check that never fails


def _lora_settings(values: Mapping[str, Any], command: CommandLineEngine) -> dict[str, Any]:
    """The engine's LoRA settings: none when LoRA is off (an engine, and a job's settings, as without it)."""
    if command.lora_default is None:
        return {}
    count = command.lora_modules
    enabled = values.get("enable_lora")
    if enabled is None:
        enabled = bool(count) if command.lora_default == "adapters" else (
            values.get("tensor_parallel_size", 1) == 1 and values.get("pipeline_parallel_size", 1) == 1)
    if not enabled:
        if count:
            raise ValueError("--lora-modules needs LoRA: drop --no-enable-lora")
        return {}
    max_loras = values.get("max_loras") or (min(count, MAX_LORAS_CAP) if count else MAX_LORAS_DEFAULT)
    cpu_loras = values.get("max_cpu_loras") or (count if count > max_loras else None)
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": values["max_lora_rank"],
            **({"max_cpu_loras": cpu_loras} if cpu_loras else {})}


def without_secret(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Engine settings fit to store or pass on: no kv_secret in kv_transfer_config."""
    settings = dict(settings)
    transfer = settings.get("kv_transfer_config")
    if not isinstance(transfer, dict) or SECRET_KEY not in (transfer.get("kv_connector_extra_config") or {}):
        return settings
    extra = {k: v for k, v in transfer["kv_connector_extra_config"].items() if k != SECRET_KEY}
    return {**settings, "kv_transfer_config": {**transfer, "kv_connector_extra_config": extra}}


# ---- types ----------------------------------------------------------------------------------------------

def _hints() -> dict[str, Any]:
    return _HINTS


def _members(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _matches(value: Any, hint: Any) -> bool:
    for member in _members(hint):
        origin = typing.get_origin(member) or member
        if member is type(None) and value is None:
            return True
        if member is Any:
            return True
        if origin is bool:
            if isinstance(value, bool):
                return True
        elif origin is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return True
        elif origin is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return True
        elif isinstance(origin, type) and isinstance(value, origin):
            return True
    return False


def _describe(hint: Any) -> str:
    names = []
    for member in _members(hint):
        origin = typing.get_origin(member) or member
        names.append("null" if member is type(None) else "a JSON object" if origin is dict else
                     getattr(origin, "__name__", str(origin)))
    return " or ".join(names)


def check_types(values: Mapping[str, Any], source: str | None = None) -> None:
    """ValueError naming the first setting that is no EngineConfig keyword, or whose value is not of its field's
    type (an int is a float; a bool is no int), after `source` (where they were read) if given."""
    where = f"{source}: " if source else ""
    hints = _hints()
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"{where}unknown engine setting(s): {', '.join(unknown)}; known: {', '.join(sorted(hints))}")
    for name, value in values.items():
        if not _matches(value, hints[name]):
            raise ValueError(f"{where}engine setting {name} must be {_describe(hints[name])}, got "
                             f"{type(value).__name__} {value!r:.200}")
