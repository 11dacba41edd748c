"""`tokenmill bench lora`: the mixed chat workload on the base model alone and with LoRA adapters mixed over its
requests (request i on adapter i mod N, every adapter resident: max_loras >= N), through tokenmill and through vLLM's
CPU build (from its own venv, in a subprocess, as `bench throughput --against vllm` runs it)."""

from __future__ import annotations

import gc
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.workload import Workload

MAX_LOG_LINES = 25


@dataclass
class LoraResult:
    system: str
    dtype: str
    seconds: float | None  # None: the system did not run, `note` says why
    useful_tokens: int
    adapters: int  # adapters mixed over the requests (0: the base model alone)
    note: str = ""
    output_token_ids: list[list[int]] | None = field(default=None, repr=False)

    @property
    def tokens_per_second(self) -> float | None:
        return self.useful_tokens / self.seconds if self.seconds else None


def adapters_home(model: str, rank: int) -> Path:
    """Where the bench keeps its adapters (made once, see lora_adapters.make_adapters)."""
    from engine.model_loader import tokenmill_home

    return tokenmill_home() / "bench-lora-adapters" / f"{Path(model).name}-rank{rank}"


def prompt_adapters(num_prompts: int, num_adapters: int) -> list[int]:
    """Each request's adapter: round-robin, so every adapter has the same share and every batch mixes them."""
    return [index % num_adapters for index in range(num_prompts)]


def tokenmill_run(model_dir, workload: Workload, dtype: str, adapters: list[Path], threads: int, max_loras: int,
                  max_lora_rank: int) -> LoraResult:
    """tokenmill on the workload: without adapters the engine as `bench throughput` runs it (LoRA off); with them,
    LoRA on and the requests mixed over the adapters, every adapter loaded by the warm-up."""
    from engine import LLM, LoRARequest, SamplingParams

    lora = dict(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank) if adapters else {}
    llm = LLM(model=str(model_dir), dtype=dtype, num_threads=threads, **lora)
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    llm.generate(workload.prompts[:1] * max(1, len(requests)), SamplingParams(max_tokens=2, temperature=0),
                 lora_request=requests or None)  # warm-up
    llm.engine.kv_manager.pool.reset_prefix_cache()
    per_prompt = [requests[i] for i in prompt_adapters(len(workload.prompts), len(requests))] if requests else None
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in workload.output_lens]
    started = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, lora_request=per_prompt)
    seconds = time.perf_counter() - started
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    for ids, length in zip(tokens, workload.output_lens, strict=True):
        if len(ids) != length:
            raise RuntimeError(f"tokenmill generated {len(ids)} tokens, expected {length}")
    note = "every adapter loaded by the warm-up" if adapters else "LoRA off"
    del llm, outputs
    gc.collect()
    return LoraResult(system_name("tokenmill", len(adapters)), dtype, seconds, workload.useful_tokens, len(adapters),
                      note, tokens)


def system_name(engine: str, adapters: int) -> str:
    return f"{engine} + {adapters} LoRA" if adapters else f"{engine} base"


def vllm_run(python: Path, model_dir, workload: Workload, dtype: str, adapters: list[Path], threads: int,
             max_loras: int, max_lora_rank: int, timeout: float = 3600) -> LoraResult:
    """vLLM's CPU build on the same token ids and lengths (vllm_worker.py); a failed run is a row whose note has
    the last line of vLLM's error."""
    from tokenmill.bench import vllm_compare

    name = system_name("vLLM", len(adapters))
    spec = {"model": str(model_dir), "dtype": dtype, "max_model_len": vllm_compare.model_context(model_dir),
            "enable_prefix_caching": True, "prompts": workload.prompts, "output_lens": workload.output_lens,
            "batch1_prompt": None, "batch1_tokens": None}
    if adapters:
        spec["lora"] = {"adapters": [str(path) for path in adapters], "max_loras": max_loras,
                        "max_lora_rank": max_lora_rank,
                        "prompt_adapters": prompt_adapters(len(workload.prompts), len(adapters))}
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-lora-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        proc = vllm_compare.run_in_own_group([str(python), str(vllm_compare.WORKER), str(spec_path),
                                              str(result_path)], vllm_compare.vllm_env(threads), tmp, timeout)
        if proc.returncode != 0 or not result_path.exists():
            return LoraResult(name, dtype, None, workload.useful_tokens, len(adapters),
                              f"failed (exit {proc.returncode}): {failure_reason(proc.stdout + proc.stderr)}")
        result = json.loads(result_path.read_text())
    note = f"vLLM {result['version']} (start-up {result['startup_seconds']:.0f} s)"
    return LoraResult(name, dtype, result["seconds"], workload.useful_tokens, len(adapters), note,
                      result["output_token_ids"])


def failure_reason(log: str) -> str:
    """The most telling line of a failed run's output: its last error or exception, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()][-MAX_LOG_LINES:]
    errors = [line for line in lines if "Error" in line or "error:" in line or "Exception" in line]
    return (errors or lines or ["no output"])[-1][:300]


def agreement(a: LoraResult, b: LoraResult) -> str | None:
    """'same/total' outputs identical token for token between two runs of the same requests, when both ran."""
    if a.output_token_ids is None or b.output_token_ids is None:
        return None
    same = sum(x == y for x, y in zip(a.output_token_ids, b.output_token_ids, strict=True))
    return f"{same}/{len(a.output_token_ids)}"


def lora_table(results: list[LoraResult], title: str):
    """One row per system and dtype: tok/s, the adapters' share of the same engine's base, tokenmill over vLLM."""
    from rich.table import Table

    table = Table("system", "dtype", "adapters", "seconds", "useful tok/s", "% of base", "x vLLM", "note",
                  title=title)
    by_key = {(r.system, r.dtype): r for r in results}
    for r in results:
        engine = r.system.split(" ")[0]
        base = by_key.get((system_name(engine, 0), r.dtype))
        vllm = by_key.get((system_name("vLLM", r.adapters), r.dtype)) if engine == "tokenmill" else None
        rate = r.tokens_per_second
        share = f"{100 * rate / base.tokens_per_second:.0f}%" if rate and r.adapters and base and base.seconds \
            else "-"
        ratio = f"{rate / vllm.tokens_per_second:.2f}x" if rate and vllm and vllm.seconds else "-"
        table.add_row(r.system, r.dtype, str(r.adapters), f"{r.seconds:.1f}" if r.seconds else "-",
                      f"{rate:.1f}" if rate else "-", share, ratio, r.note)
    return table
