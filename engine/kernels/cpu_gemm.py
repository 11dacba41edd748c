"""Prepacked CPU GEMMs: each weight is reordered once into the kernel's blocked layout instead of on every
call, as vLLM's CPU build does. Our own kernels (engine/kernels/csrc/) sum every output in one fixed order
whatever the number of rows, so they are batch-invariant as they are:
- "amx": bfloat16 on Intel AMX tiles (amx_gemm.c; it streams the weight with prefetch, 1.2-2x oneDNN at decode
  batches of 1-64 rows on a 2-core Xeon; over `AMX_MAX_ROWS` rows, outside batch-invariant mode, oneDNN);
- "avx512": bfloat16 with avx512_bf16 dot products, and float32 with FMA, on AVX-512 vectors (avx512_gemm.c; on a
  2-core AMD EPYC 1.2-1.3x oneDNN at 4-64 rows in both dtypes, and on par up to 1,024 rows).
- "amx_split": float32 as bfloat16 parts on the AMX tiles (float32 matmul precision "high", for encoders that ask
  for it; `cpu_kernel.split_linear`), batch-invariant too.
bfloat16 runs on AMX where the CPU has it, else on AVX-512 with avx512_bf16, else through oneDNN
(`TOKENMILL_BF16_GEMM=amx|avx512|onednn`).
float32 runs through MKL (the same kernel as `F.linear`, bit for bit), oneDNN or our AVX-512 kernel, whichever is
fastest for that weight's shape on this CPU, timed once per shape when the model loads at decode batches of 4 and
32 rows; another kernel takes over from MKL only when it is clearly faster (`FAST_MARGIN`). On AMD EPYCs oneDNN
ran the 49152-row LM head twice as fast as MKL. Not timed at 64 rows: MKL's packed path runs only at exactly the
packed batch size (other sizes take plain sgemm on the unpacked weight), so timing at 64 chose MKL on an Intel
Xeon where oneDNN is 1.2-1.5x faster at the 20-50 rows decodes mostly have.
Where the ops are missing, `F.linear` runs.

Batch-invariant mode (`row_tile`): the kernel is fixed per dtype (not timed): our own where it runs, needing
nothing more; else every call runs in tiles of exactly `INVARIANT_ROWS` rows, the last one padded, so a row's
result never depends on how many rows came with it."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.home import tokenmill_home
from engine.kernels import cpu_kernel

log = logging.getLogger("tokenmill.cpu_gemm")

PACK_ROWS = 64  # the batch size the packed layout is tuned for; any number of rows runs
FAST_MARGIN = 1.1  # float32 leaves MKL only for a kernel this much faster: a clear win, the same on every run
TIMED_ROWS = (4, 32)  # a small and a typical decode batch
INVARIANT_ROWS = 64  # rows of every GEMM call in batch-invariant mode
GEMM_PROBE = 64  # a weight side every kernel takes
AMX_MAX_ROWS = 512  # more rows than this go to oneDNN (`F.linear`), except in batch-invariant mode
SPLIT_PARTS = 2  # bfloat16 parts per float32 in "amx_split": 3 products, PyTorch's "high" (3 parts: 6, as exact
# as float32, but slower than oneDNN's float32 on a 2-core Xeon)
ONEDNN_ROWS = 64  # oneDNN builds (JIT-compiles) a kernel per new row count: longer inputs are padded to a multiple


def _mkldnn_ok() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_rows(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """linear(x) with x's rows, past ONEDNN_ROWS, padded with zeros to a multiple of it: oneDNN compiles a kernel for
    every new shape (a 2-core Xeon, 2,000 x 384 @ 384 x 1,536 in bfloat16: 0.9 ms with a compiled kernel, 7.8 ms
    with a new row count; 23 ms with GELU fused), and prefills and encoder batches come in any number of rows."""
    rows = x.shape[0]
    if rows <= ONEDNN_ROWS or rows % ONEDNN_ROWS == 0 or x.dim() != 2:
        return linear(x)
    return linear(F.pad(x, (0, 0, 0, -rows % ONEDNN_ROWS)))[:rows]


def row_tiled(linear: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """linear(x) computed `tile` rows at a time, the last tile padded with zeros: the GEMM always sees one shape."""
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % tile)) if rows % tile else x.contiguous()
    parts = [linear(padded[start:start + tile]) for start in range(0, padded.shape[0], tile)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts))[:rows]


class PackedWeight:
    """`weight` (and `bias`) as a function x -> x @ weight.T + bias, through a prepacked kernel."""

    row_tile = 0  # > 0: batch-invariant, every call in tiles of this many rows

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, own_kernels: bool = True,
                 float32_split: bool = False) -> None:
        """`own_kernels=False`: oneDNN or MKL even where our kernels run (an encoder's batches of thousands of rows,
        where oneDNN fuses the activation into the GEMM). `float32_split`: a float32 weight runs as bfloat16 parts
        on the AMX tiles where they run ("amx_split": `cpu_kernel.split_linear`, float32 matmul precision
        "high")."""
        self.weight, self.bias, self.packed = weight, bias, None
        self.bias_f32 = bias.detach().float() if bias is not None else None
        if weight.device.type != "cpu" or weight.dim() != 2:
            return
        if weight.dtype == torch.bfloat16:
            self.kind = bfloat16_kernel(*weight.shape) if own_kernels else "onednn"
            if self.kind == "onednn" and not (_mkldnn_ok() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
                return
        elif weight.dtype == torch.float32 and float32_split and split_runs(*weight.shape):
            self.kind = "amx_split"
        elif weight.dtype == torch.float32 and torch._C.has_mkl:
            self.kind = float32_kernel(*weight.shape, own_kernels) if _mkldnn_ok() else "mkl"
        else:
            return
        self.packed = _pack(weight.detach(), self.kind)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile and x.dim() == 2:
            return row_tiled(self._linear, x, self.tile)
        return self._linear(x)

    @property
    def tile(self) -> int:
        """Rows per GEMM call in batch-invariant mode (0: untiled, also where the kernel is invariant itself)."""
        return 0 if self.invariant_kernel else self.row_tile

    @property
    def invariant_kernel(self) -> bool:
        """The kernel itself gives a row the same result in any batch: no tiles needed."""
        return self.packed is not None and self.kind in (*cpu_kernel.GEMM_KINDS, "amx_split")

    def set_row_tile(self, tile: int) -> None:
        """Batch-invariant mode on (`tile` rows per call) or off (0). On, float32 leaves the timed kernel choice
        (it may differ between processes) for a fixed one, repacking the weight if needed."""
        self.row_tile = tile
        if tile and self.packed is not None and self.weight.dtype == torch.float32 and self.kind != "amx_split" \
                and self.kind != (fixed := fixed_float32_kernel(*self.weight.shape)):
            self.kind, self.packed = fixed, _pack(self.weight.detach(), fixed)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None or x.dim() != 2 or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if self.kind == "amx" and x.shape[0] > AMX_MAX_ROWS and not self.row_tile:  # a long prefill: oneDNN, ~1.3x
            return onednn_rows(lambda rows: F.linear(rows, self.weight, self.bias), x)
        if self.kind in cpu_kernel.GEMM_KINDS:
            return cpu_kernel.gemm_linear(self.kind, x, self.packed, self.bias_f32, self.weight.shape[0])
        if self.kind == "amx_split":
            return cpu_kernel.split_linear(x, self.packed, self.bias_f32, self.weight.shape[0], SPLIT_PARTS)
        if self.kind == "onednn":
            return onednn_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none",
                                                                               [], ""), x)
        return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, PACK_ROWS)


def _pack(weight: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "amx_split":
        return cpu_kernel.split_pack(weight, SPLIT_PARTS)
    if kind in cpu_kernel.GEMM_KINDS:
        return cpu_kernel.gemm_pack(kind, weight)
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS)


def _run(kind: str, x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if kind in cpu_kernel.GEMM_KINDS:
        return cpu_kernel.gemm_linear(kind, x, packed, None, weight.shape[0])
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return torch.ops.mkl._mkl_linear(x, packed, weight, None, PACK_ROWS)


def split_runs(out_features: int, in_features: int) -> bool:
    """float32 as bfloat16 parts on the AMX tiles runs here for a weight of this shape (the AMX bfloat16 kernel's
    condition: the parts are its operands)."""
    return _own_kernel_runs("amx", torch.bfloat16, out_features, in_features)


def _own_kernel_runs(kind: str, dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    ready = cpu_kernel.amx_ready() if kind == "amx" else cpu_kernel.avx512_ready(dtype)
    return ready and cpu_kernel.gemm_fits(kind, out_features, in_features)


def _forced(variable: str, kinds: tuple[str, ...]) -> str:
    forced = os.environ.get(variable, "")
    if forced not in ("", *kinds):
        raise ValueError(f"{variable} must be {', '.join(kinds[:-1])} or {kinds[-1]}, not {forced!r}")
    return forced


BFLOAT16_KINDS = ("amx", "avx512", "onednn")
FLOAT32_KINDS = ("mkl", "onednn", "avx512")


def bfloat16_kernel(out_features: int, in_features: int) -> str:
    """"amx" where our AMX kernel runs and takes this shape, else "avx512" where the CPU has avx512_bf16, else
    "onednn"; `TOKENMILL_BF16_GEMM` forces one (where it runs)."""
    forced = _forced("TOKENMILL_BF16_GEMM", BFLOAT16_KINDS)
    for kind in ("amx", "avx512"):
        if forced in ("", kind) and _own_kernel_runs(kind, torch.bfloat16, out_features, in_features):
            return kind
    return "onednn"


def _forced_float32(out_features: int, in_features: int) -> str:
    """`TOKENMILL_FLOAT32_GEMM` where that kernel runs for this shape, else ""."""
    forced = _forced("TOKENMILL_FLOAT32_GEMM", FLOAT32_KINDS)
    runs = forced != "avx512" or _own_kernel_runs(forced, torch.float32, out_features, in_features)
    return forced if runs else ""


def float32_kernel(out_features: int, in_features: int, own_kernels: bool = True) -> str:
    """"mkl", "onednn" or "avx512" for a float32 weight of this shape: `TOKENMILL_FLOAT32_GEMM` (where it runs), or
    else the one measured fastest here (our kernel only with `own_kernels`)."""
    if forced := _forced_float32(out_features, in_features):
        return forced
    own = own_kernels and _own_kernel_runs("avx512", torch.float32, out_features, in_features)
    return fastest_float32_kernel(out_features, in_features, FLOAT32_KINDS if own else ("mkl", "onednn"))


def invariant_kernels(dtype: torch.dtype) -> bool:
    """Our own (invariant) GEMM kernels run `dtype` on this CPU, so batch-invariant mode needs no row tiles there
    (checked on the model's common shape, 32-column multiples)."""
    if dtype == torch.bfloat16:
        return bfloat16_kernel(GEMM_PROBE, GEMM_PROBE) in cpu_kernel.GEMM_KINDS
    return dtype == torch.float32 and fixed_float32_kernel(GEMM_PROBE, GEMM_PROBE) in cpu_kernel.GEMM_KINDS


def fixed_float32_kernel(out_features: int, in_features: int) -> str:
    """The float32 kernel of batch-invariant mode: `TOKENMILL_FLOAT32_GEMM`, else our AVX-512 kernel where it runs
    (invariant as it is), else oneDNN where it runs, else MKL."""
    if forced := _forced_float32(out_features, in_features):
        return forced
    if _own_kernel_runs("avx512", torch.float32, out_features, in_features):
        return "avx512"
    return "onednn" if _mkldnn_ok() else "mkl"


@functools.cache
def fastest_float32_kernel(out_features: int, in_features: int, kinds: tuple[str, ...] = ("mkl", "onednn")) -> str:
    """"mkl", or another of `kinds` where it is clearly faster (`FAST_MARGIN`) on this CPU for a float32 weight of
    this shape, summed over `TIMED_ROWS`: best of three calls each on random data, about 0.3 s for a small model's
    largest shape, once per shape and machine (the choice is kept in `$TOKENMILL_HOME/gemm-choices.json`, by CPU,
    flags, torch version and thread count: a worker's next start reads it)."""
    key = _choice_key(out_features, in_features, kinds)
    if (kept := _kept_choices().get(key)) in kinds:
        return kept
    kind = _time_float32_kernels(out_features, in_features, kinds)
    _keep_choice(key, kind)
    return kind


def _time_float32_kernels(out_features: int, in_features: int, kinds: tuple[str, ...]) -> str:
    weight = torch.randn(out_features, in_features)
    inputs = [torch.randn(rows, in_features) for rows in TIMED_ROWS]
    seconds = {}
    for kind in kinds:
        packed = _pack(weight, kind)
        seconds[kind] = 0.0
        for x in inputs:
            _run(kind, x, packed, weight)
            best = float("inf")
            for _ in range(3):
                started = time.perf_counter()
                _run(kind, x, packed, weight)
                best = min(best, time.perf_counter() - started)
            seconds[kind] += best
    fastest = min(seconds, key=seconds.get)
    kind = fastest if seconds[fastest] * FAST_MARGIN < seconds["mkl"] else "mkl"
    log.debug("float32 GEMM %dx%d: %s (%s)", out_features, in_features, kind,
              ", ".join(f"{name} {value * 1e3:.2f} ms" for name, value in seconds.items()))
    return kind


def _choices_path() -> Path:
    return tokenmill_home() / "gemm-choices.json"


@functools.cache
def _machine() -> str:
    """What a kernel's speed depends on besides the shape: the CPU, its flags, torch, and the threads."""
    cpuinfo = ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = hashlib.sha256(cpu_kernel._cpu_flags().encode()).hexdigest()[:12]
    return f"{model}|{flags}|torch {torch.__version__}|{torch.get_num_threads()} threads"


def _choice_key(out_features: int, in_features: int, kinds: tuple[str, ...]) -> str:
    return f"{_machine()}|{out_features}x{in_features}|{','.join(kinds)}"


def _kept_choices() -> dict[str, str]:
    try:
        kept = json.loads(_choices_path().read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) else {}


def _keep_choice(key: str, kind: str) -> None:
    """Best effort, atomic: two processes may write at once (one's entry may then be timed again later)."""
    path = _choices_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = {**_kept_choices(), key: kind}
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(kept, indent=0, sort_keys=True))
        os.replace(temporary, path)
    except OSError as error:
        log.debug("could not keep the GEMM choice in %s: %s", path, error)


class Linear(torch.nn.Linear):
    """`nn.Linear` that runs through a prepacked CPU kernel once `pack()` was called (after the weights
    are loaded and cast: packing copies them)."""

    packed: PackedWeight | None = None
    row_tile = 0  # batch-invariant mode without a packed kernel (e.g. CUDA): F.linear in tiles of this many rows

    def pack(self, own_kernels: bool = True, float32_split: bool = False) -> None:
        self.packed = PackedWeight(self.weight, self.bias, own_kernels, float32_split)

    def set_row_tile(self, tile: int) -> None:
        self.row_tile = tile
        if self.packed is not None:
            self.packed.set_row_tile(tile)

    def rows_computed(self, rows: int) -> int:
        """The rows a call with `rows` rows multiplies: in batch-invariant tiles, whole tiles."""
        tile = self.row_tile if self.packed is None else self.packed.tile
        return -(-rows // tile) * tile if tile else rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        if self.row_tile and x.dim() == 2:
            return row_tiled(lambda chunk: F.linear(chunk, self.weight, self.bias), x, self.row_tile)
        return F.linear(x, self.weight, self.bias)
