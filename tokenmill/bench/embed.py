"""`tokenmill bench embed`: held-out sentences of mixed length through tokenmill, sentence-transformers' encode
(its default batch size, and its best of a sweep) and vLLM's CPU build (from its own venv, where it loads), one
system after another in one process run, per dtype. Inputs over the model's max_seq_length are truncated, as
sentence-transformers does."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.bench import vllm_compare

ST_DEFAULT_BATCH = 32  # SentenceTransformer.encode's default batch_size
ST_SWEEP = (16, 64, 128)  # other batch sizes tried for its best, on a sample
SWEEP_SAMPLE = 1000  # at most; a quarter of the texts when fewer
log = logging.getLogger("tokenmill.bench.embed")
WORKER = Path(__file__).with_name("vllm_embed_worker.py")


@dataclass
class EmbedResult:
    system: str
    dtype: str
    seconds: float | None  # None: not run (note says why)
    sentences: int
    tokens: int
    note: str = ""
    min_cosine: float | None = None  # against tokenmill's vectors of the same dtype

    @property
    def sentences_per_s(self) -> float | None:
        return self.sentences / self.seconds if self.seconds else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


MATMUL_HIGH = "tokenmill, matmul high"  # float32 with float32_matmul_precision="high" (bfloat16 parts on AMX)


def run_tokenmill(model: str, texts: list[str], dtype: str, threads: int, batch_tokens: int,
                  precision: str = "highest") -> tuple[EmbedResult, np.ndarray]:
    from engine import LLM, PoolingParams

    llm = LLM(model=model, dtype=dtype, num_threads=threads, max_num_batched_tokens=batch_tokens,
              float32_matmul_precision=precision)
    params = PoolingParams(truncate=True)
    llm.embed(texts[:64], params)  # warm-up
    started = time.perf_counter()
    outputs = llm.embed(texts, params)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    vectors = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    if precision == "high":
        return EmbedResult(MATMUL_HIGH, dtype, seconds, len(texts), tokens,
                           "3 bfloat16 products per float32 product, AMX tiles"), vectors
    return EmbedResult("tokenmill", dtype, seconds, len(texts), tokens,
                       f"packed batches of <= {batch_tokens} tokens"), vectors


def matmul_high_runs() -> bool:
    """float32_matmul_precision="high" changes anything on this CPU: the AMX tiles run the float32 GEMMs."""
    from engine.kernels.cpu_gemm import GEMM_PROBE, split_runs

    return split_runs(GEMM_PROBE, GEMM_PROBE)


def sentence_transformer(model_dir: Path, dtype: str):
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return model.to(getattr(torch, dtype))


def st_encode(model, texts: list[str], batch_size: int) -> tuple[float, np.ndarray]:
    started = time.perf_counter()
    vectors = model.encode(texts, batch_size=batch_size, normalize_embeddings=True, convert_to_tensor=True,
                           show_progress_bar=False)
    seconds = time.perf_counter() - started
    return seconds, vectors.float().numpy()


def run_sentence_transformers(model_dir: Path, texts: list[str], dtype: str, tokens: int
                              ) -> tuple[list[EmbedResult], np.ndarray]:
    """Its default batch size on all texts, then the best batch size of a sweep on a sample, on all texts."""
    model = sentence_transformer(model_dir, dtype)
    st_encode(model, texts[:64], ST_DEFAULT_BATCH)  # warm-up
    seconds, vectors = st_encode(model, texts, ST_DEFAULT_BATCH)
    results = [EmbedResult("sentence-transformers", dtype, seconds, len(texts), tokens,
                           f"default batch_size={ST_DEFAULT_BATCH}")]
    sample = texts[:min(SWEEP_SAMPLE, max(len(texts) // 4, 64))]
    timings = {size: st_encode(model, sample, size)[0] for size in (ST_DEFAULT_BATCH, *ST_SWEEP)}
    best = min(timings, key=timings.get)
    seconds_best = st_encode(model, texts, best)[0]
    if best == ST_DEFAULT_BATCH or seconds < seconds_best:  # the default's own run counts: best of both
        best, seconds_best = ST_DEFAULT_BATCH, min(seconds, seconds_best)
    swept = ", ".join(f"{size}: {t:.1f}s" for size, t in timings.items())
    results.append(EmbedResult("sentence-transformers best", dtype, seconds_best, len(texts), tokens,
                               f"batch_size={best} (of {swept} on {len(sample)} texts)"))
    return results, vectors


def run_in_fresh_process(model: str, model_dir: Path, texts: list[str], dtype: str, threads: int,
                         batch_tokens: int, matmul_high: bool = True
                         ) -> tuple[list[EmbedResult], list[EmbedResult], np.ndarray]:
    """tokenmill (in float32 also with matmul precision "high" where `matmul_high` and the CPU has AMX, its cosines
    against the "highest" vectors), then sentence-transformers (with its cosines against tokenmill's vectors), in a
    process of their own for this dtype: run after another dtype's systems in one process, both came out about a
    third slower in bfloat16 (vLLM runs in its own process anyway)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure_in_process, model, model_dir, texts, dtype, threads, batch_tokens,
                           matmul_high).result()


