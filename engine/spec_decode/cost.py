"""What a step costs as a function of its token count: measured once from the model's own dense matmuls
(on CPUs the curve is far from flat or smooth: kernels change with the row count), then corrected online
by the steps the engine actually runs."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

CALIBRATED_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64)


TIMED_LAYERS = 4  # the layers are alike: a few are timed and scaled to all (a 30-layer bfloat16 model without
# native bfloat16 took 90 s to calibrate in batch-invariant mode)
TIMED_VOCAB_SHARE = 8  # and 1/8 of the LM head's rows (a large vocabulary's head is most of the dense FLOPs at 1 row)


def time_dense(model, rows: int, repeats: int = 2) -> float:
    """Seconds of one pass of the model's projections and LM head over `rows` tokens (best of `repeats`), from
    its first TIMED_LAYERS layers and a share of its LM head, scaled to the whole."""
    first = model.layers[0]
    layers = list(model.layers)[:TIMED_LAYERS]
    scale = len(model.layers) / len(layers)
    head = model.lm_head_weight
    head_part = head[:max(head.shape[0] // TIMED_VOCAB_SHARE, 1)]
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
            for layer in layers:
                layer.qkv_proj(x)
                layer.o_proj(q)
                layer.gate_up_proj(x)
                layer.down_proj(h)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timed = time.perf_counter()
            F.linear(x, head_part)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            head_seconds = (time.perf_counter() - timed) * head.shape[0] / head_part.shape[0]
            best = min(best, (timed - started) * scale + head_seconds)
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
        computed = getattr(model.layers[0].qkv_proj, "rows_computed", lambda rows: rows)
        by_shape: dict[int, float] = {}  # row counts the GEMMs pad to one shape (batch-invariant tiles) cost the same
        timed_rows = [rows for rows in CALIBRATED_ROWS if rows <= max_rows] or [1]
        for rows in timed_rows:
            if computed(rows) not in by_shape:
                by_shape[computed(rows)] = time_dense(model, rows)
        return cls({rows: by_shape[computed(rows)] for rows in timed_rows})

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
