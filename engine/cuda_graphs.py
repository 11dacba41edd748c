"""Decode steps replayed as CUDA graphs (CUDA only; the runner builds this only on CUDA with the Triton backend).

A decode-only step of n sequences runs the graph captured for the smallest padded size >= n, over fixed input
buffers: the step's ids, positions, slots, context lengths and block tables are copied into them first. Padding
rows get slot -1 (nothing is written to the pool) and context length 0 (attention gives zeros), so they change
nothing. All sizes are captured at start-up over padding-only buffers (which touch no KV), largest first, in
one shared memory pool. `capture=False` runs the same padded buffers eagerly: how the padding is tested on CPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend, StepBatch

if TYPE_CHECKING:
    from engine.kv_cache_interface import ModelShape

log = logging.getLogger("tokenmill.engine")

CAPTURE_SIZES = (1, 2, 4, 8, *range(16, 257, 16))


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded decode sizes worth capturing: those below `max_num_seqs`, and the first one at or above it."""
    below = [s for s in CAPTURE_SIZES if s < max_num_seqs]
    return below + [s for s in CAPTURE_SIZES if s >= max_num_seqs][:1]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the graph's output buffer, [size, hidden]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, attention: AttentionBackend, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.attention = attention
        self.capture = capture
        self.sizes = capture_sizes(max_num_seqs)
        rows = self.sizes[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, max_blocks_per_seq, dtype=torch.long, device=device)
        self.graphs: dict[int, _Captured] = {}
        self.pool = None  # the graphs' shared memory pool, from the first capture
        self.replays = 0

    @classmethod
    def build(cls, model: torch.nn.Module, attention: AttentionBackend, shape: ModelShape, max_num_seqs: int,
              capture: bool = True) -> DecodeGraphs:
        """The buffers for `shape`'s longest sequences, and every size captured (unless `capture` is off)."""
        graphs = cls(model, attention, max_num_seqs, shape.max_blocks_per_seq, shape.device, capture)
        if capture:
            graphs.capture_all()
        return graphs

    def capture_all(self) -> None:
        started = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
            self._capture(size)
        log.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s", self.sizes,
                 time.perf_counter() - started)

    def can_run(self, batch: StepBatch) -> bool:
        """A decode step the graphs hold: no prefill, no LoRA rows (the graphs were captured without adapters)."""
        lora = getattr(self.model, "lora", None)
        return (batch.prefill is None and 0 < batch.num_decodes <= self.sizes[-1]
                and batch.decode_block_tables.shape[1] <= self.block_tables.shape[1]
                and (lora is None or lora.step is None))

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states of the step's tokens, [num_decodes, hidden]: a view of the graph's output buffer,
        valid until the next replay."""
        n = batch.num_decodes
        size = next(s for s in self.sizes if s >= n)
        self._load(batch, size)
        if self.capture:
            self.graphs[size].graph.replay()
            hidden = self.graphs[size].hidden
        else:
            static = self._static_batch(size)
            self.attention.begin_step(static)
            hidden = self._forward(static)
        self.replays += 1
        return hidden[:n]

    def _load(self, batch: StepBatch, size: int) -> None:
        n, width = batch.num_decodes, batch.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.context_lens[:n].copy_(batch.decode_context_lens)
        self.block_tables[:n, :width].copy_(batch.decode_block_tables)
        self.slot_mapping[n:size].fill_(-1)
        self.context_lens[n:size].zero_()

    def _static_batch(self, size: int) -> StepBatch:
        return StepBatch(input_ids=self.input_ids[:size], positions=self.positions[:size],
                         slot_mapping=self.slot_mapping[:size], num_decodes=size,
                         decode_context_lens=self.context_lens[:size], decode_block_tables=self.block_tables[:size],
                         decode_max_context_len=0, prefill=None, sample_indices=self.input_ids[:0])

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        return self.model(batch.input_ids, batch.positions, self.attention.forward)

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        static = self._static_batch(size)
        self.attention.begin_step(static)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(static)  # warm-up: kernels compile here, never during capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(static)
        self.pool = graph.pool()
        self.graphs[size] = _Captured(graph, hidden)
