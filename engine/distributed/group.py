"""The ranks' process groups, built on a TCP store of their own (no default torch.distributed group, so one
process may hold several engines): NCCL (CUDA) or gloo (CPU) for the model's collectives, and a gloo group for
the step plans rank 0 sends, which a rank waits on for as long as the engine idles."""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a collective that waits this long has lost a rank
IDLE_TIMEOUT = timedelta(days=365)  # ranks wait for rank 0's next step while the engine idles


class RankFailure(RuntimeError):
    """A rank of a tensor-parallel engine died or stopped answering: the engine cannot step any more."""


class TensorParallelGroup:
    """One rank's view of the group. Collectives in the model's layers run only while `active` (inside a step
    that every rank runs); outside it a layer computes its own shard alone (the step-cost calibration times
    that)."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.active = False
        self.all_reduce_seconds = 0.0  # rank 0's time in the layers' all-reduces, for the benchmark
        self.all_reduce_calls = 0
        self.send_seconds = 0.0  # rank 0's time broadcasting steps
        self.check: Callable[[], None] | None = None  # rank 0: raises RankFailure when another rank has exited
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.compute = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size)
        else:
            self.compute = _gloo(dist.PrefixStore("compute", store), rank, world_size, COLLECTIVE_TIMEOUT)
        self.control = _gloo(dist.PrefixStore("control", store), rank, world_size, IDLE_TIMEOUT)

    @contextmanager
    def collectives(self) -> Iterator[None]:
        """The layers' all-reduces run inside (every rank runs the same step)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        started = time.perf_counter()
        _wait(self.compute.allreduce([x]))
        self.all_reduce_seconds += time.perf_counter() - started
        self.all_reduce_calls += 1
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` side by side (rank order) on rank 0; None elsewhere."""
        x = x.contiguous()
        outputs = [[torch.empty_like(x) for _ in range(self.world_size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        _wait(self.compute.gather(outputs, [x], options))
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None

    def fail_stop(self, run: Callable[..., Any], *args: Any) -> Any:
        """Rank 0: `run` a step the other ranks run too. Should it fail partway, the ranks are out of step (some
        wait in a collective it never reached): that is a `RankFailure`, the engine is down."""
        try:
            return run(*args)
        except RankFailure:
            raise
        except Exception as error:
            raise RankFailure(f"rank 0 failed in the middle of a step, leaving the other ranks out of step: "
                              f"{type(error).__name__}: {error}") from error

    def min_int(self, value: int) -> int:
        """The least of every rank's `value`."""
        tensor = torch.tensor([value], dtype=torch.long)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        _wait(self.control.allreduce([tensor], options))
        return int(tensor.item())

    def send(self, message: Any) -> None:
        """Rank 0: broadcast a picklable message (a step, or None to stop) to the other ranks."""
        if self.check is not None:
            self.check()
        started = time.perf_counter()
        data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.long))
        self._broadcast(data)
        self.send_seconds += time.perf_counter() - started

    def receive(self) -> Any:
        """Other ranks: the next message of rank 0 (waits while the engine idles)."""
        size = torch.zeros(1, dtype=torch.long)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        _wait(self.control.broadcast([tensor], options))


def _wait(work) -> None:
    try:
        work.wait()
    except RuntimeError as error:  # gloo and NCCL raise this (DistBackendError) when a peer is gone
        raise RankFailure(f"a tensor-parallel collective failed: {error}") from error


def _gloo(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)