def _measure_in_process(model: str, model_dir: Path, texts: list[str], dtype: str, threads: int,
                        batch_tokens: int, matmul_high: bool
                        ) -> tuple[list[EmbedResult], list[EmbedResult], np.ndarray]:
    import torch

    torch.set_num_threads(threads)
    ours, vectors = run_tokenmill(model, texts, dtype, threads, batch_tokens)
    results = [ours]
    if matmul_high and dtype == "float32" and matmul_high_runs():
        high, high_vectors = run_tokenmill(model, texts, dtype, threads, batch_tokens, precision="high")
        high.min_cosine = min_cosine(vectors, high_vectors)
        results.append(high)
    st_results, st_vectors = run_sentence_transformers(model_dir, texts, dtype, ours.tokens)
    for result in st_results:
        result.min_cosine = min_cosine(vectors, st_vectors)
    return results, st_results, vectors


VLLM_ATTEMPTS = 2  # vLLM's CPU build died now and then at start on an AMX Xeon ("terminate called without an
# active exception"); the same command ran on the next try


def run_vllm(model_dir: Path, texts: list[str], dtype: str, threads: int, tokens: int, venv: str | None
             ) -> tuple[EmbedResult, np.ndarray | None]:
    python = vllm_compare.vllm_python(venv)
    if python is None:
        return EmbedResult("vLLM", dtype, None, len(texts), tokens, "not installed (make vllm-venv)"), None
    failures = []
    for _ in range(VLLM_ATTEMPTS):
        result, vectors = _run_vllm_once(python, model_dir, texts, dtype, threads, tokens)
        if vectors is not None:
            if failures:
                result.note += f"; run again after: {failures[0].removeprefix('failed to run: ')}"
            return result, vectors
        failures.append(result.note)
    return result, None


def _run_vllm_once(python: Path, model_dir: Path, texts: list[str], dtype: str, threads: int, tokens: int
                   ) -> tuple[EmbedResult, np.ndarray | None]:
    with tempfile.TemporaryDirectory(prefix="tokenmill-vllm-embed-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({"model": str(model_dir), "dtype": dtype, "texts": texts}))
        proc = vllm_compare.run_in_own_group([str(python), str(WORKER), str(spec), str(result)],
                                             vllm_compare.vllm_env(threads), tmp, timeout=3600)
        if proc.returncode != 0 or not result.exists():
            output = (proc.stderr or proc.stdout).strip().splitlines()
            log.warning("vLLM (%s) exited %s:\n%s", dtype, proc.returncode, "\n".join(output[-20:]))
            last = output[-1:] or ["no output"]
            return EmbedResult("vLLM", dtype, None, len(texts), tokens, f"failed to run: {last[0][:120]}"), None
        data = json.loads(result.read_text())
    return (EmbedResult("vLLM", dtype, data["seconds"], len(texts), tokens,
                        f"vLLM {data['version']} (start-up {data['startup_seconds']:.0f} s)"),
            np.array(data["embeddings"], dtype=np.float32))


def embed_table(results: list[EmbedResult], title: str):
    from rich.table import Table

    table = Table("system", "dtype", "seconds", "sentences/s", "tokens/s", "x best other", "min cosine", "note",
                  title=title)
    for r in results:
        others = [o.sentences_per_s for o in results if o.dtype == r.dtype and o.sentences_per_s
                  and not o.system.startswith("tokenmill") and r.system.startswith("tokenmill")]
        ratio = f"{r.sentences_per_s / max(others):.2f}x" if others and r.sentences_per_s else "-"
        table.add_row(r.system, r.dtype, f"{r.seconds:.1f}" if r.seconds else "-",
                      f"{r.sentences_per_s:.1f}" if r.sentences_per_s else "-",
                      f"{r.tokens_per_s:.0f}" if r.tokens_per_s else "-", ratio,
                      f"{r.min_cosine:.6f}" if r.min_cosine is not None else "-", r.note)
    return table
