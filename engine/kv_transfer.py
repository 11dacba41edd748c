"""Whole-block copies of the runner's KV pool: copy-on-write within it, and swap preemption's copies out to and back
from a host pool (engine/swap.py plans them). One indexed copy per pool tensor (each layer's K and V), never a
loop over blocks. The copies go through byte views, so they hold for any pool dtype (FP8 included). The KV
connector's blocks (engine/kv_connector/) are read and written here too, as bytes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.batch import PoolZeroing
from engine.step_types import KVLoad, StepInput

MIN_HOST_BLOCKS = 64  # the host tensors' first size; they double as higher host block ids are used


class KVTransfer:
    """`caches`: every pool tensor [num_kv_heads, num_blocks, block_size, head_dim]; `swap_space`: GiB of host
    memory for swapped-out blocks. The host tensors are allocated on first use and grown up to that size (pinned on
    CUDA), so an engine that never swaps takes no host memory for them."""

    def __init__(self, caches: list[torch.Tensor], zeroing: PoolZeroing, to_tensor: Callable[[list], torch.Tensor],
                 swap_space: float) -> None:
        self.caches = caches
        self.byte_caches = [cache.view(torch.uint8) for cache in caches]
        self.zeroing = zeroing
        self.to_tensor = to_tensor
        self.bytes_per_block = sum(cache[:, 0].nbytes for cache in caches)  # all layers, K and V, the pool's dtype
        self.num_host_blocks = int(swap_space * 2**30) // self.bytes_per_block
        self.pin = caches[0].device.type == "cuda"
        self.host: list[torch.Tensor] = []  # byte views' layout, blocks on dim 1
        self.host_capacity = 0

    def apply(self, step: StepInput) -> None:
        """A step's copies in their order: swap-outs read blocks before anything this step writes them (a freed
        block may be reused at once), copy-on-write copies, then swap-ins before the forward reads them."""
        if step.blocks_to_swap_out:
            self.swap_out(step.blocks_to_swap_out)
        if step.block_copies:
            self.copy_blocks(step.block_copies)
        if step.blocks_to_swap_in:
            self.swap_in(step.blocks_to_swap_in)
        if step.kv_loads:
            self.start_load_kv([load for loads in step.kv_loads.values() for load in loads])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers, K and V) before they are written."""
        src = self.to_tensor([s for s, _ in copies])
        dst = self.to_tensor([d for _, d in copies])
        self.zeroing.ensure(1 + max(d for _, d in copies))  # before the copy, or zeroing would undo it
        for cache in self.caches:
            cache[:, dst] = cache[:, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: device to host."""
        src = self.to_tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long)
        self._grow_host(1 + int(dst.max()))
        for cache, host in zip(self.byte_caches, self.host, strict=True):
            host.index_copy_(1, dst, cache.index_select(1, src).cpu())  # the gathered blocks, in one copy each

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: host to device, the device blocks fresh for their sequence."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long)
        dst = self.to_tensor([d for _, d in pairs])
        self.zeroing.ensure(1 + max(d for _, d in pairs))
        for cache, host in zip(self.byte_caches, self.host, strict=True):
            staged = host.index_select(1, src)
            if self.pin:  # an async copy from pinned memory; the caching host allocator keeps it until done
                staged = staged.pin_memory()
            cache.index_copy_(1, dst, staged.to(cache.device, non_blocking=True))

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's bytes as the KV connector stores them: every pool tensor's rows of it (each layer's K, then
        each layer's V), in the pool's own dtype (FP8 bytes included)."""
        if not block_ids:
            return []
        src = self.to_tensor(block_ids)
        parts = [cache.index_select(1, src).transpose(0, 1).reshape(len(block_ids), -1).cpu()
                 for cache in self.byte_caches]
        return [row.tobytes() for row in torch.cat(parts, dim=1).numpy()]

    def start_load_kv(self, loads: list[KVLoad]) -> None:
        """Write blocks the KV connector loaded (`read_blocks`' layout) into their fresh pool blocks."""
        dst = self.to_tensor([load.block_id for load in loads])
        self.zeroing.ensure(1 + max(load.block_id for load in loads))
        data = torch.frombuffer(bytearray(b"".join(load.payload for load in loads)), dtype=torch.uint8)
        data = data.view(len(loads), self.bytes_per_block)
        offset = 0
        for cache in self.byte_caches:
            heads, _, block_size, width = cache.shape
            size = heads * block_size * width
            rows = data[:, offset:offset + size].reshape(len(loads), heads, block_size, width).transpose(0, 1)
            cache.index_copy_(1, dst, rows.to(cache.device))
            offset += size

    def _grow_host(self, end: int) -> None:
        if end <= self.host_capacity:
            return
        if end > self.num_host_blocks:
            raise RuntimeError(f"host block {end - 1} is past the swap space's {self.num_host_blocks} blocks")
        capacity = min(max(end, 2 * self.host_capacity, MIN_HOST_BLOCKS), self.num_host_blocks)
        grown = []
        for index, cache in enumerate(self.byte_caches):
            shape = (cache.shape[0], capacity, *cache.shape[2:])
            host = torch.empty(shape, dtype=torch.uint8, pin_memory=self.pin)
            if self.host_capacity:
                host[:, :self.host_capacity] = self.host[index]
            grown.append(host)
        self.host, self.host_capacity = grown, capacity
