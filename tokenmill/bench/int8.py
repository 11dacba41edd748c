"""`bench int8`: do int8 GEMMs (AMX-int8 / AVX-512 VNNI) pay over the engine's bfloat16 ones at the model's shapes?

Each shape and row count times, interleaved so machine load hits them alike, best of N:
- bfloat16: the engine's own linear (`engine.kernels.cpu_gemm.Linear`, prepacked: AMX where it runs) and `F.linear`;
- int8 GEMMs alone: `torch._int_mm` (int8 x int8 -> int32) and oneDNN's quantized linear
  (`torch.ops.onednn.qlinear_pointwise`, as inductor's x86 quantization uses it), where this torch has it;
- W8A8 in full, as vLLM's compressed-tensors W8A8 (dynamic symmetric per-token activations, per-channel weights):
  quantize the bfloat16 activations, the int8 GEMM, dequantize to bfloat16; the best of the GEMMs above;
- for reference, `quantized::linear_dynamic` (fbgemm/x86, per-tensor activations, float32 in and out).
The decode ratio sums a step's times: every row through each layer shape once per layer, and the LM head."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ROWS = (16, 64, 256, 1024)
PAYS = 1.7  # issue #44: int8 must run a decode step's GEMMs at least this much faster to be worth W8A8
MIN_TIMED_SECONDS = 2e-3  # each timed sample repeats a call until it lasts about this long

ENGINE, FLINEAR, INT_MM, QLINEAR, DYNAMIC = "bf16 engine", "bf16 F.linear", "_int_mm", "onednn qlinear", "dynamic"
TOTAL_INT_MM, TOTAL_QLINEAR = "W8A8 _int_mm", "W8A8 qlinear"
GEMMS = (INT_MM, QLINEAR)
TOTALS = (TOTAL_INT_MM, TOTAL_QLINEAR)


@dataclass(frozen=True)
class Shape:
    name: str
    out_features: int
    in_features: int
    per_step: int  # calls per decode step: once per layer, or once (the LM head)


@dataclass
class Timing:
    shape: Shape
    rows: int
    seconds: dict[str, float] = field(default_factory=dict)  # path -> best seconds per call

    def rate(self, path: str) -> float:
        """GFLOP/s (bfloat16) or GOP/s (int8) of `path`; 0 where it did not run."""
        seconds = self.seconds.get(path)
        return 2 * self.rows * self.shape.out_features * self.shape.in_features / seconds / 1e9 if seconds else 0.0

    def best(self, paths: tuple[str, ...]) -> str | None:
        timed = [path for path in paths if path in self.seconds]
        return min(timed, key=self.seconds.get) if timed else None


def model_shapes(config: dict) -> list[Shape]:
    """The dense GEMMs of a Llama-style decoder, fused as the engine runs them."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    qkv = (config["num_attention_heads"] + 2 * config.get("num_key_value_heads", config["num_attention_heads"]))
    return [Shape("qkv", qkv * head_dim, hidden, layers),
            Shape("o", hidden, config["num_attention_heads"] * head_dim, layers),
            Shape("gate_up", 2 * config["intermediate_size"], hidden, layers),
            Shape("down", hidden, config["intermediate_size"], layers),
            Shape("lm_head", config["vocab_size"], hidden, 1)]


# ---- W8A8: the quantization (vLLM compressed-tensors' scheme) and its GEMMs ---------------------------------

def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights, one float32 scale per output channel (row)."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    return (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 activations: one float32 scale per row, shape (rows, 1)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12).div_(127)
    return torch.div(x, scale).round_().to(torch.int8), scale  # |x| / scale <= 127 (+ rounding): no clamp needed


