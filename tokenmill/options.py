"""Command-line options shared by the command modules, and what they default to: engine and sampling settings,
the job database, the running stack's state directory and environment, the bundled sample input."""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from engine.config import (
    BACKENDS,
    DEFAULT_MODEL,
    DTYPES,
    FLOAT32_MATMUL_PRECISIONS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
)
from workers.kv_sharing import DEFAULT_TTL_S as KV_SHARING_TTL_S

INVARIANT_CHOICES = {"auto": "auto", "on": True, "off": False}
DATABASE_HELP = ("SQLAlchemy database URL, e.g. postgresql+psycopg://user@host/db (default: $TOKENMILL_DATABASE_URL, "
                 "else SQLite at $TOKENMILL_DATA/tokenmill.db, $TOKENMILL_DATA defaulting to ~/.local/share/tokenmill)")


def add_engine_options(parser: argparse.ArgumentParser, lora: str | None = None) -> None:
    """The engine's settings; `lora` adds the LoRA knobs, with --enable-lora's default: "adapters" (on when
    --lora-modules names some: `run`), "single-rank" (on unless -tp or -pp > 1: `worker`)."""
    group = parser.add_argument_group(
        "engine", "On CPUs, C kernels (built once into ~/.cache/tokenmill/kernels) run decode attention and the "
                  "layers' norms, RoPE and SiLU, and the GEMMs (bfloat16 on CPUs with AMX or avx512_bf16, "
                  "float32 on AVX-512 where faster), a decode step's layers in one C call where all of these run; "
                  "TOKENMILL_CPU_ATTENTION_KERNEL=0 and TOKENMILL_CPU_LAYER_OPS=0 switch them back to torch ops, "
                  "TOKENMILL_CPU_DECODE_LAYERS=0 to the Python loop over the layers, "
                  "TOKENMILL_BF16_GEMM=amx|avx512|onednn and TOKENMILL_FLOAT32_GEMM=mkl|onednn|avx512 force a "
                  "dtype's GEMM kernel.")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"bundled model name or a local Hugging Face directory (default: {DEFAULT_MODEL})")
    group.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="weights and KV dtype (auto: bfloat16 on CUDA and on CPUs with native bf16, "
                            "avx512_bf16 or AMX; float32 elsewhere)")
    group.add_argument("--float32-matmul-precision", choices=FLOAT32_MATMUL_PRECISIONS, default="highest",
                       help="float32 embedding models on CPUs with AMX: high runs each GEMM as three bfloat16 "
                            "products on the AMX tiles (each float32 split into two bfloat16s: about 16 bits kept, "
                            "PyTorch's 'high'): all-MiniLM ran 1.3-1.5x as fast on a 2-core Xeon; highest: float32 "
                            "arithmetic (default: highest)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    group.add_argument("--max-model-len", type=int, help="context length limit (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="sequences running at once (default: 256)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one step; prompts longer than it are prefilled in chunks (default: 2048)")
    group.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (default: from the memory budget)")
    group.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                       help="KV pool size in GiB (default: up to 4 GiB on CPU, 90%% of free memory on CUDA)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="KV blocks in the model's dtype (auto), or fp8 (= fp8_e4m3): one byte per element with a "
                            "scale per layer and KV head, calibrated at start-up, so about twice the blocks of "
                            "bfloat16 in the same memory (docs/kv-cache-fp8.md) (default: auto)")
    group.add_argument("--kv-cache-scales", metavar="JSON",
                       help="FP8 KV cache: the scales from this JSON file ({\"k\": [[per head] per layer], "
                            "\"v\": ...}) instead of calibrating (default: calibrate)")
    group.add_argument("--kv-transfer-config", type=json_object, metavar="JSON",
                       help="share KV blocks with other engines, as vLLM's: e.g. '{\"kv_connector\": "
                            "\"SharedStorageConnector\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": "
                            "{\"shared_storage_path\": \"/mnt/kv\"}}' or RedisConnector with \"redis_url\" "
                            "(docs/kv-connector.md) (default: off)")
    group.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    group.add_argument("--admission-lookahead", type=int, default=32, metavar="N",
                       help="waiting requests searched for the longest cached prefix when admitting (1: strict "
                            "first come, first served; default: 32)")
    group.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                       help="admission order: fcfs, or priority (a request's lower priority value first, then "
                            "arrival; preemption takes the highest value, latest arrival) (default: fcfs)")
    group.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="TOKENS",
                       help="cap on one prompt's prefill chunk per step, so long prompts share steps with other "
                            "prefills and decodes (default: 0, off, as vLLM with one partial prefill)")
    group.add_argument("--preemption-mode", choices=PREEMPTION_MODES,
                       help="when KV blocks run out, a preempted request's KV is dropped and recomputed later "
                            "(recompute) or copied to host memory and back (swap, while --swap-space has room) "
                            "(default: swap requests with at least 256 computed tokens, recompute shorter ones; "
                            "docs/swap.md)")
    group.add_argument("--swap-space", type=float, metavar="GIB",
                       help="host memory for swapped-out KV blocks, taken as used (default: 4)")
    group.add_argument("--attention-backend", choices=BACKENDS, default="auto",
                       help="paged attention implementation (auto: triton on CUDA, torch on CPU)")
    group.add_argument("--threads", type=int, help="CPU threads for torch, per rank (default: torch's choice; with "
                                                   "tensor parallelism on CPU, the cores shared out over the ranks)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                       help="shard the model over N processes (GPUs on CUDA; on CPU this costs time, it does not "
                            "save any) (default: 1)")
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N",
                       help="split the model's layers into N stages, one process (GPU on CUDA) each, or -tp of "
                            "them, a step's sequences in micro-batches that overlap (docs/pipeline-parallel.md) "
                            "(default: 1)")
    group.add_argument("--batch-invariant", choices=INVARIANT_CHOICES, nargs="?", const="on", default="auto",
                       help="a request's output bit-identical however it is batched or sharded (GEMMs that sum in "
                            "one order at any batch size, one attention path). auto (the default): on where our own "
                            "GEMM kernels run the model's dtype (bfloat16 on AMX or avx512_bf16 CPUs, float32 on "
                            "AVX-512), where it costs about nothing; elsewhere off, as the mode's row tiles cost "
                            "up to half the throughput there (see the README). A bare --batch-invariant means on")
    group.add_argument("--speculative-method", choices=("ngram", "draft", "self", "medusa"),
                       help="speculative decoding proposer: ngram (prompt lookup), draft (--draft-model), self "
                            "(the model's own first layers) or medusa (trained heads: --draft-model DIR, from "
                            "`tokenmill spec train-head`); adaptive, so large batches are not slowed (default: off)")
    group.add_argument("--num-speculative-tokens", type=int, default=5, help="draft tokens per step (default: 5)")
    group.add_argument("--draft-model", help="draft model name or directory for --speculative-method draft (a head "
                                             "directory for medusa)")
    if lora is not None:
        _add_lora_knobs(group, lora)


