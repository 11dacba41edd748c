"""The CPU kernels in csrc/, compiled with the system's C compiler at first use into ~/.cache/tokenmill/kernels
(keyed by the sources' hash and the CPU's flags), loaded with ctypes, called on tensors' memory:

- paged decode attention (paged_decode.c) reads keys and values straight from the block pool, where the torch
  path first gathers every sequence's blocks into a padded copy (`TOKENMILL_CPU_ATTENTION_KERNEL=0`: torch); from
  FP8 pools too (engine/kv_quant.py), dequantising as it reads, and `write_kv` quantises into them;
- a decoder layer's elementwise steps fused (layer_ops.c): RMSNorm with its residual add, RoPE in place,
  SiLU(gate) * up, one pass each instead of several torch ops (`TOKENMILL_CPU_LAYER_OPS=0`: torch);
- an encoder layer's attention over packed rows of any lengths, with no padding, and its residual add +
  LayerNorm (encoder_ops.c; `TOKENMILL_CPU_LAYER_OPS=0`: torch);
- GEMMs on prepacked weights, batch-invariant by construction, used by engine/kernels/cpu_gemm.py: bfloat16 on
  Intel AMX tiles (amx_gemm.c), and bfloat16 (avx512_bf16) and float32 on AVX-512 vectors (avx512_gemm.c).
- a Llama-style model's decoder layers in one call (decode_layers.c) for steps whose tokens all go through the
  decode kernel and whose projections all run on our GEMMs: the kernels above, in the Python loop's order, without
  Python between them (`TOKENMILL_CPU_DECODE_LAYERS=0`: the Python loop).
- the sampler's exponential race (sampling.c), in a library of its own (`sampling_library`;
  `TOKENMILL_CPU_SAMPLING_KERNEL=0`: torch, with the same tokens).

Without a compiler the torch paths run."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_quant import FP8_DTYPE

log = logging.getLogger("tokenmill.attention")

SOURCES = [Path(__file__).with_name("csrc") / name for name in ("paged_decode.c", "layer_ops.c", "encoder_ops.c",
                                                                         "amx_gemm.c", "avx512_gemm.c",
                                                                         "decode_layers.c", "lora.c")]
HEADERS = [Path(__file__).with_name("csrc") / "fast_math.h"]
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
         "-fno-trapping-math", "-fassociative-math",
         "-fno-signed-zeros"]  # reassociation lets the compiler vectorize the dot products


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill") / "kernels"


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = _build_library("cpu_kernels", SOURCES, FLAGS, HEADERS)
    if library is None:
        return None
    i64, ptr, f32, threads = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    decode = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ptr, ptr, threads]
    signatures = {"paged_decode": decode, "paged_decode_fp8": decode,
                  "write_kv_fp8": [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, ptr, threads],
                  "write_kv": [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, threads],
                  "rms_norm": [ptr, ptr, ptr, ptr, i64, i64, f32, threads],
                  "rope": [ptr, i64, ptr, ptr, ptr, i64, i64, i64, threads],
                  "silu_mul": [ptr, ptr, i64, i64, threads],
                  "packed_attention": [ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, threads],
                  "add_layer_norm": [ptr, ptr, ptr, ptr, ptr, i64, i64, f32, threads],
                  "lora": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, threads]}
    for name, argtypes in signatures.items():
        for suffix in SUFFIXES.values():
            function = getattr(library, f"{name}_{suffix}")
            function.argtypes, function.restype = argtypes, None
    library.amx_gemm_ready.argtypes, library.amx_gemm_ready.restype = [], ctypes.c_int
    library.amx_pack_bf16.argtypes, library.amx_pack_bf16.restype = [ptr, ptr, i64, i64], None
    library.amx_linear_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, threads]
    library.amx_linear_bf16.restype = None
    library.amx_split_f32.argtypes, library.amx_split_f32.restype = [ptr, ptr, i64, i64, ctypes.c_int, threads], None
    library.amx_linear_split_f32.argtypes = [ptr, ptr, ptr, ctypes.c_int, ctypes.c_int, ptr, ptr, i64, i64, i64,
                                             threads]
    library.amx_linear_split_f32.restype = None
    library.amx_packed_attention_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, f32, threads]
    library.amx_packed_attention_bf16.restype = ctypes.c_int
    library.avx512_gemm_ready.argtypes, library.avx512_gemm_ready.restype = [], ctypes.c_int
    for suffix in SUFFIXES.values():
        function = getattr(library, f"decode_layers_{suffix}")
        function.argtypes = [ptr, i64, ptr, f32, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, threads]
        function.restype = None
    for suffix in SUFFIXES.values():
        getattr(library, f"avx512_pack_{suffix}").argtypes = [ptr, ptr, i64, i64]
        getattr(library, f"avx512_pack_{suffix}").restype = None
        getattr(library, f"avx512_linear_{suffix}").argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, threads]
        getattr(library, f"avx512_linear_{suffix}").restype = None
    return library


SAMPLING_SOURCE = Path(__file__).with_name("csrc") / "sampling.c"
SAMPLING_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno",
                  "-ffp-contract=off"]  # IEEE order as written: the torch fallback's float64 keys match it


@functools.cache
def sampling_library() -> ctypes.CDLL | None:
    """csrc/sampling.c, the sampler's exponential race (engine/sampler.py), built apart from the kernels above: without
    their reassociation, so its tokens are bit-identical to the torch fallback's. None without a compiler or with
    `TOKENMILL_CPU_SAMPLING_KERNEL=0`."""
    if os.environ.get("TOKENMILL_CPU_SAMPLING_KERNEL", "1") == "0":
        return None
    library = _build_library("sampling", [SAMPLING_SOURCE], SAMPLING_FLAGS)
    if library is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.exp_race_f32.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ctypes.c_int]
    library.exp_noise_f32.argtypes = [ptr, i64, i64, ptr]
    library.exp_race_f32.restype = library.exp_noise_f32.restype = None
    return library


def _build_library(stem: str, sources: list[Path], flags: list[str], headers: list[Path] | None = None
                   ) -> ctypes.CDLL | None:
    """Compile `sources` (which include `headers`) into cache_dir() once per (their text, flags, CPU) and load it;
    None if that cannot be done."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not all(source.exists() for source in [*sources, *(headers or [])]):
        log.info("no C compiler or no %s sources: torch runs instead", stem)
        return None
    text = b"".join(source.read_bytes() for source in [*sources, *(headers or [])])
    key = text + " ".join(flags).encode() + _cpu_flags().encode()
    target = cache_dir() / f"{stem}-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            done = subprocess.run([compiler, *flags, *map(str, sources), "-o", str(built), "-lm"],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("could not build %s (%s); using torch", stem, done.stderr[-500:])
                return None
            os.replace(built, target)  # atomic: another process may build it at the same time
    log.info("%s: %s", stem, target)
    return ctypes.CDLL(str(target))


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
HEAD_DIM_MULTIPLE = 16  # packed_attention's head_dim: a whole number of its vectors (LANES in encoder_ops.c)
AMX_DEPTH = 32  # bfloat16 elements in one AMX tile row: amx_packed_attention's head_dim is a multiple