class W8A8:
    """One weight, quantized once, and x -> x @ weight.T (bfloat16 out) through each int8 GEMM this torch has."""

    def __init__(self, weight: torch.Tensor, rows_hint: int | None = None) -> None:
        self.qweight, self.scale = quantize_per_channel(weight)
        self.qweight_t = self.qweight.t()  # _int_mm takes (in, out); the transposed view ran faster than a copy
        self.qlinear_weight, self.qlinear_skip = None, None
        try:
            hint = [rows_hint, weight.shape[1]] if rows_hint else None
            self.qlinear_weight = torch.ops.onednn.qlinear_prepack(self.qweight, hint)
            self.zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
            self.qlinear_gemm(torch.zeros(1, weight.shape[1], dtype=torch.int8))
        except (AttributeError, RuntimeError, NotImplementedError) as error:
            self.qlinear_weight, self.qlinear_skip = None, f"{type(error).__name__}: {str(error).splitlines()[0]}"

    def int_mm_gemm(self, qx: torch.Tensor) -> torch.Tensor:
        return torch._int_mm(qx, self.qweight_t)

    def qlinear_gemm(self, qx: torch.Tensor) -> torch.Tensor:
        """int8 x int8 with the per-channel weight scales applied inside oneDNN, bfloat16 out."""
        return torch.ops.onednn.qlinear_pointwise(qx, 1.0, 0, self.qlinear_weight, self.scale, self.zero_points,
                                                  None, 1.0, 0, torch.bfloat16, "none", [], "")

    def int_mm(self, x: torch.Tensor) -> torch.Tensor:
        qx, x_scale = quantize_per_token(x)
        return torch.mul(self.int_mm_gemm(qx), x_scale).mul_(self.scale).to(torch.bfloat16)

    def qlinear(self, x: torch.Tensor) -> torch.Tensor:
        qx, x_scale = quantize_per_token(x)
        return self.qlinear_gemm(qx).mul_(x_scale)


def dynamic_linear(weight: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor] | None, str | None]:
    """`quantized::linear_dynamic` on a per-channel int8 copy of `weight` (float32 in and out), or a reason."""
    try:
        _, scale = quantize_per_channel(weight)
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated, but this op still takes only them
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(weight.float(), scale.double(), zero, 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qweight, None)
        return (lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)), None
    except (AttributeError, RuntimeError, NotImplementedError) as error:
        return None, f"{type(error).__name__}: {str(error).splitlines()[0]}"


# ---- timing -------------------------------------------------------------------------------------------------

def _calls_per_sample(fn: Callable[[], object]) -> int:
    started = time.perf_counter()
    fn()
    return max(1, int(MIN_TIMED_SECONDS / max(time.perf_counter() - started, 1e-7)))


