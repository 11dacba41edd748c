"""Command-line options shared by the command modules, and what they default to: engine and sampling settings,
the job database, the running stack's state directory and environment, the bundled sample input."""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

from engine.settings import ENGINE_SETTINGS, CommandLineEngine, EngineSettings
from workers.kv_sharing import DEFAULT_TTL_S as KV_SHARING_TTL_S

DATABASE_HELP = ("SQLAlchemy database URL, e.g. postgresql+psycopg://user@host/db (default: $TOKENMILL_DATABASE_URL, "
                 "else SQLite at $TOKENMILL_DATA/tokenmill.db, $TOKENMILL_DATA defaulting to ~/.local/share/tokenmill)")


def add_engine_options(parser: argparse.ArgumentParser, lora: str | None = None,
                       defaults: dict[str, Any] | None = None) -> None:
    """The engine's settings, one flag per knob of `engine.settings.ENGINE_SETTINGS`; `lora` adds the LoRA knobs,
    with --enable-lora's default: "adapters" (on when --lora-modules names some: `run`), "single-rank" (on unless
    -tp or -pp > 1: `worker`). `defaults`: this command's own defaults, by dest (its help says so)."""
    group = parser.add_argument_group(
        "engine", "On CPUs, C kernels (built once into ~/.cache/tokenmill/kernels) run decode attention and the "
                  "layers' norms, RoPE and SiLU, and the GEMMs (bfloat16 on CPUs with AMX or avx512_bf16, "
                  "float32 on AVX-512 where faster), a decode step's layers in one C call where all of these run; "
                  "TOKENMILL_CPU_ATTENTION_KERNEL=0 and TOKENMILL_CPU_LAYER_OPS=0 switch them back to torch ops, "
                  "TOKENMILL_CPU_DECODE_LAYERS=0 to the Python loop over the layers, "
                  "TOKENMILL_BF16_GEMM=amx|avx512|onednn and TOKENMILL_FLOAT32_GEMM=mkl|onednn|avx512 force a "
                  "dtype's GEMM kernel.")
    for knob in ENGINE_SETTINGS:
        if knob.lora and lora is None:
            continue
        kwargs = knob.argparse_kwargs(lora)
        if defaults and knob.dest in defaults:
            kwargs["default"] = defaults[knob.dest]
        group.add_argument(*knob.flags, **kwargs)
    group.set_defaults(lora_default=lora)


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """The engine settings the command's flags give, typed (no KV secret: `load_engine` adds the deployment's where
    an engine is made). ValueError for flags that contradict each other."""
    command = CommandLineEngine(getattr(args, "lora_default", None), len(lora_modules(args)))
    settings = EngineSettings.from_command_line(vars(args), command)
    if getattr(args, "kv_sharing", None) is not None:  # `worker` only: add_kv_sharing_options
        settings = settings.replace(**kv_sharing_kwargs(args))
    if settings.get("kv_transfer_config"):
        from workers.kv_sharing import deployment_kv_secret

        deployment_kv_secret()  # checked now, before any job or node is made (ValueError when unset or short)
    return settings


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags' engine settings as keywords for an engine made here (`LLM(**...)`), the KV secret added."""
    from workers.kv_sharing import with_kv_secret

    return with_kv_secret(dict(engine_settings(args)))


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