def available(dtype: torch.dtype = torch.float32) -> bool:
    return dtype in SUFFIXES and os.environ.get("TOKENMILL_CPU_ATTENTION_KERNEL", "1") != "0" \
        and _library() is not None


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 context_lens: torch.Tensor, first_block: int = 0, with_lse: bool = False,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [S, Hq * D] float32 or bfloat16, each row contiguous, rows at any stride (e.g. the query columns of the
    QKV projection); pools [Hkv, NB, BS, D] of q's dtype, or float8_e4m3fn with their heads' scales `k_scale`,
    `v_scale` [Hkv] (float32, contiguous); tables [S, B] int32 contiguous (blocks from `first_block` on are
    attended); context_lens [S] int32, tokens from that block on. Returns the attention output [S, Hkv, G, D] and,
    with `with_lse`, each row's log-sum-exp [S, Hkv, G]."""
    library = _library()
    num_kv_heads, num_blocks, block_size, head_dim = k_pool.shape
    num_seqs = q.shape[0]
    if q.dim() != 2 or q.stride(1) != 1:
        q = q.reshape(num_seqs, -1).contiguous()
    group = q.shape[1] // (num_kv_heads * head_dim)
    out = torch.empty((num_seqs, num_kv_heads, group, head_dim), dtype=q.dtype)
    lse = torch.empty(out.shape[:3], dtype=torch.float32) if with_lse else None
    fp8 = k_pool.dtype == FP8_DTYPE
    function = getattr(library, f"paged_decode_{'fp8_' if fp8 else ''}{SUFFIXES[q.dtype]}")
    function(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), tables.stride(0),
             first_block, context_lens.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else None,
             num_seqs, num_kv_heads, group, head_dim, num_blocks, block_size, head_dim ** -0.5,
             k_scale.data_ptr() if fp8 else None, v_scale.data_ptr() if fp8 else None, torch.get_num_threads())
    return out, lse


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slots: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Store token i's keys and values (k, v [T, Hkv * D], each row contiguous, rows at a common stride) at slot
    slots[i] (int64) of every head of the pools [Hkv, NB, BS, D]; into float8_e4m3fn pools quantised by their
    heads' scales `k_scale`, `v_scale` [Hkv] (as kv_quant.quantize: saturated, rounded to nearest even)."""
    num_kv_heads, num_blocks, block_size, head_dim = k_pool.shape
    if k.stride(1) != 1 or v.stride(1) != 1 or k.stride(0) != v.stride(0):
        k, v = k.contiguous(), v.contiguous()
    args = [k.data_ptr(), v.data_ptr(), k.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(),
            k.shape[0], num_kv_heads, head_dim, num_blocks * block_size]
    if k_pool.dtype == FP8_DTYPE:
        getattr(_library(), f"write_kv_fp8_{SUFFIXES[k.dtype]}")(*args, k_scale.data_ptr(), v_scale.data_ptr(),
                                                                  torch.get_num_threads())
    else:
        getattr(_library(), f"write_kv_{SUFFIXES[k.dtype]}")(*args, torch.get_num_threads())


