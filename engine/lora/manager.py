"""Adapters in memory: loaded ones kept in host memory (LRU, `max_cpu_loras`), and `max_loras` slots on the model's
device holding the adapters a step runs. Each (layer, projection) has one stack of every slot's A and B, so a step's
LoRA product for a projection is one gathered kernel call over the whole batch (`slots`: each row's slot, -1 for the
base model)."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.adapter import PROJECTIONS, LoRAAdapter, load_adapter, projection_shapes
from engine.lora.kernels import lora_apply
from engine.lora.request import LoRARequest

log = logging.getLogger("tokenmill.lora")


def adapter_for(manager: LoRAManager | None, request: LoRARequest | LoRAAdapter | None) -> LoRAAdapter | None:
    """The adapter a request runs with (None: the base model), loaded by the engine's `manager` (None: the engine
    serves no adapters), or as given when loaded already (`LLMEngine.load_adapter`); ValueError, saying why, when it
    cannot be served."""
    if request is None:
        return None
    if not isinstance(request, LoRARequest | LoRAAdapter):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
    if manager is None:
        name = request.lora_name if isinstance(request, LoRARequest) else request.name
        raise ValueError(f"request names LoRA adapter {name!r} but the engine serves none: "
                         "start it with enable_lora=True")
    return request if isinstance(request, LoRAAdapter) else manager.load(request)


@dataclass
class LoRAStep:
    """The running step's rows: each one's slot (-1: base), and the projections some row's adapter changes."""

    slots: torch.Tensor
    projections: frozenset[str]


