"""`bench throughput --profile`: where tokenmill's step time goes. The engine's own functions are wrapped by
timers for one run (self time: a wrapped call inside another is taken out of its caller's share), so the table
adds up to the steps' wall time: GEMMs, attention, norms/RoPE/activation, sampling, the other model ops
(embedding, KV writes, copies) and the scheduler, batch building and Python around them."""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence

GEMMS, ATTENTION, ELEMENTWISE = "GEMMs", "attention", "norms, RoPE, activation"
SAMPLING, MODEL_OTHER, HOST = "sampling", "other model ops (embedding, KV writes, copies)", \
    "scheduler, batch building, Python"
CATEGORIES = (GEMMS, ATTENTION, ELEMENTWISE, SAMPLING, MODEL_OTHER, HOST)
SPLIT = (GEMMS, ATTENTION, ELEMENTWISE)  # the order of cpu_kernel.DecodeLayers.seconds


class StepProfile:
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self._children: list[float] = []  # per open timed call: time spent in timed calls inside it
        self._restore: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, category: str, step: bool = False,
             split: Callable[[object], Sequence[float]] | None = None) -> None:
        """Time `owner.name` under `category`; `step`: it is the engine step, the only call timed at top level
        (the rest is timed only inside a step, not while the model loads). `split(instance)`: running totals of
        seconds the call itself spent in GEMMs, attention and elementwise kernels, moved out of `category`."""
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not (step or self._children):
                return original(*args, **kwargs)
            self._children.append(0.0)
            before = list(split(args[0])) if split else []
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - started
                inside = self._children.pop()
                if split:
                    for part, was, now in zip(SPLIT, before, split(args[0]), strict=True):
                        self.seconds[part] += now - was
                        inside += now - was
                self.seconds[category] += elapsed - inside
                if self._children:
                    self._children[-1] += elapsed
                else:
                    self.steps += 1

        setattr(owner, name, timed)
        self._restore.append((owner, name, original))

    def undo(self) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()

    def table(self, title: str):
        from rich.table import Table

        total = sum(self.seconds.values())
        table = Table("where", "seconds", "share", "ms per step", title=f"{title}: {self.steps} steps, {total:.1f} s")
        for category in CATEGORIES:
            seconds = self.seconds[category]
            table.add_row(category, f"{seconds:.2f}", f"{100 * seconds / total:.0f}%" if total else "-",
                          f"{1000 * seconds / self.steps:.1f}" if self.steps else "-")
        return table


@contextlib.contextmanager
def profiled() -> Iterator[StepProfile]:
    """Timers on the engine's functions (every instance) while inside; removed on the way out."""
    import torch.nn.functional as F

    from engine.attention.torch_backend import TorchAttention
    from engine.kernels import cpu_gemm, cpu_kernel
    from engine.llm_engine import LLMEngine
    from engine.model_runner import ModelRunner
    from engine.models import llama
    from engine.sampler import Sampler

    profile = StepProfile()
    profile.wrap(LLMEngine, "step", HOST, step=True)
    targets = [(ModelRunner, "execute", MODEL_OTHER), (ModelRunner, "prepare", HOST),
               (cpu_gemm.PackedWeight, "__call__", GEMMS), (F, "linear", GEMMS),
               (TorchAttention, "begin_step", ATTENTION), (TorchAttention, "forward", ATTENTION),
               (llama.RMSNorm, "forward", ELEMENTWISE), (Sampler, "sample", SAMPLING)]
    targets += [(cpu_kernel.LayerOps, name, ELEMENTWISE) for name in ("rms_norm", "rope_", "silu_mul")]
    try:
        for owner, name, category in targets:
            profile.wrap(owner, name, category)
        profile.wrap(cpu_kernel.DecodeLayers, "run", MODEL_OTHER, split=lambda layers: layers.seconds)
        yield profile
    finally:
        profile.undo()
