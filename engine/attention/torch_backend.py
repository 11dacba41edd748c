"""Reference paged attention in plain torch (the CPU backend).

Each group of sequences (decodes, prefills) gathers its blocks per KV head with one `index_select`,
pads queries to the group's longest, and runs one masked attention per layer. Prefills of very different lengths
(where that padding costs more than a call per prompt) are instead attended one by one with the flash kernel's
causal mask, which skips the masked half.
When the group shares leading blocks (a common prompt prefix), those are read once for the whole group
and attended with one dense matmul (cascade attention), then merged with each sequence's own suffix
through the log-sum-exp of both parts.

Batch-invariant mode sends every token, decode or prefill, through the CPU decode kernel as one query over its own
sequence's blocks up to its position: blocks in table order, the same arithmetic whatever else is in the step.

FP8 pools (engine/kv_quant.py): writes quantise with the head's scale; the decode kernel dequantises as it reads;
the gathering paths dequantise the rows they gathered (never the whole pool).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, PrefillGroup, StepBatch, per_token_tables, shared_prefix_blocks
from engine.kernels import cpu_kernel
from engine.kv_quant import dequantize, quantize

MIN_SHARED_BLOCKS = 4  # below this, reading the shared prefix per sequence costs less than a second pass
# What one more attention call costs, in query x key pairs of the flash kernel (about 90 us on a 2-core Zen 4)
CALL_COST_PAIRS = 4096


@dataclass
class _Group:
    start: int  # first token of the group in the flat batch
    num_tokens: int
    num_seqs: int
    max_query_len: int
    suffix_len: int  # padded key length of the per-sequence part
    gather_index: torch.Tensor  # [Hkv * num_seqs * blocks] rows of the [Hkv*NB, bs*D] pool view
    mask: torch.Tensor  # additive (0 / -inf), broadcastable to [Hkv, num_seqs, G * max_query_len, suffix_len]
    pad_index: torch.Tensor | None  # ragged prefill only: flat token -> padded query row
    unpad_index: torch.Tensor | None  # ragged prefill only: padded row -> flat token
    prefix_index: torch.Tensor | None = None  # [Hkv * shared blocks] rows read once for the group
    prefix_len: int = 0
    kernel_tables: torch.Tensor | None = None  # decodes through the CPU kernel: int32 block tables past the prefix
    kernel_context_lens: torch.Tensor | None = None  # int32, tokens past the prefix
    causal_spans: list[_Span] | None = None  # prefills attended one by one, causally (no padding): their spans


@dataclass
class _Span:
    offset: int  # first query token of the sequence within its group
    query_len: int
    context_len: int
    lead: int  # rows of zeros before the queries, so the kernel's causal mask puts them at the context's end
    mask: torch.Tensor | None  # else additive [query_len, context_len]: a long context before a short query


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over 4-D inputs that also returns each row's log-sum-exp, [..., M, 1] float32."""
    if _FLASH_CPU is not None and q.device.type == "cpu":
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask)
        return out.float(), lse.unsqueeze(-1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v.float()), lse


def cut_runs(count: int, cost: Callable[[int, int], int], max_runs: int, min_saving: float,
             min_to_cut: int) -> list[tuple[int, int]]:
    """[0, count) cut into up to `max_runs` consecutive runs [first, end): greedily, the cut saving the most of
    `cost(first, end)`, kept where it saves at least `min_saving` of its run's cost; runs shorter than
    `min_to_cut` are not cut."""
    runs = [(0, count)]
    while len(runs) < max_runs:
        best = None  # (saving, run index, cut)
        for index, (first, end) in enumerate(runs):
            if end - first < min_to_cut:
                continue
            whole = cost(first, end)
            split, cut = min((cost(first, k) + cost(k, end), k) for k in range(first + 1, end))
            if split <= (1 - min_saving) * whole and (best is None or whole - split > best[0]):
                best = (whole - split, index, cut)
        if best is None:
            break
        _, index, cut = best
        first, end = runs[index]
        runs[index:index + 1] = [(first, cut), (cut, end)]
    return runs


