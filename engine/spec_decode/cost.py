"""What a step costs as a function of its token count: measured once from the model's own dense matmuls
(on CPUs the curve is far from flat or smooth: kernels change with the row count), then corrected online
by the steps the engine actually runs."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

CALIBRATED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64)


def time_dense(model, rows: int, repeats: int = 2) -> float:
    """Seconds of one pass of the model's projections and LM head over `rows` tokens (best of `repeats`)."""
    first = model.layers[0]
    dtype, device = first.qkv_proj.weight.dtype, first.qkv_proj.weight.device
    x = torch.randn(rows, model.config.hidden_size, dtype=dtype, device=device)
    h = torch.randn(rows, first.intermediate_size, dtype=dtype, device=device)
    q = torch.randn(rows, first.split[0], dtype=dtype, device=device)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            for layer in model.layers:
                layer.qkv_proj(x)
                layer.o_proj(q)
                layer.gate_up_proj(x)
                layer.down_proj(h)
            F.linear(x, model.lm_head_weight)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - started)
    return best


class StepCost:
    """cost(tokens) = calibrated dense time + the step overhead (attention, sampling, Python) learned online."""

    def __init__(self, dense_seconds: dict[int, float]) -> None:
        self.dense = dict(sorted(dense_seconds.items()))
        self.overhead = 0.0
        self.observed = 0

    @classmethod
    def calibrate(cls, model, max_rows: int) -> StepCost:
        time_dense(model, 1)  # warm-up
        return cls({rows: time_dense(model, rows) for rows in CALIBRATED_ROWS if rows <= max_rows} or
                   {1: time_dense(model, 1)})

    def dense_time(self, tokens: int) -> float:
        """Piecewise-linear between calibrated row counts, linear beyond the last."""
        points = list(self.dense.items())
        below = max((p for p in points if p[0] <= tokens), default=points[0])
        above = min((p for p in points if p[0] >= tokens), default=None)
        if above is None:  # extrapolate from the last two points (or proportionally)
            (r0, t0), (r1, t1) = points[-2] if len(points) > 1 else (0, 0.0), points[-1]
            return t1 + (tokens - r1) * (t1 - t0) / max(r1 - r0, 1)
        if above[0] == below[0]:
            return below[1]
        share = (tokens - below[0]) / (above[0] - below[0])
        return below[1] + share * (above[1] - below[1])

    def __call__(self, tokens: int) -> float:
        return self.dense_time(tokens) + self.overhead

    def observe(self, tokens: int, seconds: float) -> None:
        """A decode step of `tokens` tokens took `seconds`: refine the overhead estimate."""
        extra = max(seconds - self.dense_time(tokens), 0.0)
        self.observed += 1
        weight = max(1 / self.observed, 0.1)
        self.overhead += weight * (extra - self.overhead)
