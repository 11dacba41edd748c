"""Shared fixtures: the real bundled model, its tokenizer and its Hugging Face twin. Tests are marked by what
they use: `real_model` (the bundled SmolLM2-135M, or Gemma 3 270M) and `service` (PostgreSQL, SeaweedFS, the stack),
from their fixtures or by hand, and `slow` (Triton's CPU interpreter); `make unit` runs the tests with none of them."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)
os.environ.setdefault("TOKENMILL_CPU_KV_CACHE_SPACE", "1")  # GiB: engines left to their default pool (4 GiB)
# fill it over a file, and two lanes must fit in 5 GB each

pytest_plugins = ["tests.lanes"]  # the lanes of `make test` and its closing report

REAL_MODEL_FIXTURES = {"model_dir", "llm_engine", "gemma_dir"}  # tokenizer, hf_model and the engines built on them
# use these (gemma_dir: the bundled Gemma 3, tests/engine/test_gemma3.py)
SERVICE_FIXTURES = {"pg_databases", "seaweedfs", "stack"}
SLOW_FILES = {"test_triton_kernels.py", "test_triton_identity.py", "test_gpu_check.py"}  # Triton's interpreter


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if used & REAL_MODEL_FIXTURES:
            item.add_marker(pytest.mark.real_model)
        if used & SERVICE_FIXTURES or "postgresql" in params.values():  # tests that ask for PostgreSQL by name
            item.add_marker(pytest.mark.service)
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


_file_started: dict[Path, float] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test file (once its last test has let go of the file's fixtures), and after any test that leaves
    RSS above TRIM_ABOVE_MIB: end the engine threads, drop its engines and hand freed heap back to the OS (glibc
    keeps it otherwise), so the suite's RSS stays near one test's peak; with TOKENMILL_TEST_RSS=FILE, log there the
    lane, RSS and the seconds of each file."""
    _file_started.setdefault(item.path, time.monotonic())
    result = yield
    if nextitem is None or nextitem.path != item.path:
        _release_memory(item.path, time.monotonic() - _file_started.pop(item.path))
    elif _rss_mib()[0] > TRIM_ABOVE_MIB:  # engines a test built and let go (`tokenmill run` in process) pile up
        _release_heap()
    return result


TRIM_ABOVE_MIB = 2048


def _rss_mib() -> tuple[int, int]:
    from tests.lanes import rss_mib  # loaded by now, as a plugin (an import at the top would come first)

    return rss_mib()


def _release_heap() -> None:
    """Hand the freed heap back to the OS (engine/malloc_tuning.py keeps it otherwise); the engines' threads were
    closed by their owners (a job's run, a test's fixture)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _release_memory(path: Path, seconds: float) -> None:
    if lora_reference := sys.modules.get("tests.engine.lora_reference"):
        lora_reference.forget_merged_models()  # 0.55 GB each
    _release_heap()
    if log := os.environ.get("TOKENMILL_TEST_RSS"):
        rss, peak = _rss_mib()
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {path.relative_to(Path(__file__).parent.parent)} "
                    f"rss={rss} MiB peak={peak} MiB seconds={seconds:.1f}\n")


@pytest.fixture(scope="session")
def model_dir():
    from engine.model_loader import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")  # 0.55 GB once loaded: freed with the file that used it
def hf_model(model_dir):
    """The float32 HF model, loaded only if a reference must be computed (tests/engine/references.py)."""
    from transformers import AutoModelForCausalLM

    from tests.engine.references import LazyModel

    return LazyModel(model_dir, lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


@pytest.fixture
def sqlite_sessions(tmp_path):
    """A migrated SQLite database of this test's own, for tests that need no service."""
    from storage import db, migrate

    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate.upgrade(url)
    factory = db.session_factory(db.make_engine(url))
    yield factory
    factory.kw["bind"].dispose()
