"""The command line: every command explains itself; model and generate work on the real model."""

import json
import re
import subprocess
import sys

import pytest

from tests.test_bench_plots import assert_plots
from tokenmill.cli import build_parser


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tokenmill", *args], capture_output=True, text=True,
                          timeout=timeout)


def subcommands(parser, prefix=()):
    for action in parser._actions:
        if action.__class__.__name__ == "_SubParsersAction":
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from subcommands(sub, (*prefix, name))


def test_every_command_has_help_text():
    parser = build_parser()
    found = list(subcommands(parser))
    assert {("model", "pull"), ("model", "list"), ("generate",), ("bench", "throughput")} <= {p for p, _ in found}
    for path, sub in found:
        text = sub.format_help()
        assert sub.description or sub.format_usage(), path
        assert len(text) > 120, (path, text)


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["bench", "throughput", "--help"]])
def test_help_runs_without_loading_heavy_libraries(args):
    code = ("import sys; from tokenmill.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("False")
    assert "usage: tokenmill" in proc.stdout


@pytest.mark.real_model  # the converted bundled models
def test_model_list_shows_the_bundled_model_ready():
    proc = run_cli("model", "list")
    assert proc.returncode == 0, proc.stderr
    assert "smollm2-135m" in proc.stdout and "ready" in proc.stdout


@pytest.mark.real_model
def test_generate_prints_completions_and_throughput():
    proc = run_cli("generate", "What is the capital of France?", "--max-tokens", "12", "--threads", "2")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout and "generated tok/s" in proc.stdout


def test_bad_arguments_fail_with_a_message():
    proc = run_cli("generate", "hi", "--model", "nope")
    assert proc.returncode == 2 and "unknown model 'nope'" in proc.stderr


@pytest.mark.real_model
def test_bench_throughput_short_run_prints_all_systems(tmp_path):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    proc = run_cli("bench", "throughput", "--num-prompts", "4", "--min-tokens", "4", "--max-tokens", "8",
                   "--dtypes", "float32", "--json", str(out), "--plots", str(plots), "--batch1-tokens", "0",
                   "--profile", timeout=600)
    assert proc.returncode == 0, proc.stderr
    for system in ("HF static batching", "HF continuous batching", "tokenmill", "dense matmul floor"):
        assert system in proc.stdout
    assert "% of limit" in proc.stdout and "the model's matmuls alone reach" in proc.stdout
    profile = re.search(r"where the step time goes: (\d+) steps", proc.stdout)
    assert profile and int(profile.group(1)) >= 8, proc.stdout  # at least one step per output token
    for category in ("GEMMs", "attention", "norms, RoPE, activation", "sampling", "scheduler, batch building"):
        assert category in proc.stdout
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["HF static batching", "HF continuous batching", "tokenmill",
                                           "dense matmul floor"]
    assert all(r["tokens_per_second"] > 0 for r in rows)
    assert_plots(plots, proc.stdout)


@pytest.mark.real_model
def test_bench_peak_times_the_models_gemm_shapes_and_prints_the_limit(tmp_path):
    out = tmp_path / "peak.json"
    proc = run_cli("bench", "peak", "--dtypes", "float32", "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr
    for shape in ("qkv (960 x 576)", "o (576 x 576)", "gate_up (3072 x 576)", "down (576 x 1536)",
                  "lm_head (49152 x 576)", "square 2048 matmul"):
        assert shape in proc.stdout
    (result,) = json.loads(out.read_text())
    assert result["dtype"] == "float32" and 0.2e9 < result["flops_per_token"] < 0.3e9
    assert result["limit"] == max(result["limits"].values()) > 0


def test_no_bench_module_shadows_the_standard_library() -> None:
    """vLLM's workers run as scripts from tokenmill/bench/, whose folder comes first on their sys.path: a
    `profile.py` there once broke vLLM's own `import cProfile`."""
    from pathlib import Path

    names = {path.stem for path in (Path(__file__).resolve().parents[1] / "tokenmill" / "bench").glob("*.py")}
    assert not names & set(sys.stdlib_module_names)


def test_the_step_profile_counts_self_time_so_its_shares_add_up() -> None:
    import time as clock

    from tokenmill.bench.step_profile import StepProfile

    class Engine:
        def step(self):
            clock.sleep(0.02)
            self.inner()

        def inner(self):
            clock.sleep(0.03)

        def outside(self):
            clock.sleep(0.01)

    profile = StepProfile()
    profile.wrap(Engine, "step", "host", step=True)
    profile.wrap(Engine, "inner", "gemm")
    profile.wrap(Engine, "outside", "gemm")
    engine = Engine()
    engine.outside()  # outside a step: not counted
    for _ in range(2):
        engine.step()
    profile.undo()
    assert profile.steps == 2 and set(profile.seconds) == {"host", "gemm"}
    # the inner call's 0.06 s is not counted in its caller's share too (that would be 0.10 s)
    assert 0.04 <= profile.seconds["host"] < 0.09 and 0.06 <= profile.seconds["gemm"] < 0.11
    assert not hasattr(Engine.step, "__wrapped__"), "undo leaves the original"


def test_the_step_profile_moves_a_calls_own_kernel_seconds_to_their_categories() -> None:
    import time as clock

    from tokenmill.bench.step_profile import ATTENTION, GEMMS, MODEL_OTHER, StepProfile

    class Layers:  # as cpu_kernel.DecodeLayers: running totals of its kernels' seconds
        seconds = [0.0, 0.0, 0.0]

        def run(self):
            clock.sleep(0.05)
            self.seconds[0] += 0.03  # as if 30 ms of the 50 were GEMMs and 10 attention
            self.seconds[1] += 0.01

    class Engine:
        def step(self):
            Layers().run()

    profile = StepProfile()
    profile.wrap(Engine, "step", "host", step=True)
    profile.wrap(Layers, "run", MODEL_OTHER, split=lambda layers: layers.seconds)
    Engine().step()
    profile.undo()
    assert profile.seconds[GEMMS] == pytest.approx(0.03) and profile.seconds[ATTENTION] == pytest.approx(0.01)
    assert 0.01 <= profile.seconds[MODEL_OTHER] < 0.04  # the call's 50 ms less the 40 moved out
