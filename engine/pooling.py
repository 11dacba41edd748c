"""Sentence-transformers pooling read from a model directory: how token states become one vector (mean, CLS or
last token), whether it is normalised, and the longest input (`max_seq_length`). Plain data; torch only in
`pool`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

POOLING_MODES = ("mean", "cls", "last")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"
    normalize: bool = True
    max_seq_length: int | None = None  # None: the model's position limit

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PoolingConfig:
        """From modules.json (+ its Pooling module's config.json) and sentence_bert_config.json; a directory
        without them pools by mean and normalises, as sentence-transformers does for a plain encoder."""
        modules = _read_json(model_dir / "modules.json") or []
        mode, normalize = "mean", not modules
        for module in modules:
            kind = str(module.get("type", ""))
            if kind.endswith("models.Pooling"):
                mode = _pooling_mode(_read_json(model_dir / module.get("path", "") / "config.json") or {})
            elif kind.endswith("models.Normalize"):
                normalize = True
        sbert = _read_json(model_dir / "sentence_bert_config.json") or {}
        return cls(mode, normalize, sbert.get("max_seq_length"))


def _pooling_mode(config: dict) -> str:
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    if config.get("pooling_mode_cls_token"):
        return "cls"
    if config.get("pooling_mode_lasttoken"):
        return "last"
    used = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
    raise ValueError(f"unsupported sentence-transformers pooling {used}: tokenmill pools by mean, CLS or last token")


def _read_json(path: Path) -> dict | list | None:
    return json.loads(path.read_text()) if path.is_file() else None


def pool(hidden: torch.Tensor, row_of_token: torch.Tensor, row_starts: torch.Tensor, lengths: torch.Tensor,
         mode: str) -> torch.Tensor:
    """hidden: [tokens, size], rows packed one after another -> [rows, size] float32, without padding."""
    import torch

    if mode == "cls":
        return hidden[row_starts].float()
    if mode == "last":
        return hidden[row_starts + lengths - 1].float()
    sums = hidden.new_zeros(len(lengths), hidden.shape[1], dtype=torch.float32)
    return sums.index_add_(0, row_of_token, hidden.float()) / lengths[:, None]


@dataclass(frozen=True)
class PoolingParams:
    """Per-request embedding settings, named as vLLM's. `dimensions`: the leading dimensions of a Matryoshka
    model's vector (renormalised); `normalize`: None keeps the model's own; `truncate`: cut an input over the
    model's max_seq_length to it (else it is refused)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate: bool = False

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