LORA_DEFAULT_HELP = {"adapters": "on when --lora-modules names adapters", "single-rank": "on unless -tp or -pp > 1, so "
                     "a job may bring adapters of its own"}
MAX_LORAS_DEFAULT = 4  # device slots without --lora-modules
MAX_LORAS_CAP = 8  # slots sized from the --lora-modules count go no higher


def _add_lora_knobs(group: argparse._ArgumentGroup, default: str) -> None:
    group.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None,
                       help=f"serve LoRA adapters (docs/lora.md) (default: {LORA_DEFAULT_HELP[default]})")
    group.add_argument("--max-loras", type=int, metavar="N",
                       help=f"adapters one engine step runs at once, each in a device slot (default: the number of "
                            f"--lora-modules, at most {MAX_LORAS_CAP}; {MAX_LORAS_DEFAULT} without)")
    group.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                       help="largest adapter rank served; an adapter of a higher rank fails its rows (default: 16)")
    group.add_argument("--max-cpu-loras", type=int, metavar="N",
                       help="adapters kept loaded in host memory, least recently used dropped (default: the larger "
                            "of --max-loras and the number of --lora-modules)")
    group.set_defaults(lora_default=default)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=not args.no_prefix_caching,
        admission_lookahead=args.admission_lookahead, scheduling_policy=args.scheduling_policy,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        attention_backend=args.attention_backend, num_threads=args.threads,
        batch_invariant=INVARIANT_CHOICES[args.batch_invariant],
        tensor_parallel_size=args.tensor_parallel_size, float32_matmul_precision=args.float32_matmul_precision,
    )
    if args.kv_cache_memory is not None:
        kwargs["kv_cache_memory"] = int(args.kv_cache_memory * 2**30)
    if args.preemption_mode is not None:  # only when set: an engine's settings as without the options
        kwargs["preemption_mode"] = args.preemption_mode
    if args.swap_space is not None:
        kwargs["swap_space"] = args.swap_space
    if args.kv_cache_dtype != "auto":  # only when set: an engine's settings as without the option
        kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.kv_cache_scales:
        kwargs["kv_cache_scales"] = args.kv_cache_scales
    if args.pipeline_parallel_size != 1:  # only when set: an engine's settings as without the option
        kwargs["pipeline_parallel_size"] = args.pipeline_parallel_size
    if args.kv_transfer_config:
        if "kv_secret" in (args.kv_transfer_config.get("kv_connector_extra_config") or {}):
            raise ValueError("give the KV secret in TOKENMILL_KV_SECRET, not in --kv-transfer-config: a command "
                             "line is visible to every user of the host, and a job's settings are stored")
        kwargs["kv_transfer_config"] = args.kv_transfer_config
    if getattr(args, "kv_sharing", None) is not None:  # `worker` only: add_kv_sharing_options
        kwargs.update(kv_sharing_kwargs(args))
    if kwargs.get("kv_transfer_config"):
        from workers.kv_sharing import with_kv_secret

        kwargs = with_kv_secret(kwargs)  # strip it (without_kv_secret) from settings that are stored or sent
    kwargs.update(lora_engine_kwargs(args))
    if args.speculative_method:
        kwargs["speculative_config"] = {"method": args.speculative_method,
                                        "num_speculative_tokens": args.num_speculative_tokens}
        if args.draft_model:
            kwargs["speculative_config"]["model"] = args.draft_model
    return kwargs


