"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..N-1 as child processes (`python -m
engine.distributed.worker`), joins them in a group, and stops them with the engine. A rank that dies is noticed at
the next step (`check`), which raises `RankFailure` after stopping the others; ranks end themselves when rank 0
ends or dies."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.group import COLLECTIVE_TIMEOUT, RankFailure, TensorParallelGroup

log = logging.getLogger("tokenmill.engine")

STOP_WAIT_S = 10.0  # a rank's time to exit after rank 0 says stop, before it is killed


def ranks_device(setting: str, rank: int) -> torch.device:
    """Rank r's device: cuda:r, or the CPU."""
    from engine.model_loader import pick_device

    device = pick_device(setting)
    return torch.device("cuda", rank) if device.type == "cuda" else device


def cpu_threads_per_rank(config: EngineConfig) -> int:
    """`num_threads`, or else the host's cores shared out over the ranks."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // world_size_of(config))


def world_size_of(config: EngineConfig) -> int:
    """The engine's ranks: tensor-parallel ranks times pipeline stages."""
    return config.tensor_parallel_size * config.pipeline_parallel_size


def start_ranks(config: EngineConfig, hf_config, model_dir: Path, max_model_len: int) -> tuple[Ranks, type]:
    """Rank 0 of a multi-process engine: the model checked against the split, the other ranks started, and the
    runner class rank 0 runs (engine/distributed/pipeline.py's `rank_classes`)."""
    from engine.distributed.pipeline import check_stages, rank_classes
    from engine.distributed.sharding import check_divisible

    check_divisible(hf_config, config.tensor_parallel_size)
    check_stages(hf_config.num_hidden_layers, config.pipeline_parallel_size)
    runner_class = rank_classes(config)[1]
    return Ranks.start(config, model_dir, max_model_len), runner_class


class Ranks:
    """Rank 0's group and the processes of the other ranks."""

    group: TensorParallelGroup

    def __init__(self, processes: list[subprocess.Popen], kind: str = "tensor-parallel") -> None:
        self.processes = processes
        self.stopped = False
        self.kind = kind  # "tensor-parallel" or "pipeline-parallel", for messages

    @classmethod
    def start(cls, config: EngineConfig, model_dir: Path, max_model_len: int) -> Ranks:
        from engine.distributed.pipeline import rank_classes

        world_size = world_size_of(config)
        device = ranks_device(config.device, 0)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(config))
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=COLLECTIVE_TIMEOUT,
                                 wait_for_workers=False)  # on a free port
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory that holds the `engine` package
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        processes = []
        for rank in range(1, world_size):
            spec = {"rank": rank, "world_size": world_size, "port": store.port, "parent": os.getpid(),
                    "config": config.to_dict(), "model_dir": str(model_dir), "max_model_len": max_model_len}
            processes.append(subprocess.Popen([sys.executable, "-m", "engine.distributed.worker", json.dumps(spec)],
                                              env=env))
        ranks = cls(processes, "pipeline-parallel" if config.pipeline_parallel_size > 1 else "tensor-parallel")
        try:
            ranks._wait_ready(store)
            ranks.group = rank_classes(config)[0](0, world_size, store, device)
        except BaseException:
            ranks.kill()
            raise
        ranks.group.check = ranks.check
        log.info("%s: %d ranks (%s) on %s", ranks.kind, world_size,
                 ", ".join(str(p.pid) for p in processes), device)
        return ranks

    def _wait_ready(self, store: dist.Store) -> None:
        """Until every rank has connected to the store; a rank that exits first fails the start."""
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        waiting = {rank: process for rank, process in enumerate(self.processes, start=1)}
        while waiting:
            for rank, process in list(waiting.items()):
                if store.check([f"ready/{rank}"]):
                    del waiting[rank]
                elif process.poll() is not None:
                    raise RankFailure(f"{self.kind} rank {rank} exited with code {process.returncode} while starting")
            if time.monotonic() > deadline:
                raise RankFailure(f"{self.kind} ranks {sorted(waiting)} did not start in time")
            time.sleep(0.05)

    def check(self) -> None:
        """Raise `RankFailure` (after stopping the others) when a rank has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.poll() is not None:
                self.kill()
                raise RankFailure(f"{self.kind} rank {rank} (pid {process.pid}) exited with code "
                                  f"{process.returncode}; the engine is down")

    def stop(self) -> None:
        """Tell the ranks to exit, and kill those that do not within STOP_WAIT_S."""
        if self.stopped:
            return
        try:
            if all(p.poll() is None for p in self.processes):
                self.group.send(None)
        except Exception:  # a rank is gone already: the others are killed below
            pass
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        self.stopped = True
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