def decode_groups(context_lens: list[int] | None, block_size: int, max_groups: int = 4,
                  min_saving: float = 0.1) -> list[tuple[int, int]]:
    """Decodes sorted by context length, cut into up to `max_groups` runs [first, end), each reading keys up
    to its own longest context: a cut is kept where it reads at least `min_saving` fewer key blocks."""
    if not context_lens:
        return []
    blocks = [-(-n // block_size) for n in context_lens]
    return cut_runs(len(blocks), lambda first, end: (end - first) * blocks[end - 1], max_groups, min_saving, 8)


def prefill_runs(query_lens: list[int], context_lens: list[int], max_runs: int = 4,
                 min_saving: float = 0.1) -> list[tuple[int, int]]:
    """Prefills, in batch order, cut into up to `max_runs` consecutive runs [first, end). A run pads every query
    to its longest and every key row to its longest context, costing seqs x longest query x longest context; a
    cut is kept where it saves at least `min_saving` of its run's cost (one long prompt among short ones that
    hit the prefix cache: the short ones no longer pad to the long one)."""
    def cost(first: int, end: int) -> int:
        return (end - first) * max(query_lens[first:end]) * max(context_lens[first:end])

    return cut_runs(len(query_lens), cost, max_runs, min_saving, 2)


def causal_pays(query_lens: list[int], context_lens: list[int], padded_len: int) -> bool:
    """Whether prefills cost less attended one by one with a causal mask (the flash kernel skips the masked half, no
    padding) than as one padded, masked batch: e.g. prompts of 40 and 900 tokens in one step."""
    padded = len(query_lens) * max(query_lens) * padded_len
    causal = sum(span_cost(q, c) for q, c in zip(query_lens, context_lens, strict=True))
    return causal + CALL_COST_PAIRS * len(query_lens) < padded


def span_cost(query_len: int, context_len: int) -> int:
    """Query x key pairs of one prefill: causal over the whole context (zero rows lead the queries), or masked."""
    return context_len * context_len // 2 if leading_pays(query_len, context_len) else query_len * context_len


def leading_pays(query_len: int, context_len: int) -> bool:
    """Whether zero rows before the queries (causal over the whole context) cost no more than a masked rectangle."""
    return context_len * context_len // 2 <= query_len * context_len


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


class TorchAttention(AttentionBackend):
    name = "torch"

    def begin_step(self, batch: StepBatch) -> None:
        device = batch.slot_mapping.device
        heads = torch.arange(self.num_kv_heads, device=device)
        use_kernel = self._use_kernel(device)
        self.kernel_slots = batch.slot_mapping.to(torch.int64).contiguous() if use_kernel else None
        if not use_kernel:
            self.write_index = (heads[:, None] * self.num_blocks * self.block_size + batch.slot_mapping[None, :]
                                ).reshape(-1)
        self.groups: list[_Group] = []
        if self.batch_invariant:
            self.groups.append(self._invariant_group(batch))
        elif batch.num_decodes and use_kernel:
            self.groups.append(self._kernel_group(batch, heads))
        elif batch.num_decodes:
            runs = decode_groups(batch.decode_context_lens_list, self.block_size) or [(0, batch.num_decodes)]
            self.groups.extend(self._decode_group(batch, heads, first, end) for first, end in runs)
        if batch.prefill is not None and not self.batch_invariant:
            group = batch.prefill
            runs = prefill_runs(group.query_lens, group.context_lens)
            start = batch.num_decodes
            for first, end in runs:
                run = group if len(runs) == 1 else self._prefill_run(group, first, end)
                self.groups.append(self._prefill_group(run, start, heads))
                start += sum(run.query_lens)
        self.window_groups: dict[int, list[_Group]] = {}  # sliding-window layers' groups, by window
        if self.layer_windows is not None:
            longest = max(batch.prefill.context_lens if batch.prefill is not None else [0])
            if batch.num_decodes:
                lens = batch.decode_context_lens_list
                longest = max(longest, max(lens) if lens is not None else int(batch.decode_context_lens.max()))
            for window in sorted({w for w in self.layer_windows if w}):
                # no context longer than the window: every key is in every query's window, the global layers' groups
                # (CPU kernel, cascade) attend exactly as the window would
                self.window_groups[window] = self.groups if longest <= window else self._window_groups(batch, heads,
                                                                                                       window)

    def kernel_plan(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(slots, block tables, context lengths) when every token of this step goes through the CPU decode kernel
        as one group with no shared prefix (decodes alone, or any step in batch-invariant mode): then the model may
        run its layers in one C call (cpu_kernel.DecodeLayers). Else None."""
        if self.kernel_slots is None or len(self.groups) != 1:
            return None
        group = self.groups[0]
        if group.kernel_tables is None or group.prefix_index is not None \
                or group.num_tokens != self.kernel_slots.shape[0]:
            return None
        return self.kernel_slots, group.kernel_tables, group.kernel_context_lens

    def set_batch_invariant(self, on: bool) -> None:
        pool = self.k_caches[0]
        if on and not (pool.device.type == "cpu" and cpu_kernel.available(self.dtype)):
            raise RuntimeError("batch_invariant with the torch backend needs the CPU attention kernel: a CPU pool, a "
                               "C compiler (cc), float32 or bfloat16, and TOKENMILL_CPU_ATTENTION_KERNEL unset; on "
                               "CUDA use attention_backend='triton'")
        if on and self.layer_windows is not None:
            raise RuntimeError("batch_invariant does not run models with sliding-window layers (Gemma 3) yet: the CPU "
                               "attention kernel that makes it invariant attends to whole contexts")
        super().set_batch_invariant(on)

    def _window_groups(self, batch: StepBatch, heads: torch.Tensor, window: int) -> list[_Group]:
        """The step's tokens as a sliding-window layer attends them: decodes in one group, prefills in runs, each
        sequence reading only the blocks its queries' windows touch, through the gathering path with a mask
        (key in (query - window, query]); no CPU kernel, no shared prefix read once."""
        device = batch.slot_mapping.device
        groups = []
        if batch.num_decodes:  # sorted by context length: those within the window attend to all of it
            num = batch.num_decodes
            lens = batch.decode_context_lens_list or batch.decode_context_lens.tolist()
            inside = bisect.bisect_right(lens, window)
            if inside and self._use_kernel(device):
                tables = batch.decode_block_tables[:inside, :-(-lens[inside - 1] // self.block_size)]
                groups.append(_Group(0, inside, inside, 1, 0, None, None, None, None, kernel_tables=tables.to(
                    torch.int32).contiguous(), kernel_context_lens=batch.decode_context_lens[:inside].to(torch.int32)))
            elif inside:
                groups.append(self._decode_group(batch, heads, 0, inside))
            if inside < num:
                groups.append(self._window_group(inside, batch.decode_block_tables[inside:num], [1] * (num - inside),
                                                 batch.decode_context_lens[inside:num], heads, window))
        if batch.prefill is not None:
            group, start = batch.prefill, batch.num_decodes
            for first, end in prefill_runs(group.query_lens, group.context_lens):
                context_lens = torch.tensor(group.context_lens[first:end], device=device)
                groups.append(self._window_group(start, group.block_tables[first:end], group.query_lens[first:end],
                                                 context_lens, heads, window))
                start += sum(group.query_lens[first:end])
        return groups

    def _window_group(self, start: int, tables: torch.Tensor, query_lens: list[int], context_lens: torch.Tensor,
                      heads: torch.Tensor, window: int) -> _Group:
        """Sequences whose queries are the last `query_lens` of their `context_lens` tokens, attending to keys within
        `window` of each query: each one's blocks from the first its first query's window touches, as many as the
        longest query's span needs (past a table's end they repeat its last block, masked)."""
        device, bs = tables.device, self.block_size
        num_seqs, max_q = len(query_lens), max(query_lens)
        span = max_q + window - 1  # keys the queries of one sequence may see, at most
        num_blocks = min(tables.shape[1], (span - 1) // bs + 2)
        q_lens = torch.tensor(query_lens, device=device)
        first_pos = context_lens - q_lens  # each sequence's first query position
        first_block = (first_pos - window + 1).clamp(min=0) // bs
        index = first_block[:, None] + torch.arange(num_blocks, device=device)[None, :]
        window_tables = tables.gather(1, index.clamp(max=tables.shape[1] - 1))
        key_pos = (index[:, :, None] * bs + torch.arange(bs, device=device)).reshape(num_seqs, 1, -1)  # [S, 1, L]
        row = torch.arange(max_q, device=device)
        query_pos = first_pos[:, None] + torch.minimum(row[None, :], q_lens[:, None] - 1)  # padded rows: the last
        query_pos = query_pos[:, :, None]  # [S, Lq, 1]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        length = num_blocks * bs
        pad_index = unpad_index = None
        if max_q > 1:
            mask = mask[None, :, None].expand(1, num_seqs, self.group, max_q, length).reshape(
                1, num_seqs, self.group * max_q, length)
            if min(query_lens) != max_q:
                valid = row[None, :] < q_lens[:, None]
                starts = torch.cumsum(q_lens, 0) - q_lens
                pad_index = torch.where(valid, starts[:, None] + row[None, :], 0).reshape(-1)
                unpad_index = valid.reshape(-1).nonzero().squeeze(1)
        else:
            mask = mask[None]  # [1, S, 1, L]: one query row per sequence, broadcast over its query heads
        return _Group(start, sum(query_lens), num_seqs, max_q, length, self._rows(window_tables, heads),
                      additive(mask, self.dtype), pad_index, unpad_index)

    def _invariant_group(self, batch: StepBatch) -> _Group:
        """All tokens as decode-kernel queries: each attends its sequence's keys [0, position]."""
        num = batch.input_ids.shape[0]
        return _Group(0, num, num, 1, 0, None, None, None, None, kernel_tables=per_token_tables(batch).to(
            torch.int32).contiguous(), kernel_context_lens=(batch.positions + 1).to(torch.int32))

    def _rows(self, block_tables: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        return (heads[:, None, None] * self.num_blocks + block_tables[None]).reshape(-1)

    def _split_shared(self, tables: torch.Tensor, shared_blocks: int, heads: torch.Tensor):
        """(suffix tables, prefix rows or None, prefix length in tokens)."""
        if shared_blocks < MIN_SHARED_BLOCKS:
            return tables, None, 0
        prefix_rows = (heads[:, None] * self.num_blocks + tables[0, :shared_blocks][None]).reshape(-1)
        return tables[:, shared_blocks:], prefix_rows, shared_blocks * self.block_size

    def _decode_group(self, batch: StepBatch, heads: torch.Tensor, first: int, end: int) -> _Group:
        """Decodes [first, end) of the batch; their keys are read up to the longest context among them."""
        tables = batch.decode_block_tables[first:end]
        if batch.decode_context_lens_list is not None:
            tables = tables[:, :-(-max(batch.decode_context_lens_list[first:end]) // self.block_size)]
        tables, prefix_rows, prefix_len = self._split_shared(tables, batch.decode_shared_blocks, heads)
        length = tables.shape[1] * self.block_size
        key_pos = prefix_len + torch.arange(length, device=tables.device)
        context_lens = batch.decode_context_lens[first:end]
        mask = additive((key_pos[None, :] < context_lens[:, None])[None, :, None, :], self.dtype)
        return _Group(first, end - first, end - first, 1, length, self._rows(tables, heads), mask, None, None,
                      prefix_rows, prefix_len)

    def _use_kernel(self, device: torch.device) -> bool:
        return device.type == "cpu" and cpu_kernel.available(self.dtype)

    def _kernel_group(self, batch: StepBatch, heads: torch.Tensor) -> _Group:
        """All decodes, read from the pool by the CPU kernel, each to its own length (no gather, no mask)."""
        tables, prefix_rows, prefix_len = self._split_shared(batch.decode_block_tables, batch.decode_shared_blocks,
                                                             heads)
        num = batch.num_decodes
        return _Group(0, num, num, 1, 0, None, None, None, None, prefix_rows, prefix_len,
                      tables.to(torch.int32).contiguous(), (batch.decode_context_lens - prefix_len).to(torch.int32))

    def _prefill_run(self, group: PrefillGroup, first: int, end: int) -> PrefillGroup:
        """Prefills [first, end) of the group, their tables cut to their longest context, their own shared prefix."""
        query_lens, context_lens = group.query_lens[first:end], group.context_lens[first:end]
        tables = group.block_tables[first:end, :-(-max(context_lens) // self.block_size)]
        shared = shared_prefix_blocks(tables.tolist(), [c - q for c, q in zip(context_lens, query_lens, strict=True)],
                                      self.block_size)
        return PrefillGroup(query_lens, context_lens, tables, shared)

    def _prefill_group(self, group: PrefillGroup, start: int, heads: torch.Tensor) -> _Group:
        tables, prefix_rows, prefix_len = self._split_shared(group.block_tables, group.shared_blocks, heads)
        device = tables.device
        num_seqs, max_q = len(group.query_lens), max(group.query_lens)
        length = tables.shape[1] * self.block_size
        if prefix_rows is None and causal_pays(group.query_lens, group.context_lens, length):
            return _Group(start, sum(group.query_lens), num_seqs, max_q, length, self._rows(tables, heads), None,
                          None, None, causal_spans=self._causal_spans(group, device))
        q_lens = torch.tensor(group.query_lens, device=device)
        ctx_lens = torch.tensor(group.context_lens, device=device)
        row = torch.arange(max_q, device=device)
        valid = row[None, :] < q_lens[:, None]  # [S, Lq]
        starts = torch.cumsum(q_lens, 0) - q_lens
        pad_index = unpad_index = None  # equal query lengths (e.g. verifying drafts): no padding to do
        if min(group.query_lens) != max_q:
            pad_index = torch.where(valid, starts[:, None] + row[None, :], 0).reshape(-1)
            unpad_index = valid.reshape(-1).nonzero().squeeze(1)
        query_pos = (ctx_lens - q_lens)[:, None] + row[None, :]  # absolute position of each query row
        key_pos = prefix_len + torch.arange(length, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]  # causal; also bounds the context
        mask = mask[None, :, None].expand(1, num_seqs, self.group, max_q, length)
        mask = additive(mask.reshape(1, num_seqs, self.group * max_q, length), self.dtype)
        return _Group(start, int(q_lens.sum()), num_seqs, max_q, length, self._rows(tables, heads), mask, pad_index,
                      unpad_index, prefix_rows, prefix_len)

    def _causal_spans(self, group: PrefillGroup, device: torch.device) -> list[_Span]:
        spans, offset = [], 0
        for query_len, context_len in zip(group.query_lens, group.context_lens, strict=True):
            lead, mask = context_len - query_len, None  # the queries sit at the context's end
            if not leading_pays(query_len, context_len):
                key_pos = torch.arange(context_len, device=device)
                mask = additive(key_pos[None, :] <= (lead + torch.arange(query_len, device=device))[:, None],
                                self.dtype)
                lead = 0
            spans.append(_Span(offset, query_len, context_len, lead, mask))
            offset += query_len
        return spans

    def _attend_causal(self, q_grp: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, grp: _Group,
                       out: torch.Tensor) -> None:
        """Each prefill of the group on its own keys [Hkv, context, D], its query heads sharing them (GQA)."""
        heads, d = self.num_kv_heads * self.group, self.head_dim
        for i, span in enumerate(grp.causal_spans):
            rows = q_grp[span.offset:span.offset + span.query_len]
            if span.lead:
                rows = torch.cat([rows.new_zeros(span.lead, rows.shape[1]), rows])
            queries = rows.view(-1, heads, d).transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                queries[None], keys[None, :, i, :span.context_len], values[None, :, i, :span.context_len],
                attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True)
            out[span.offset:span.offset + span.query_len] = attn[0, :, span.lead:].transpose(0, 1).reshape(
                span.query_len, -1)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        hkv, d, g = self.num_kv_heads, self.head_dim, self.group
        k_pool, v_pool = self.k_caches[layer], self.v_caches[layer]
        k_scale, v_scale = self._scales(layer)
        if self.kernel_slots is not None:
            cpu_kernel.write_kv(k, v, k_pool, v_pool, self.kernel_slots, k_scale, v_scale)
        else:
            self._store(k_pool, k.view(num_tokens, hkv, d), k_scale)
            self._store(v_pool, v.view(num_tokens, hkv, d), v_scale)
        k_rows, v_rows = self._pool_rows(layer)
        out = torch.empty_like(q)
        window = self.layer_windows[layer] if self.layer_windows is not None else None
        for grp in self.window_groups[window] if window else self.groups:
            q_grp = q[grp.start:grp.start + grp.num_tokens]
            if grp.kernel_tables is not None:
                out[grp.start:grp.start + grp.num_tokens] = self._kernel_decode(q_grp, grp, layer)
                continue
            keys = self._read(k_rows, grp.gather_index, k_scale).view(hkv, grp.num_seqs, grp.suffix_len, d)
            values = self._read(v_rows, grp.gather_index, v_scale).view(hkv, grp.num_seqs, grp.suffix_len, d)
            if grp.causal_spans is not None:
                self._attend_causal(q_grp, keys, values, grp, out[grp.start:grp.start + grp.num_tokens])
                continue
            lq = grp.max_query_len
            if lq == 1:  # decode: one query row per sequence
                queries = q_grp.view(grp.num_seqs, hkv, g, d).transpose(0, 1)
            else:
                padded = q_grp if grp.pad_index is None else q_grp.index_select(0, grp.pad_index)
                queries = padded.view(grp.num_seqs, lq, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv, grp.num_seqs,
                                                                                                  g * lq, d)
            if grp.prefix_index is None:
                attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=grp.mask)
            else:
                attn = self._cascade(queries, keys, values, grp, layer).to(q.dtype)
            if lq == 1:
                out[grp.start:grp.start + grp.num_tokens] = attn.transpose(0, 1).reshape(grp.num_tokens, -1)
            else:
                attn = attn.view(hkv, grp.num_seqs, g, lq, d).permute(1, 3, 0, 2, 4).reshape(grp.num_seqs * lq, -1)
                rows = attn if grp.unpad_index is None else attn.index_select(0, grp.unpad_index)
                out[grp.start:grp.start + grp.num_tokens] = rows
        return out

    def _scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's per-head K and V scales [Hkv] of an FP8 pool; (None, None) for a pool of the model's dtype."""
        if self.k_scales is None:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def _store(self, pool: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None) -> None:
        """x [T, Hkv, D] into the pool at the step's slots, quantised with `scale` into an FP8 pool."""
        d = self.head_dim
        if scale is not None:  # index_copy_ has no float8 kernel on CPU: copy the bytes
            pool, x = pool.view(torch.uint8), quantize(x, scale).view(torch.uint8)
        pool.view(-1, d).index_copy_(0, self.write_index, x.transpose(0, 1).reshape(-1, d))

    def _read(self, rows: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Rows `index` (head-major) of a pool's [Hkv * NB, BS * D] view, in the model's dtype: FP8 rows are
        dequantised after the gather, only those."""
        gathered = rows.index_select(0, index)
        if scale is None:
            return gathered
        return dequantize(gathered.view(self.num_kv_heads, -1), scale, self.dtype).view(gathered.shape)

    def _pool_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_kv_heads * self.num_blocks, self.block_size * self.head_dim)
        return self.k_caches[layer].view(shape), self.v_caches[layer].view(shape)

    def _kernel_decode(self, q_grp: torch.Tensor, grp: _Group, layer: int) -> torch.Tensor:
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        k_scale, v_scale = self._scales(layer)
        out, lse = cpu_kernel.paged_decode(q_grp, self.k_caches[layer], self.v_caches[layer], grp.kernel_tables,
                                           grp.kernel_context_lens, with_lse=grp.prefix_index is not None,
                                           k_scale=k_scale, v_scale=v_scale)
        if grp.prefix_index is not None:  # merge with the shared prefix, attended once for all (as in _cascade)
            queries = q_grp.reshape(grp.num_seqs, hkv, g, d)
            k_rows, v_rows = self._pool_rows(layer)
            prefix_k = self._read(k_rows, grp.prefix_index, k_scale).view(hkv, 1, grp.prefix_len, d)
            prefix_v = self._read(v_rows, grp.prefix_index, v_scale).view(hkv, 1, grp.prefix_len, d)
            flat_q = queries.transpose(0, 1).reshape(hkv, 1, -1, d)
            out_prefix, lse_prefix = attend_with_lse(flat_q, prefix_k, prefix_v, None)
            out_prefix = out_prefix.view(hkv, grp.num_seqs, g, d).transpose(0, 1)
            lse_prefix = lse_prefix.view(hkv, grp.num_seqs, g, 1).transpose(0, 1)
            lse_suffix = lse.unsqueeze(-1)
            total = torch.logaddexp(lse_prefix, lse_suffix)
            out = out_prefix * torch.exp(lse_prefix - total) + out * torch.exp(lse_suffix - total)
        return out.reshape(grp.num_seqs, -1)

    def _cascade(self, queries, keys, values, grp: _Group, layer: int) -> torch.Tensor:
        """Shared prefix once for all queries of the group, each suffix on its own, merged by log-sum-exp."""
        hkv, d = self.num_kv_heads, self.head_dim
        k_rows, v_rows = self._pool_rows(layer)
        k_scale, v_scale = self._scales(layer)
        prefix_k = self._read(k_rows, grp.prefix_index, k_scale).view(hkv, grp.prefix_len, d)
        prefix_v = self._read(v_rows, grp.prefix_index, v_scale).view(hkv, grp.prefix_len, d)
        flat_q = queries.reshape(hkv, 1, -1, d)
        out_prefix, lse_prefix = attend_with_lse(flat_q, prefix_k[:, None], prefix_v[:, None], None)
        out_prefix, lse_prefix = out_prefix.view(queries.shape), lse_prefix.view(*queries.shape[:-1], 1)
        out_suffix, lse_suffix = attend_with_lse(queries, keys, values, grp.mask)
        lse = torch.logaddexp(lse_prefix, lse_suffix)
        return out_prefix * torch.exp(lse_prefix - lse) + out_suffix * torch.exp(lse_suffix - lse)