def add_kv_sharing_options(parser: argparse.ArgumentParser) -> None:
    """--kv-sharing and its settings (`tokenmill worker`; workers/kv_sharing.py)."""
    group = parser.add_argument_group(
        "KV sharing", "The workers of a job share the KV blocks they compute through Redis: the first worker to "
                      "compute a prefix saves its blocks, the others load them instead of computing them; "
                      "workers that meet a prefix at the same moment both compute it "
                      "(docs/kv-connector.md#kv-sharing-across-workers). Every full block a worker computes is "
                      "saved, outputs too, so Redis holds about tokens/s x --kv-sharing-ttl x the model's KV bytes "
                      "per token (SmolLM2-135M: 22.5 KiB in bfloat16).")
    group.add_argument("--kv-sharing", action=argparse.BooleanOptionalAction, default=False,
                       help="share KV blocks with the service's other workers (kv_transfer_config RedisConnector, "
                            "kv_both), sealed under $TOKENMILL_KV_SECRET (required; `stack up` makes one); not with "
                            "--kv-transfer-config or --kv-role (default: off)")
    group.add_argument("--kv-sharing-url", metavar="REDIS_URL",
                       help="the Redis that holds the shared blocks, e.g. one of their own with maxmemory and "
                            "allkeys-lru (default: $TOKENMILL_KV_REDIS_URL, the stack's KV Redis, else database 1 of "
                            "the service's Redis, its result backend)")
    group.add_argument("--kv-sharing-ttl", type=int, metavar="SECONDS",
                       help=f"seconds a shared block is kept in Redis, 0 for no expiry (default: "
                            f"$TOKENMILL_KV_TTL_S, else {KV_SHARING_TTL_S})")


def kv_sharing_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--kv-sharing as the engine's kv_transfer_config; {} when off."""
    from ingest.config import ServiceConfig
    from workers.kv_sharing import service_kv_sharing_config

    if not args.kv_sharing:
        if args.kv_sharing_url:
            raise ValueError("--kv-sharing-url needs --kv-sharing")
        return {}
    if args.kv_transfer_config:
        raise ValueError("--kv-sharing and --kv-transfer-config both set the engine's KV connector: give one (for "
                         "sharing with settings of your own, a --kv-transfer-config with RedisConnector and kv_both)")
    if getattr(args, "kv_role", None):
        raise ValueError("--kv-sharing and --kv-role both set the engine's KV role: a sharing worker saves and loads "
                         "(kv_both), a disaggregated one only one of them; give one")
    return {"kv_transfer_config": service_kv_sharing_config(ServiceConfig.from_env(), args.kv_sharing_url,
                                                            args.kv_sharing_ttl)}


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as problem:
        raise argparse.ArgumentTypeError(f"not JSON: {problem}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def lora_engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's LoRA settings: none when LoRA is off (an engine, and a job's settings, as without it)."""
    if getattr(args, "lora_default", None) is None:
        return {}
    count = len(lora_modules(args))
    enabled = args.enable_lora
    if enabled is None:
        enabled = bool(count) if args.lora_default == "adapters" else (
            args.tensor_parallel_size == 1 and getattr(args, "pipeline_parallel_size", 1) == 1)
    if not enabled:
        if count:
            raise ValueError("--lora-modules needs LoRA: drop --no-enable-lora")
        return {}
    max_loras = args.max_loras or (min(count, MAX_LORAS_CAP) if count else MAX_LORAS_DEFAULT)
    cpu_loras = args.max_cpu_loras or (count if count > max_loras else None)
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": args.max_lora_rank,
            **({"max_cpu_loras": cpu_loras} if cpu_loras else {})}


