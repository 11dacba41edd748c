"""The CPU paged decode-attention kernel (csrc/paged_decode.c): compiled with the system's C compiler at first
use into ~/.cache/tokenmill/kernels (keyed by the source's hash and the CPU's flags), loaded with ctypes,
called on tensors' memory. It reads keys and values straight from the block pool, where the torch path first
gathers every sequence's blocks into a padded copy. Without a compiler, or with
`TOKENMILL_CPU_ATTENTION_KERNEL=0`, `paged_decode` is None and the torch path runs."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("tokenmill.attention")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros"]  # reassociation lets the compiler vectorize the dot products


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENMILL_CACHE_DIR") or Path.home() / ".cache" / "tokenmill") / "kernels"


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("TOKENMILL_CPU_ATTENTION_KERNEL", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not SOURCE.exists():
        log.info("no C compiler or no kernel source: paged decode attention runs in torch")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / f"paged_decode-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True,
                                  text=True)
            if done.returncode != 0:
                log.warning("could not build the CPU attention kernel (%s); using torch", done.stderr[-500:])
                return None
            os.replace(built, target)  # atomic: another process may build it at the same time
    log.info("CPU paged decode attention: %s", target)
    library = ctypes.CDLL(str(target))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for function in (library.paged_decode_f32, library.paged_decode_bf16):
        function.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                             ctypes.c_float, ctypes.c_int]
        function.restype = None
    return library


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


DTYPES = (torch.float32, torch.bfloat16)


def available(dtype: torch.dtype = torch.float32) -> bool:
    return dtype in DTYPES and _library() is not None


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 context_lens: torch.Tensor, first_block: int = 0, with_lse: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [S, Hkv, G, D] float32 or bfloat16 (the pools' dtype), contiguous; pools [Hkv, NB, BS, D]; tables
    [S, B] int32 contiguous (blocks from `first_block` on are attended); context_lens [S] int32, tokens from that
    block on. Returns the
    attention output [S, Hkv, G, D] and, with `with_lse`, each row's log-sum-exp [S, Hkv, G]."""
    library = _library()
    num_seqs, num_kv_heads, group, head_dim = q.shape
    _, num_blocks, block_size, _ = k_pool.shape
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32) if with_lse else None
    function = library.paged_decode_f32 if q.dtype == torch.float32 else library.paged_decode_bf16
    function(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables.data_ptr(), tables.stride(0), first_block,
             context_lens.data_ptr(), out.data_ptr(), lse.data_ptr() if lse is not None else None, num_seqs,
             num_kv_heads, group, head_dim, num_blocks, block_size, head_dim ** -0.5, torch.get_num_threads())
    return out, lse
