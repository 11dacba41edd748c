"""Triton kernels of the GPU attention path, with thin launch wrappers.

- `write_kv`: new K/V rows [T, Hkv*D] into the paged pool at `slot_mapping` (slot -1: skipped).
- `paged_decode_attention`: one query token per sequence.
- `paged_prefill_attention`: varlen queries (prefill, chunked prefill), causal; a sequence's queries are the
  last `query_len` positions of its context, and every key is read from the pool through its block table,
  so prefix-cache hits and chunk continuations need nothing special.

FP8 pools (torch.float8_e4m3fn, engine/kv_quant.py): `write_kv` divides by the KV head's scale and rounds to e4m3
by hand (to nearest even, saturated at 448: the same bytes as torch's conversion, where the interpreter's own
conversion truncates subnormals); attention loads the bytes, widens them to the queries' dtype (exact: e4m3 fits
bf16 and fp16) and folds the head's K scale into the scores and its V scale into the output.

Pool layout per layer: [num_kv_heads, num_blocks, block_size, head_dim], contiguous. A key tile gathers
rows by position -> (block table entry, offset in block), so any block size works, 1 included. Each attention
program owns one sequence, one KV head and a tile of query rows (`BLOCK_Q` positions x the KV head's group of
query heads), so a K/V tile is read once for the whole group (grouped-query attention). Softmax runs online,
in float32, base 2. Head dims are padded to a power of two >= 16 with masks.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: `TRITON_INTERPRET=1` must be set
before this module is imported (Triton reads it when the kernels are decorated).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX_HEAD_DIM = 256

# tl.dot operand modes
DOT_FP32 = 0  # float32 operands, exact products (no TF32)
DOT_NATIVE = 1  # bf16/fp16 operands on tensor cores, float32 accumulation
DOT_UPCAST = 2  # interpreter with bf16 operands: numpy has no bfloat16, so multiply in float32


@triton.jit
def _to_e4m3(x):
    """float32 x (already divided by its scale) -> e4m3 bits as uint8: saturated at +-448, rounded to nearest even."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960  # mantissa rounded to 3 bits, exponent rebased
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # m x 2^-9, rounded to nearest even
    magnitude = tl.where(a < 0.015625, subnormal, normal)
    return (magnitude | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _store_kv(pool_ptr, dst, x, scale_ptr, heads, col_ok, mask, FP8: tl.constexpr):
    if FP8:
        scale = tl.load(scale_ptr + heads, mask=col_ok, other=1.0)
        x = _to_e4m3(x.to(tl.float32) / scale[None, :]).to(tl.float8e4nv, bitcast=True)
    tl.store(pool_ptr + dst, x, mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, num_tokens, stride_k,
                     stride_v, stride_pool_head, HEAD_DIM: tl.constexpr, ROW: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_C: tl.constexpr, FP8: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_C)  # column of the [T, Hkv*D] row: head = col // D, dim = col % D
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    mask = (slots >= 0)[:, None] & (cols < ROW)[None, :]
    heads = (cols // HEAD_DIM).to(tl.int64)
    dst = heads[None, :] * stride_pool_head + slots[:, None] * HEAD_DIM + (cols % HEAD_DIM)[None, :]
    rows = tokens.to(tl.int64)[:, None]
    k = tl.load(k_ptr + rows * stride_k + cols[None, :], mask=mask)
    _store_kv(k_pool_ptr, dst, k, k_scale_ptr, heads, cols < ROW, mask, FP8)
    v = tl.load(v_ptr + rows * stride_v + cols[None, :], mask=mask)
    _store_kv(v_pool_ptr, dst, v, v_scale_ptr, heads, cols < ROW, mask, FP8)


@triton.jit
def _dot(a, b, MODE: tl.constexpr):
    if MODE == 0:
        r = tl.dot(a, b, input_precision="ieee")
    elif MODE == 1:
        r = tl.dot(a, b)
    else:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return r


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_pool_ptr, v_pool_ptr, out_ptr, table_ptr, query_start_ptr, context_len_ptr, k_scale_ptr,
        v_scale_ptr, scale_log2, stride_q, stride_out, stride_table, stride_pool_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_DECODE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        DOT_MODE: tl.constexpr, FP8: tl.constexpr):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    if IS_DECODE:  # one query per sequence, in sequence order
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(query_start_ptr + seq).to(tl.int32)
        q_len = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx_len = tl.load(context_len_ptr + seq).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)  # row r: query q_tile * BLOCK_Q + r // GROUP, head r % GROUP of this KV head
    q_idx = q_tile * BLOCK_Q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len - q_len + q_idx  # absolute position: sees keys [0, q_pos]
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    token_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token_rows[:, None] * stride_q + (heads * HEAD_DIM)[:, None] + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (q_tile + 1) * BLOCK_Q)  # keys the tile's last query sees
    table = table_ptr + seq.to(tl.int64) * stride_table
    head_base = kv_head.to(tl.int64) * stride_pool_head
    if FP8:  # the head's K scale multiplies every score, its V scale the output
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    for start in range(0, kv_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < kv_end
        blocks = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slots = blocks * BLOCK_SIZE + keys % BLOCK_SIZE
        k = tl.load(k_pool_ptr + head_base + slots[None, :] * HEAD_DIM + dims[:, None],
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
        if FP8:
            k = k.to(q.dtype)
        scores = _dot(q, k, DOT_MODE) * scale_log2
        visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no visible key yet stay at zero
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_pool_ptr + head_base + slots[:, None] * HEAD_DIM + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        if FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_MODE)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a context of length 0 (padding) gives zeros
    if FP8:
        out = out * tl.load(v_scale_ptr + kv_head)
    tl.store(out_ptr + token_rows[:, None] * stride_out + (heads * HEAD_DIM)[:, None] + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


def check_head_dim(head_dim: int) -> None:
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention kernels support head dims 1..{MAX_HEAD_DIM}, got {head_dim}")


def padded_dim(size: int) -> int:
    """Smallest power of two >= size and >= 16 (tl.dot's smallest operand side)."""
    return max(16, triton.next_power_of_2(size))


def dot_mode(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return DOT_FP32
    return DOT_UPCAST if INTERPRETED and dtype == torch.bfloat16 else DOT_NATIVE


def write_kv_meta(num_kv_heads: int, head_dim: int, fp8: bool = False) -> dict[str, int]:
    """The K/V writer's compile-time parameters; tiles of at most 4096 elements on GPU."""
    block_c = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = 128 if INTERPRETED else max(1, min(16, 4096 // block_c))
    return dict(HEAD_DIM=head_dim, ROW=num_kv_heads * head_dim, BLOCK_T=block_t, BLOCK_C=block_c, FP8=fp8)


def attention_meta(group: int, head_dim: int, block_size: int, dtype: torch.dtype, is_decode: bool,
                   fp8: bool = False) -> dict:
    """The attention kernel's compile-time parameters. Query rows per tile: the group's heads (padded to 16) for
    decode, >= 64 for prefill; the interpreter pays per operation, not per element, so it gets big key tiles."""
    check_head_dim(head_dim)
    block_d = padded_dim(head_dim)
    block_m = padded_dim(group) if is_decode else max(64, padded_dim(group))
    block_n = 64 if INTERPRETED or block_d <= 128 else 32
    block_q = 1 if is_decode else max(1, block_m // group)
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, IS_DECODE=is_decode, BLOCK_Q=block_q,
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, DOT_MODE=dot_mode(dtype), FP8=fp8)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv*D] (rows may be strided); pools: [Hkv, NB, bs, D] contiguous, float8_e4m3fn with their heads'
    scales k_scale, v_scale [Hkv] (float32) or of k's dtype; slot_mapping: [T]."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _check_rows(k, v)
    fp8 = k_pool.dtype == torch.float8_e4m3fn
    meta = write_kv_meta(k_pool.shape[0], k_pool.shape[3], fp8)
    grid = (triton.cdiv(num_tokens, meta["BLOCK_T"]),)
    _write_kv_kernel[grid](k, v, k_pool, v_pool, slot_mapping, k_scale if fp8 else None, v_scale if fp8 else None,
                           num_tokens, k.stride(0), v.stride(0), k_pool.stride(0), **meta)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> None:
    """q, out: [S, Hq*D], one query per sequence; block_tables: [S, max_blocks]; context_lens: [S] (0: padding,
    output zeros); FP8 pools with their heads' scales (as `write_kv`). Reads only `context_lens` on the device, so it
    can be captured in a CUDA graph."""
    if q.shape[0]:
        _launch(q, k_pool, v_pool, out, block_tables, context_lens, context_lens, q.shape[0], 1, True, k_scale,
                v_scale)


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
                            block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                            max_query_len: int, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> None:
    """q, out: [sum(query_lens), Hq*D]; query_starts: [S+1] cumulative query lengths; context_lens: [S], each
    including its sequence's queries (the last query_len positions)."""
    num_seqs = context_lens.shape[0]
    if num_seqs:
        _launch(q, k_pool, v_pool, out, block_tables, query_starts, context_lens, num_seqs, max_query_len, False,
                k_scale, v_scale)


def _launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, out: torch.Tensor,
            block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor, num_seqs: int,
            max_query_len: int, is_decode: bool, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> None:
    _check_rows(q, out)
    num_kv_heads, _, block_size, head_dim = k_pool.shape
    fp8 = k_pool.dtype == torch.float8_e4m3fn
    meta = attention_meta(q.shape[1] // (num_kv_heads * head_dim), head_dim, block_size, q.dtype, is_decode, fp8)
    grid = (num_seqs, triton.cdiv(max_query_len, meta["BLOCK_Q"]), num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, out, block_tables, query_starts, context_lens, k_scale if fp8 else None,
        v_scale if fp8 else None, math.log2(math.e) / math.sqrt(head_dim), q.stride(0), out.stride(0),
        block_tables.stride(0), k_pool.stride(0), **meta)


def _check_rows(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(f"expected [tokens, features] with unit feature stride, got shape {tuple(t.shape)} "
                             f"strides {t.stride()}")


def compile_for(capability: int, dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
                block_size: int, fp8: bool = False) -> dict[str, int]:
    """Compile every kernel, with the launches' own parameters, for CUDA compute capability `capability` (90: H100,
    H200) without a GPU: Triton's front end and bundled ptxas; `fp8`: over FP8 pools. Returns each kernel's shared
    memory in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        raise RuntimeError("compile_for needs compiled kernels: unset TRITON_INTERPRET")
    ptr = "*" + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    target = GPUTarget("cuda", capability, 32)
    pool = "*fp8e4nv" if fp8 else ptr
    scales = dict(k_scale_ptr="*fp32", v_scale_ptr="*fp32") if fp8 else {}
    no_scales = {} if fp8 else dict(k_scale_ptr=None, v_scale_ptr=None)  # constexpr None: never read
    kernels = {
        "write_kv": (_write_kv_kernel, write_kv_meta(num_kv_heads, head_dim, fp8) | no_scales,
                     dict(k_ptr=ptr, v_ptr=ptr, k_pool_ptr=pool, v_pool_ptr=pool, slot_ptr="*i64", num_tokens="i32",
                          stride_k="i32", stride_v="i32", stride_pool_head="i64", **scales)),
    }
    attention_args = dict(q_ptr=ptr, k_pool_ptr=pool, v_pool_ptr=pool, out_ptr=ptr, table_ptr="*i64",
                          query_start_ptr="*i64", context_len_ptr="*i64", scale_log2="fp32", stride_q="i32",
                          stride_out="i32", stride_table="i32", stride_pool_head="i64", **scales)
    for name, is_decode in (("decode", True), ("prefill", False)):
        meta = attention_meta(num_q_heads // num_kv_heads, head_dim, block_size, dtype, is_decode, fp8) | no_scales
        kernels[name] = (_paged_attention_kernel, meta, attention_args)
    shared = {}
    for name, (kernel, meta, arg_types) in kernels.items():
        signature = {arg: arg_types.get(arg, "constexpr") for arg in kernel.arg_names}
        shared[name] = triton.compile(ASTSource(kernel, signature, meta), target=target).metadata.shared
    return shared