def add_lora_modules_option(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=[],
                        metavar="NAME=DIR_OR_URI", help=help)


def lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules item: NAME=DIR_OR_URI, or vLLM's JSON form {"name": NAME, "path": DIR_OR_URI}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
        name, path = (document.get("name"), document.get("path")) if isinstance(document, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f'expected NAME=DIR_OR_URI or {{"name": ..., "path": ...}}, got {text!r}')
    return name.strip(), path.strip()


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """--lora-modules as {name: directory or URI}; ValueError for a name given twice."""
    modules: dict[str, str] = {}
    for name, path in getattr(args, "lora_modules", None) or []:
        if name in modules:
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        modules[name] = path
    return modules


def add_sampling_options(parser: argparse.ArgumentParser, max_tokens: int = 128,
                         temperature: float | None = None) -> None:
    """Job defaults; a row's own value wins. Unset `--temperature` leaves rows at OpenAI's 1.0 (`temperature`
    given here, e.g. 0 for `generate`, is the default instead)."""
    group = parser.add_argument_group("sampling defaults")
    group.add_argument("--max-tokens", type=int, default=max_tokens,
                       help=f"tokens to generate per prompt at most (default: {max_tokens})")
    group.add_argument("--temperature", type=float, default=temperature,
                       help=f"0 is greedy (default: {temperature:g})" if temperature is not None else
                       "0 is greedy (default: a row's own, else OpenAI's 1.0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0, off)")
    group.add_argument("--seed", type=int, help="per-request seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop when this text appears (repeatable)")
    group.add_argument("--json-schema", metavar="FILE",
                       help="constrain every output to this JSON schema (a row's own response_format wins)")
    group.add_argument("--beam-width", type=int, metavar="W",
                       help="run every row as a beam search of W beams (deterministic; a row's own beam_width wins); a "
                            "row's text is its best beam, or its n best as n choices (default: off, rows sample)")
    group.add_argument("--allow-beam-search", action="store_true",
                       help="let OpenAI Batch rows set beam_width, which OpenAI does not have (default: such a row "
                            "fails with unsupported_parameter; Parquet rows may always set it)")


def add_task_options(parser: argparse.ArgumentParser) -> None:
    """--task and --truncate-inputs, for the commands that make a job (`run`, `submit`)."""
    parser.add_argument("--task", choices=("generate", "embed"), default="generate",
                        help="generate completions (default) or embed: a Parquet input's `text` column is embedded "
                             "by an embedding --model, e.g. all-minilm-l6-v2 (OpenAI JSONL rows name "
                             "/v1/embeddings themselves)")
    parser.add_argument("--truncate-inputs", action="store_true",
                        help="embedding inputs longer than the model's max_seq_length are cut to it, as "
                             "sentence-transformers does (default: such a row fails with context_length_exceeded)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = dict(max_tokens=args.max_tokens, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=list(args.stop))
    if args.temperature is not None:
        kwargs["temperature"] = args.temperature
    if getattr(args, "beam_width", None) is not None:
        kwargs["beam_width"] = args.beam_width
    if getattr(args, "allow_beam_search", False):
        kwargs["allow_beam_search"] = True
    if getattr(args, "json_schema", None):
        schema = json.loads(Path(args.json_schema).read_text())
        kwargs["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": Path(args.json_schema).stem, "schema": schema,
                                                     "strict": True}}
    return kwargs


def add_served_model_name_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                        help="another name OpenAI-format rows may give as their `model` (repeatable, as vLLM's); a "
                             "row naming neither it nor --model fails with model_not_found")


def sample_input() -> str:
    """The bundled sample job's input: INPUT's default."""
    return str(resources.files("tokenmill").joinpath("data/sample.parquet"))


# ---- the running stack ----------------------------------------------------------------------------------

def stack_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="the stack's state directory (default: $TOKENMILL_DATA/stack)")


def default_state_dir() -> Path:
    from storage.db import data_dir

    return data_dir() / "stack"


def running_stack_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment of the running stack (its state file), if any; {} otherwise."""
    state_file = (getattr(args, "state_dir", None) or default_state_dir()) / "stack.json"
    return json.loads(state_file.read_text()).get("env", {}) if state_file.exists() else {}


def use_stack(args: argparse.Namespace) -> None:
    """Fill environment variables this shell leaves unset from the running stack's state file, if any."""
    if getattr(args, "stack_command", None) == "up":
        return
    for name, value in running_stack_env(args).items():
        os.environ.setdefault(name, value)
    if getattr(args, "database_url", None):
        os.environ["TOKENMILL_DATABASE_URL"] = args.database_url
