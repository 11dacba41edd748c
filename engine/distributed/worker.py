"""A rank other than 0 (tensor-parallel, or a pipeline stage): `python -m engine.distributed.worker SPEC` (started
by `Ranks.start`). It loads its shard or stage, agrees on the memory plan, then runs each step rank 0 sends until
told to stop. It exits when rank 0 does: on a stop message, on a collective that fails, or when its parent process
is gone."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

PARENT_POLL_S = 1.0


def watch_parent(parent: int) -> None:
    """End this process once `parent` is gone (it may have been killed without a word)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(spec: dict) -> None:
    watch_parent(spec["parent"])
    import torch
    import torch.distributed as dist

    from engine.config import EngineConfig
    from engine.distributed.group import COLLECTIVE_TIMEOUT, RankFailure
    from engine.distributed.pipeline import rank_classes
    from engine.distributed.ranks import cpu_threads_per_rank, ranks_device
    from engine.hf_files import load_config
    from engine.memory_plan import plan_kv_cache

    rank, world_size = spec["rank"], spec["world_size"]
    config = EngineConfig.from_kwargs(**spec["config"])
    device = ranks_device(config.device, rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(config))
    store = dist.TCPStore("127.0.0.1", spec["port"], world_size, False, timeout=COLLECTIVE_TIMEOUT)
    store.set(f"ready/{rank}", "1")
    group_class, runner_class = rank_classes(config)
    group = group_class(rank, world_size, store, device)
    model_dir = Path(spec["model_dir"])
    runner = runner_class(config, model_dir, load_config(model_dir), spec["max_model_len"], tp=group)
    runner.initialize_kv_cache(plan_kv_cache(config, runner.shape, runner.probe))  # the pool all ranks agree on
    try:
        while (step := group.receive()) is not None:
            runner.run_remote(step)
    except RankFailure:
        logging.getLogger("tokenmill.engine").warning("rank %d: rank 0 or a stage is gone; exiting", rank)
        sys.exit(1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {json.loads(sys.argv[1])['rank']} "
                                                      "%(levelname)s %(name)s: %(message)s")
    main(json.loads(sys.argv[1]))