def interleaved_best(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best seconds per call of each path, the paths taking turns in every repeat."""
    for fn in paths.values():
        fn()  # warm-up: kernels built, buffers allocated
    calls = {name: _calls_per_sample(fn) for name, fn in paths.items()}
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(repeats):
        for name, fn in paths.items():
            started = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - started) / calls[name])
    return best


def measure(shapes: list[Shape], rows: tuple[int, ...] = ROWS, repeats: int = 10, seed: int = 0,
            skipped: dict[str, str] | None = None) -> list[Timing]:
    """Every path at every shape and row count; `skipped` collects path -> why it did not run."""
    from engine.kernels.cpu_gemm import Linear

    skipped = {} if skipped is None else skipped
    generator = torch.Generator().manual_seed(seed)
    timings = []
    with torch.inference_mode():
        for shape in shapes:
            weight = torch.randn(shape.out_features, shape.in_features, generator=generator) * 0.05
            engine = Linear(shape.in_features, shape.out_features, bias=False, dtype=torch.bfloat16)
            engine.weight.copy_(weight)
            engine.pack()
            dynamic, reason = dynamic_linear(weight)
            if reason:
                skipped[DYNAMIC] = reason
            for count in rows:
                x = torch.randn(count, shape.in_features, generator=generator).to(torch.bfloat16)
                w8a8 = W8A8(weight, count)
                if w8a8.qlinear_weight is None:
                    skipped[QLINEAR] = w8a8.qlinear_skip
                paths = _paths(x, engine, w8a8, dynamic)
                timings.append(Timing(shape, count, interleaved_best(paths, repeats)))
    return timings


def _paths(x: torch.Tensor, engine, w8a8: W8A8, dynamic) -> dict[str, Callable[[], object]]:
    qx, _ = quantize_per_token(x)
    x_float = x.float()
    paths = {ENGINE: lambda: engine(x), FLINEAR: lambda: F.linear(x, engine.weight),
             INT_MM: lambda: w8a8.int_mm_gemm(qx), TOTAL_INT_MM: lambda: w8a8.int_mm(x)}
    if w8a8.qlinear_weight is not None:
        paths |= {QLINEAR: lambda: w8a8.qlinear_gemm(qx), TOTAL_QLINEAR: lambda: w8a8.qlinear(x)}
    if dynamic is not None:
        paths[DYNAMIC] = lambda: dynamic(x_float)
    return paths


def step_seconds(timings: list[Timing], rows: int, paths: tuple[str, ...]) -> float:
    """A decode step's GEMM seconds at `rows`: each shape by its fastest of `paths`, times its calls per step."""
    return sum(t.seconds[t.best(paths)] * t.shape.per_step for t in timings if t.rows == rows)


def decode_ratios(timings: list[Timing], paths: tuple[str, ...]) -> dict[int | str, float]:
    """rows -> bf16 engine step seconds over `paths`' (above 1: int8 is faster), and "overall": every row count's
    steps summed (FLOP-weighted: the ratio of the total GEMM rates)."""
    rows = sorted({t.rows for t in timings})
    bf16 = {count: step_seconds(timings, count, (ENGINE,)) for count in rows}
    int8 = {count: step_seconds(timings, count, paths) for count in rows}
    ratios: dict[int | str, float] = {count: bf16[count] / int8[count] for count in rows}
    ratios["overall"] = sum(bf16.values()) / sum(int8.values())
    return ratios


def conclusion(overall_total: float) -> str:
    if overall_total >= PAYS:
        return f"int8 pays here: {overall_total:.2f}x >= {PAYS}x, so W8A8 is worth building"
    return f"int8 does not pay here: {overall_total:.2f}x < {PAYS}x, so no W8A8"


def int8_table(timings: list[Timing]):
    from rich.table import Table

    table = Table("GEMM (out x in)", "rows", "bf16 engine GFLOP/s", "bf16 F.linear", "_int_mm GOP/s",
                  "onednn qlinear", "best int8 GEMM", "W8A8 total", "dynamic (per-tensor)", "int8 GEMM / bf16",
                  "W8A8 / bf16", title="int8 against bfloat16 at the model's GEMM shapes")
    for t in timings:
        gemm, total = t.best(GEMMS), t.best(TOTALS)
        table.add_row(f"{t.shape.name} ({t.shape.out_features} x {t.shape.in_features})", str(t.rows),
                      *[f"{t.rate(path):.0f}" if path in t.seconds else "-" for path in (ENGINE, FLINEAR, INT_MM,
                                                                                        QLINEAR)],
                      f"{t.rate(gemm):.0f} ({gemm})", f"{t.rate(total):.0f}",
                      f"{t.rate(DYNAMIC):.0f}" if DYNAMIC in t.seconds else "-",
                      f"{t.rate(gemm) / t.rate(ENGINE):.2f}x", f"{t.rate(total) / t.rate(ENGINE):.2f}x")
    return table


def decode_table(timings: list[Timing]):
    from rich.table import Table

    gemm, total = decode_ratios(timings, GEMMS), decode_ratios(timings, TOTALS)
    keys = list(gemm)
    table = Table("decode step (every row through every shape)", *[f"{k} rows" if k != "overall" else "overall"
                                                                  for k in keys],
                  title="int8 over the bf16 engine, a decode step's GEMMs (FLOP-weighted)")
    table.add_row("best int8 GEMM alone", *[f"{gemm[k]:.2f}x" for k in keys])
    table.add_row("W8A8 total (quantize + GEMM + dequantize)", *[f"{total[k]:.2f}x" for k in keys])
    return table