def lora(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         slots: torch.Tensor) -> None:
    """out[t] += (x[t] @ lora_a[s].T) @ lora_b[s] in place for each row t of slot s = slots[t] >= 0 (lora.c): x
    [T, in] and out [T, out] float32 or bfloat16, each row contiguous, rows at any stride; lora_a [S, R, in] and
    lora_b [S, R, out] float32 contiguous; slots [T] int64 contiguous."""
    num_slots, rank, in_features = lora_a.shape
    function = getattr(_library(), f"lora_{SUFFIXES[x.dtype]}")
    function(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), lora_a.data_ptr(), lora_b.data_ptr(),
             slots.data_ptr(), x.shape[0], in_features, out.shape[1], rank, num_slots, torch.get_num_threads())


class LayerOps:
    """The fused elementwise steps of a decoder layer for one dtype, on contiguous CPU tensors."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = SUFFIXES[dtype]
        self._rms_norm = getattr(library, f"rms_norm_{suffix}")
        self._rope = getattr(library, f"rope_{suffix}")
        self._silu_mul = getattr(library, f"silu_mul_{suffix}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x) * weight; with `residual`, first residual += x (in place), then norm(residual) * weight."""
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                       out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads())
        return out

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> None:
        """RoPE in place on the first `heads` rows of `head_dim` of each token row of x [tokens, >= heads *
        head_dim] (unit stride within a row); cos and sin are the float32 tables [max_positions, head_dim]."""
        self._rope(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], heads,
                   head_dim, torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out


def layer_ops(dtype: torch.dtype) -> LayerOps | None:
    """The fused CPU decoder-layer ops for `dtype`, or None (no compiler, another dtype,
    `TOKENMILL_CPU_LAYER_OPS=0`)."""
    return _fused_ops(LayerOps, dtype)


def _fused_ops(kind, dtype: torch.dtype):
    if dtype not in SUFFIXES or os.environ.get("TOKENMILL_CPU_LAYER_OPS", "1") == "0":
        return None
    library = _library()
    return kind(library, dtype) if library is not None else None


