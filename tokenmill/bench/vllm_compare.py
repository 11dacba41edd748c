"""vLLM as a comparator: its CPU build runs from its own virtualenv (`make vllm-venv`), in a subprocess,
on the same token ids and forced output lengths tokenmill gets. Also batch-1 time per output token for
both, and the CPU the numbers were taken on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.throughput import Result
from tokenmill.bench.workload import Workload

WORKER = Path(__file__).with_name("vllm_worker.py")
INSTALL_HINT = "vLLM is not installed: run `make vllm-venv` (or ops/vllm_venv.sh) to build .vllm-venv"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass
class VllmRun:
    result: Result
    output_token_ids: list[list[int]]
    batch1_tpot: float | None  # seconds per output token, one request alone


def vllm_python(venv: str | None = None) -> Path | None:
    """The vLLM virtualenv's interpreter: `venv`, $TOKENMILL_VLLM_VENV, or .vllm-venv here or in the repo."""
    candidates = [venv or os.environ.get("TOKENMILL_VLLM_VENV") or ".vllm-venv"]
    if not venv and not os.environ.get("TOKENMILL_VLLM_VENV"):
        candidates.append(str(Path(__file__).resolve().parents[2] / ".vllm-venv"))
    for candidate in candidates:
        python = Path(candidate) / "bin" / "python"
        if python.exists():
            return python.absolute()  # not resolve(): the venv's python is a link to the base interpreter
    return None


def vllm_env(threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_vllm(python: Path, model_dir, workload: Workload, dtype: str, threads: int, max_model_len: int,
             label: str = "vLLM", enable_prefix_caching: bool = True,
             batch1: tuple[list[int], int] | None = None, timeout: float = 3600) -> VllmRun:
    """vLLM's wall time on the workload, and its batch-1 time per output token when `batch1` (a prompt and
    a number of output tokens) is given."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({
            "model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
            "enable_prefix_caching": enable_prefix_caching, "prompts": workload.prompts,
            "output_lens": workload.output_lens, "batch1_prompt": batch1[0] if batch1 else None,
            "batch1_tokens": batch1[1] if batch1 else None}))
        proc = run_in_own_group([str(python), str(WORKER), str(spec_path), str(result_path)], vllm_env(threads),
                                tmp, timeout)
        if proc.returncode != 0 or not result_path.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(result_path.read_text())
    note = f"vLLM {result['version']} (its venv; start-up {result['startup_seconds']:.0f} s)"
    return VllmRun(Result(label, dtype, result["seconds"], workload.useful_tokens, note),
                   result["output_token_ids"], result.get("batch1_tpot"))


def run_in_own_group(command: list[str], env: dict[str, str], cwd: str, timeout: float
                     ) -> subprocess.CompletedProcess:
    """Run vLLM in a process group of its own and kill whatever of it is left when it returns: its engine-core
    process must not linger and take CPU from the next system measured."""
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def tokenmill_batch1_tpot(model: str, dtype: str, prompt: list[int], tokens: int, repeats: int = 3,
                          **engine_kwargs) -> float:
    """Same measure as vLLM's worker: (time of `tokens` tokens - time of 1 token) / (tokens - 1), best of
    `repeats`, one request alone."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=False, **engine_kwargs)

    def timed(n: int) -> float:
        started = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - started

    timed(2)  # warm-up
    return min((timed(tokens) - timed(1)) / (tokens - 1) for _ in range(repeats))


def cpu_description() -> str:
    """The CPU model, its flags that matter for these kernels, and torch's CPU capability."""
    import torch

    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == "unknown CPU":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [flag for flag in CPU_FLAGS if flag in flags]
    return (f"{name}, {os.cpu_count()} cores, flags: {' '.join(have) or 'none of ' + ' '.join(CPU_FLAGS)}; "
            f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(outputs identical token for token, outputs compared)."""
    return sum(x == y for x, y in zip(a, b, strict=True)), len(a)


def model_context(model_dir) -> int:
    """The model's context length, what tokenmill takes as max_model_len by default."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 2048)