class LoRAManager:
    def __init__(self, hf_config, max_loras: int, max_rank: int, max_cpu_loras: int | None,
                 device: torch.device) -> None:
        self.hf_config = hf_config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.device = device
        shapes = projection_shapes(hf_config)
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(hf_config.num_hidden_layers):
            for projection in PROJECTIONS:
                shape = shapes[projection]
                rows = len(shape.part_sizes) * max_rank
                self.stacks[(layer, projection)] = (
                    torch.zeros(max_loras, rows, shape.in_features, device=device),
                    torch.zeros(max_loras, rows, shape.out_features, device=device))
        self.resident: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recently used first
        self.slot_projections: list[frozenset[str]] = [frozenset()] * max_loras
        self.loaded: OrderedDict[tuple, LoRAAdapter] = OrderedDict()  # host-memory cache, least recently used first
        self.step: LoRAStep | None = None
        self._pointer_tables: dict[frozenset[str], tuple] = {}  # the stacks' pointers per set of projections run
        self._load_lock = threading.Lock()  # `loaded`, from the engine thread and the shards' threads
        self.num_loads = 0  # adapters read from disk
        self.num_activations = 0  # adapters copied into a device slot

    @classmethod
    def for_model(cls, model, config, hf_config, device: torch.device) -> LoRAManager | None:
        """The manager of `model`'s adapters, attached to it, where the engine config enables LoRA; else None."""
        if not config.enable_lora:
            return None
        manager = cls(hf_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras, device)
        model.attach_lora(manager)
        return manager

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The request's adapter, from the host cache or its directory (ValueError when it cannot be served). A
        directory whose files changed since it was loaded is read again. Any thread may call it (a job's shard
        loads its rows' adapters before the engine thread adds them)."""
        key = (request.lora_int_id, request.lora_name, request.lora_path, _files_signature(request.lora_path))
        with self._load_lock:
            adapter = self.loaded.get(key)
            if adapter is None:
                adapter = load_adapter(request.lora_path, request.lora_name, self.hf_config, self.max_rank)
                self.num_loads += 1
                log.info("loaded LoRA adapter %r (rank %d, %.1f MiB) from %s", request.lora_name, adapter.rank,
                         adapter.num_bytes / 2**20, request.lora_path)
                self.loaded[key] = adapter
                while len(self.loaded) > self.max_cpu_loras:
                    self.loaded.popitem(last=False)
            self.loaded.move_to_end(key)
            return adapter

    def begin_step(self, items: list, item_rows: dict, num_rows: int) -> None:
        """Make the step's adapters resident and set each row's slot; `items` (engine.batch.BatchItem) and their rows
        in the flat batch, by seq_id. The scheduler admits at most `max_loras` adapters at once, so they all fit."""
        rows = [(item.seq.lora, item_rows[item.seq.seq_id].first, item_rows[item.seq.seq_id].count) for item in items]
        wanted = {adapter.digest: adapter for adapter, _, _ in rows if adapter is not None}
        if not wanted:
            self.step = None
            return
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, over max_loras {self.max_loras}")
        slot_of = {digest: self._activate(adapter, wanted) for digest, adapter in wanted.items()}
        slots = [-1] * num_rows
        for adapter, first, count in rows:
            if adapter is not None:
                slots[first:first + count] = [slot_of[adapter.digest]] * count
        projections = frozenset().union(*(self.slot_projections[slot] for slot in slot_of.values()))
        self.step = LoRAStep(torch.tensor(slots, dtype=torch.long, device=self.device), projections)

    def decode_layers_args(self):
        """The step's LoRA for the one-call decoder layers (cpu_kernel.DecodeLayers), or None where its products
        run in torch (CPU kernel off, or the stacks are not on the CPU)."""
        step = self.step
        if step is None or self.device.type != "cpu" or os.environ.get("TOKENMILL_CPU_LORA_KERNEL", "1") == "0":
            return None
        tables = self._pointer_tables.get(step.projections)
        if tables is None:
            layers = 1 + max(layer for layer, _ in self.stacks)
            count = layers * len(PROJECTIONS)
            a, b = (ctypes.c_void_p * count)(), (ctypes.c_void_p * count)()
            for (layer, projection), (stack_a, stack_b) in self.stacks.items():
                if projection in step.projections:
                    index = layer * len(PROJECTIONS) + PROJECTIONS.index(projection)
                    a[index], b[index] = stack_a.data_ptr(), stack_b.data_ptr()
            rank = (ctypes.c_int64 * len(PROJECTIONS))(*(self.stacks[(0, p)][0].shape[1] for p in PROJECTIONS))
            tables = self._pointer_tables[step.projections] = (a, b, rank)
        from engine.kernels.cpu_kernel import DecodeLoRA

        return DecodeLoRA(step.slots, self.max_loras, *tables)

    def end_step(self) -> None:
        self.step = None

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each row's adapter's LoRA product of x, for this step's rows (nothing without adapters)."""
        step = self.step
        if step is None or projection not in step.projections:
            return
        lora_a, lora_b = self.stacks[(layer, projection)]
        lora_apply(x, out, lora_a, lora_b, step.slots)

    def _activate(self, adapter: LoRAAdapter, keep: dict[str, LoRAAdapter]) -> int:
        slot = self.resident.get(adapter.digest)
        if slot is not None:
            self.resident.move_to_end(adapter.digest)
            return slot
        if len(self.resident) < self.max_loras:
            slot = len(self.resident)
        else:  # evict the least recently used adapter this step does not run
            victim = next(digest for digest in self.resident if digest not in keep)
            slot = self.resident.pop(victim)
        for (layer, projection), (stack_a, stack_b) in self.stacks.items():
            weights = adapter.weights.get((layer, projection))
            if weights is None:
                stack_a[slot].zero_()
                stack_b[slot].zero_()
            else:
                stack_a[slot].copy_(weights[0], non_blocking=True)
                stack_b[slot].copy_(weights[1], non_blocking=True)
        self.slot_projections[slot] = frozenset(projection for _, projection in adapter.weights)
        self.resident[adapter.digest] = slot
        self.num_activations += 1
        return slot


def _files_signature(path: str) -> tuple:
    directory = Path(path)
    signature = []
    for name in ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"):
        try:
            stat = (directory / name).stat()
        except OSError:
            continue
        signature.append((name, stat.st_size, stat.st_mtime_ns))
    return tuple(signature)