class EncoderOps:
    """An encoder layer's attention over packed rows and residual LayerNorm for one dtype, on contiguous CPU
    tensors."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix, self.dtype = SUFFIXES[dtype], dtype
        self._attention = getattr(library, f"packed_attention_{suffix}")
        self._add_layer_norm = getattr(library, f"add_layer_norm_{suffix}")
        self._amx_attention = library.amx_packed_attention_bf16 if dtype == torch.bfloat16 and amx_ready() else None

    def packed_attention(self, qkv: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, longest: int,
                         heads: int) -> torch.Tensor:
        """qkv [tokens, 3 * heads * head_dim], rows at `starts` (int64) of `lengths` (int64) tokens, the longest
        `longest` -> [tokens, heads * head_dim], each row attending to itself only (bidirectional)."""
        qkv, starts, lengths = qkv.contiguous(), starts.contiguous(), lengths.contiguous()
        size = qkv.shape[1] // 3
        out = torch.empty((qkv.shape[0], size), dtype=qkv.dtype)
        head_dim = size // heads
        attention = self._amx_attention if self.tiles_take(head_dim) else self._attention
        attention(qkv.data_ptr(), out.data_ptr(), starts.data_ptr(), lengths.data_ptr(), len(lengths), longest, heads,
                  head_dim, head_dim ** -0.5, torch.get_num_threads())
        return out

    def tiles_take(self, head_dim: int) -> bool:
        """Attention runs on AMX tiles (bfloat16 on a CPU with AMX, head_dim a whole number of tile depths)."""
        return self._amx_attention is not None and head_dim % AMX_DEPTH == 0

    def add_layer_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
        """norm(x + residual) for [rows, hidden] tensors."""
        x, residual = x.contiguous(), residual.contiguous()
        out = torch.empty_like(x)
        self._add_layer_norm(x.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(), norm.bias.data_ptr(),
                             out.data_ptr(), x.shape[0], x.shape[1], norm.eps, torch.get_num_threads())
        return out


def encoder_ops(dtype: torch.dtype) -> EncoderOps | None:
    """The CPU encoder ops for `dtype`, or None (as `layer_ops`)."""
    return _fused_ops(EncoderOps, dtype)


GEMM_MULTIPLE = 32  # our GEMMs' out features (and AMX's in features): whole 32-column slices
GEMM_KINDS = ("amx", "avx512")


@functools.cache
def amx_ready() -> bool:
    """The AMX bfloat16 GEMM runs here: the kernels built with AMX and Linux granted this process the tiles."""
    library = _library()
    return library is not None and library.amx_gemm_ready() == 1


@functools.cache
def avx512_ready(dtype: torch.dtype) -> bool:
    """The AVX-512 GEMM for `dtype` runs here (bfloat16 needs avx512_bf16)."""
    library = _library()
    level = library.avx512_gemm_ready() if library is not None else 0
    return level >= {torch.float32: 1, torch.bfloat16: 2}.get(dtype, 3)


def gemm_fits(kind: str, out_features: int, in_features: int) -> bool:
    """Our `kind` GEMM takes a weight of this shape."""
    if kind == "amx":
        return out_features % GEMM_MULTIPLE == 0 and in_features % GEMM_MULTIPLE == 0
    return out_features % GEMM_MULTIPLE == 0 and in_features % 2 == 0


def gemm_pack(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """A weight [out, in] (`gemm_fits`) in the `kind` GEMM's layout: "amx" (bfloat16) or "avx512"."""
    weight = weight.detach().contiguous()
    packed = torch.empty(weight.numel(), dtype=weight.dtype)
    pack = _library().amx_pack_bf16 if kind == "amx" else getattr(_library(), f"avx512_pack_{SUFFIXES[weight.dtype]}")
    pack(weight.data_ptr(), packed.data_ptr(), *weight.shape)
    return packed


