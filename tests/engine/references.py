"""Hugging Face references recorded once: what HF's float32 model says (a greedy output's verdict, beam search's
beams) depends only on its inputs, so it is kept in tests/engine/references/NAME.json beside the versions of torch
and transformers that made it, and the suite looks it up instead of running HF again. An input not recorded is
computed as before; `TOKENMILL_RECORD_REFERENCES=1` adds what was computed to the file. Each run,
tests/engine/test_references.py recomputes a few recorded entries of each file and fails if HF now says otherwise.

The model itself loads only when something must be computed (`LazyModel`)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DIR = Path(__file__).parent / "references"
RECORD_ENV = "TOKENMILL_RECORD_REFERENCES"


def versions() -> dict[str, str]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def fingerprint(model_dir: Path) -> str:
    """The model's name and its weights' size: the key part that says which weights a reference is of."""
    weights = sum(path.stat().st_size for path in sorted(Path(model_dir).glob("*.safetensors")))
    return f"{Path(model_dir).name}:{weights}"


class LazyModel:
    """A Hugging Face model loaded at its first use, with its fingerprint known before."""

    def __init__(self, model_dir: Path, load: Callable[[], Any]) -> None:
        self.model_dir, self.fingerprint, self._load, self._model = model_dir, fingerprint(model_dir), load, None

    @property
    def generation_config(self):
        from transformers import GenerationConfig

        return self._model.generation_config if self._model else GenerationConfig.from_pretrained(self.model_dir)

    @property
    def model(self):
        if self._model is None:
            self._model = self._load()
        return self._model

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class Recording:
    """One file of references: {digest of the key: {"key": ..., "value": ...}}."""

    def __init__(self, name: str) -> None:
        self.path = DIR / f"{name}.json"
        self.entries: dict[str, dict] = self._read().get("entries", {})

    def _read(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        if digest in self.entries:
            return self.entries[digest]["value"]
        value = compute()
        if os.environ.get(RECORD_ENV):
            self.entries[digest] = {"key": key, "value": value}
            self._merge_into_file(digest)
        return value

    def _merge_into_file(self, digest: str) -> None:
        """Add one entry to the file, locked: two xdist workers may record into it at once."""
        DIR.mkdir(exist_ok=True)
        with open(Path(tempfile.gettempdir()) / "tokenmill-references.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            entries = self._read().get("entries", {})
            entries[digest] = self.entries[digest]
            text = json.dumps({"versions": versions(), "entries": dict(sorted(entries.items()))}, indent=0)
            self.path.with_suffix(".tmp").write_text(text + "\n")
            self.path.with_suffix(".tmp").replace(self.path)


_recordings: dict[str, Recording] = {}


def recording(name: str) -> Recording:
    if name not in _recordings:
        _recordings[name] = Recording(name)
    return _recordings[name]