def gemm_linear(kind: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [rows, in] @ weight.T + bias (float32 or None) -> [rows, out] in x's dtype, through the `kind` GEMM on the
    weight packed by `gemm_pack`: float32 sums in the same order at any number of rows."""
    x = x.contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype)
    linear = _library().amx_linear_bf16 if kind == "amx" else getattr(_library(), f"avx512_linear_{SUFFIXES[x.dtype]}")
    linear(x.data_ptr(), packed.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
           x.shape[0], out_features, x.shape[1], torch.get_num_threads())
    return out


SPLIT_TERMS = {  # bfloat16 parts per float32 -> the (x part, weight part) products summed, smallest first
    2: ((1, 0), (0, 1), (0, 0)),
    3: ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)),
}


def split_parts(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """float32 `t` as `parts` bfloat16 tensors summing to it: the nearest bfloat16, the nearest to what it left..."""
    rest, out = t.float(), []
    for _ in range(parts):
        out.append(rest.bfloat16())
        rest = rest - out[-1].float()
    return out


def split_pack(weight: torch.Tensor, parts: int) -> torch.Tensor:
    """A float32 weight [out, in] (`gemm_fits`) split into bfloat16 parts and packed for `split_linear`: one segment
    of `in` along the depth per product in SPLIT_TERMS[parts]."""
    pieces = split_parts(weight.detach(), parts)
    return gemm_pack("amx", torch.cat([pieces[w] for _, w in SPLIT_TERMS[parts]], dim=1))


@functools.cache
def _split_x_parts(parts: int) -> ctypes.Array:
    """x's part in each product of SPLIT_TERMS[parts], as amx_linear_split_f32 takes them."""
    return (ctypes.c_int32 * len(SPLIT_TERMS[parts]))(*(x_part for x_part, _ in SPLIT_TERMS[parts]))


def split_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                 parts: int) -> torch.Tensor:
    """float32 x [rows, in] @ weight.T + bias on the AMX tiles from the weight packed by `split_pack`: x split into
    `parts` bfloat16 parts, the products of SPLIT_TERMS summed in float32 (amx_gemm.c says how exact)."""
    x = x.contiguous()
    rows, depth = x.shape
    library = _library()
    x_parts = torch.empty(rows * parts * depth, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    library.amx_split_f32(x.data_ptr(), x_parts.data_ptr(), rows, depth, parts, threads)
    x_part = _split_x_parts(parts)
    out = torch.empty((rows, out_features), dtype=torch.float32)
    library.amx_linear_split_f32(x_parts.data_ptr(), packed.data_ptr(), x_part, len(x_part), parts,
                                 bias.data_ptr() if bias is not None else None, out.data_ptr(), rows, out_features,
                                 depth, threads)
    return out


class _DecoderLayer(ctypes.Structure):  # decoder_layer in decode_layers.c
    _fields_ = [(name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down", "qkv_bias", "o_bias",
                                                     "gate_up_bias", "down_bias", "input_norm", "post_norm")] \
        + [("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float)]


class _DecodeStep(ctypes.Structure):  # decode_step in decode_layers.c
    _fields_ = [(name, ctypes.c_int64) for name in ("tokens", "hidden", "heads", "kv_heads", "head_dim", "inter",
                                                    "num_blocks", "block_size", "table_stride")] \
        + [(name, ctypes.c_void_p) for name in ("positions", "slots", "tables", "context_lens", "cos_table",
                                                "sin_table", "k_pools", "v_pools", "lora_slots")] \
        + [("lora_num_slots", ctypes.c_int64)] \
        + [(name, ctypes.c_void_p) for name in ("lora_a", "lora_b", "lora_rank", "k_scales", "v_scales")]


@dataclass
class DecodeLoRA:
    """A step's LoRA products for `DecodeLayers` (decode_layers.c, lora.c): each token's slot (int64, -1: the base
    model), and per layer and projection (qkv, o, gate_up, down) the stacks' pointers (None where no row's adapter
    changes it), with each projection's stacked rank."""

    slots: torch.Tensor
    num_slots: int
    lora_a: ctypes.Array
    lora_b: ctypes.Array
    rank: ctypes.Array


@dataclass
class DecoderLayerWeights:
    """One layer's tensors for `DecodeLayers`: projections packed by `gemm_pack` (all of one kind), float32 biases
    or None, RMSNorm weights in the model's dtype."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float


class DecodeLayers:
    """A decoder's layers over a step of decode-kernel tokens in one C call (decode_layers.c): the same kernels in
    the same order as the model's Python loop, without Python between them. `seconds` accumulates the time in
    GEMMs, attention and the elementwise kernels (for `bench throughput --profile`)."""

    def __init__(self, kind: str, dtype: torch.dtype, layers: list[DecoderLayerWeights], final_norm: torch.Tensor,
                 final_eps: float, heads: int, kv_heads: int, head_dim: int, inter: int) -> None:
        self._function = getattr(_library(), f"decode_layers_{SUFFIXES[dtype]}")
        self.amx, self.dtype, self.final_norm, self.final_eps = kind == "amx", dtype, final_norm, final_eps
        self.shape = (heads, kv_heads, head_dim, inter)
        self._keep = layers  # the tensors the table points into
        self._layers = (_DecoderLayer * len(layers))(*(_DecoderLayer(
            w.qkv.data_ptr(), w.o.data_ptr(), w.gate_up.data_ptr(), w.down.data_ptr(),
            *(b.data_ptr() if b is not None else None for b in w.biases), w.input_norm.data_ptr(),
            w.post_norm.data_ptr(), w.input_eps, w.post_eps) for w in layers))
        self._pools: tuple | None = None  # (k_pools, v_pools, their pointer arrays, FP8 scales' or None) of last call
        self.seconds = (ctypes.c_double * 3)()

    def run(self, residual: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
            context_lens: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], k_pools: list[torch.Tensor],
            v_pools: list[torch.Tensor], num_layers: int | None = None, lora: DecodeLoRA | None = None) -> torch.Tensor:
        """residual [tokens, hidden] (the embeddings; updated in place) -> the last layer's output through the
        final norm, after `num_layers` layers (default all). positions, slots: int64 per token; tables [tokens,
        blocks] and context_lens, int32: the decode kernel's; k_pools, v_pools: each layer's [Hkv, NB, BS, D], of the
        model's dtype or FP8 (base.KVPools, with their scales)."""
        heads, kv_heads, head_dim, inter = self.shape
        tokens, hidden = residual.shape
        if self._pools is None or self._pools[0] is not k_pools or self._pools[1] is not v_pools:
            pointers = ctypes.c_void_p * len(k_pools)
            k_scales, v_scales = getattr(k_pools, "scales", None), getattr(v_pools, "scales", None)
            scales = None if k_scales is None else (pointers(*(row.data_ptr() for row in k_scales)),
                                                    pointers(*(row.data_ptr() for row in v_scales)))
            self._pools = (k_pools, v_pools, pointers(*(t.data_ptr() for t in k_pools)),
                           pointers(*(t.data_ptr() for t in v_pools)), scales)
        num_blocks, block_size = k_pools[0].shape[1:3]
        step = _DecodeStep(tokens, hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size, tables.stride(0),
                           positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), context_lens.data_ptr(),
                           rope[0].data_ptr(), rope[1].data_ptr(), ctypes.addressof(self._pools[2]),
                           ctypes.addressof(self._pools[3]))
        if self._pools[4] is not None:
            step.k_scales, step.v_scales = ctypes.addressof(self._pools[4][0]), ctypes.addressof(self._pools[4][1])
        if lora is not None:
            step.lora_slots, step.lora_num_slots = lora.slots.data_ptr(), lora.num_slots
            step.lora_a, step.lora_b = ctypes.addressof(lora.lora_a), ctypes.addressof(lora.lora_b)
            step.lora_rank = ctypes.addressof(lora.rank)
        width = (heads + 2 * kv_heads) * head_dim
        scratch = torch.empty(tokens * (hidden + width + heads * head_dim + 3 * inter), dtype=self.dtype)
        normed = torch.empty_like(residual)
        self._function(self._layers, len(self._keep) if num_layers is None else num_layers, self.final_norm.data_ptr(),
                       self.final_eps, ctypes.byref(step), residual.data_ptr(), normed.data_ptr(), scratch.data_ptr(),
                       self.seconds, int(self.amx), torch.get_num_threads())
        return normed
