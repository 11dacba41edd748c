"""Token sampling for one step: logits processors and grammar masks, greedy, temperature, top-k, top-p,
draft verification and logprobs; per-request seeded streams.

Sampling is the exponential race: token = argmax_i p_i / E_i with E_i ~ Exp(1), which draws exactly from p. It is
computed as argmax_i (l_i - max l) / T - log(E_i) over the tokens top-k / top-p keep, so no softmax is needed. The
noise comes from a counter-based hash, not a generator: E_i = -log(u_i), u_i from the 32-bit hash of token i under
a 64-bit row key (`noise_key`). A seeded request's key for its n-th output token is a hash of (seed, n), in both
modes: its text is the same alone or in any batch, after preemption, and when verifying drafts position by position
(`sample_positions`). Unseeded rows are keyed by the engine's seed and a count of rows drawn. The race runs in C
(csrc/sampling.c: a cheap bound rules out most tokens, the rest get exact float64 keys) or, without a compiler or off
the CPU, in torch with the same operations (`race_torch`): the same tokens either way. Draft models and the rejection
sampler's accept tests still draw from per-request torch generators (`generator_of`, `uniform`).
(Before 2026-12 seeded noise came from a torch generator per request, or per (seed, n) in batch-invariant mode: a
seed gives another text now, from the same distribution.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from engine.kernels.cpu_kernel import sampling_library
from engine.logits_processors import apply_logits_processors
from engine.outputs import Logprob, SampleLogprobs
from engine.step_types import SampleLayout, SamplerOutput

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence
    from engine.structured_outputs import StructuredOutputs


# (logits rows, sequences, drafts, draft distributions, sampler) -> each sequence's accepted drafts and one more token:
# the speculative decoder's verification (engine/spec_decode/verifier.py's verify_drafts)
VerifyDrafts = Callable[..., list[list[int]]]


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k <= 0 keeps all); ties at the k-th value are kept."""
    vocab = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab))
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (the most likely always kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p[:, None]
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


class Sampler:
    def __init__(self, seed: int = 0, stop_token_ids: frozenset[int] = frozenset(),
                 structured: StructuredOutputs | None = None, verify_drafts: VerifyDrafts | None = None) -> None:
        """`stop_token_ids`: EOS ids, masked under min_tokens; `structured`: the engine's grammars; `verify_drafts`:
        how drafts are accepted, plugged in by the engine (a sampler without it verifies none)."""
        self.seed = seed
        self.verify_drafts = verify_drafts
        self.generator = torch.Generator().manual_seed(seed)
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> its seeded stream (drafts, accept tests)
        self.unseeded_draws = 0  # rows of unseeded requests drawn so far: their noise keys
        self.stop_token_ids = stop_token_ids
        self.structured = structured
        self.batch_invariant = False  # seeded drafts verified position by position (set by the model runner)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget finished sequences' streams and grammar matchers."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
        if self.structured is not None:
            self.structured.release(seq_ids)

    def sample(self, layout: SampleLayout, logits: torch.Tensor) -> SamplerOutput:
        """logits: the layout's rows -> each sequence's tokens: one sampled token, or the accepted drafts and
        then one recovered or bonus token."""
        seqs = layout.seqs
        logprobs = None
        extras = [s.params for s in seqs.values() if s.params.has_extras]
        if extras:
            if any(p.logprobs is not None for p in extras):  # the model's own, before any mask
                logprobs = logits.float().log_softmax(dim=-1)
            if any(p.has_penalties or p.logit_bias or p.min_tokens for p in extras):
                logits = logits.float()
                apply_logits_processors(logits, layout, self.stop_token_ids)
            if self.structured is not None and self.structured.constrains(seqs.values()):
                logits = self.structured.mask(logits, layout)
        tokens: dict[int, list[int]] = {}
        plain = layout.plain
        if plain:
            rows = [layout.first_row[i] for i in plain]
            plain_logits = logits if len(rows) == logits.shape[0] else logits[rows]  # all plain, in order: no gather
            tokens.update((i, [t]) for i, t in zip(plain, self(plain_logits, [seqs[i] for i in plain]), strict=True))
        if layout.drafts:
            ids = list(layout.drafts)
            rows = [logits[layout.first_row[i]:layout.first_row[i] + 1 + len(layout.drafts[i])] for i in ids]
            verified = self.verify_drafts(rows, [seqs[i] for i in ids], [layout.drafts[i] for i in ids],
                                          [layout.draft_probs.get(i) for i in ids], self)
            tokens.update(zip(ids, verified, strict=True))
        tokens = {i: tokens[i] for i in seqs}  # in layout order
        return SamplerOutput(tokens, record_logprobs(logprobs, layout, tokens) if logprobs is not None else {})

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] -> one token per sequence."""
        params = [s.params for s in seqs]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if not sampled:
            return logits.max(dim=-1).indices.tolist()  # first maximum, like argmax, and faster on CPU
        tokens = [0] * len(seqs)
        if len(sampled) < len(seqs):
            greedy = [i for i, p in enumerate(params) if p.temperature == 0]
            for i, token in zip(greedy, logits[greedy].max(dim=-1).indices.tolist(), strict=True):
                tokens[i] = token
            logits = logits[sampled]
        drawn = self.race(logits, [params[i] for i in sampled], self.noise_keys([seqs[i] for i in sampled]))
        for i, token in zip(sampled, drawn.tolist(), strict=True):
            tokens[i] = token
        return tokens

    @staticmethod
    def race(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> torch.Tensor:
        """The exponential race of each row (temperature > 0) under its noise key -> int64 tokens."""
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = logits.float().masked_fill(Sampler.scaled(logits, params).isneginf(), float("-inf"))
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64)
        return exponential_race(logits, temperature, keys)

    @staticmethod
    def scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each row's logits / temperature (greedy rows: T = 1), -inf where top-k or top-p drop a token."""
        temperature = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
        scaled = logits.float() / temperature[:, None]
        if any(p.top_k > 0 for p in params):
            scaled = apply_top_k(scaled, torch.tensor([max(p.top_k, 0) for p in params]))
        if any(p.top_p < 1 for p in params):
            scaled = apply_top_p(scaled, torch.tensor([p.top_p for p in params]))
        return scaled

    @staticmethod
    def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Each row's sampling distribution after temperature, top-k and top-p (greedy rows: T = 1)."""
        return Sampler.scaled(logits, params).softmax(dim=-1)

    def generator_of(self, seq: Sequence) -> torch.Generator:
        """The sequence's own seeded stream, or the engine-wide one (draft models' draws, accept tests)."""
        if seq.sample_seed is None:
            return self.generator
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.sample_seed)
        return self.generators[seq.seq_id]

    def noise_keys(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's noise key for the token it samples now: (seed, output position), or for an unseeded one
        the engine's seed and the next count of unseeded rows."""
        keys = []
        for seq in seqs:
            if seq.sample_seed is not None:
                keys.append(noise_key(seq.sample_seed, seq.num_output_tokens))
            else:
                keys.append(unseeded_key(self.seed, self.unseeded_draws))
                self.unseeded_draws += 1
        return keys

    def exponential(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """Exp(1) noise [len(seqs), width] float32: the E_i each sequence's race would use now (`noise_keys`)."""
        return noise_rows(self.noise_keys(seqs), width)

    def sample_positions(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """A seeded sequence's logits [m, vocab] at its next m positions -> the token it samples at each, as it would
        one step at a time."""
        keys = [noise_key(seq.sample_seed, seq.num_output_tokens + i) for i in range(logits.shape[0])]
        return self.race(logits, [seq.params] * logits.shape[0], keys)

    def uniform(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """U(0, 1) draws, one row per sequence, each from that sequence's stream."""
        draws = torch.rand(len(seqs), width, generator=self.generator)
        for row, seq in enumerate(seqs):
            if seq.sample_seed is not None:
                draws[row] = torch.rand(width, generator=self.generator_of(seq))
        return draws


MASK64 = (1 << 64) - 1
UNSEEDED = 1 << 63  # folded into the engine's seed: unseeded keys never meet a request's seed (< 2^63)
SQRT_HALF = 0.7071067811865476
LN2 = 0.6931471805599453
LOG_TERMS = 12  # as in csrc/sampling.c


def _mix64(z: int) -> int:
    """SplitMix64's step: a bijection of 64-bit integers."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 64-bit noise key of output token `position` of a request (or sample) seeded `seed`."""
    return _mix64((_mix64(seed & MASK64) + position) & MASK64)


def unseeded_key(engine_seed: int, draw: int) -> int:
    """The noise key of an engine's `draw`-th row of an unseeded request."""
    return noise_key((engine_seed & MASK64) ^ UNSEEDED, draw)


def position_noise(seed: int, index: int, width: int) -> torch.Tensor:
    """Exp(1) noise [width] for output token `index` of a request seeded `seed`: the same however the tokens are
    batched."""
    return noise_rows([noise_key(seed, index)], width)[0]


def exponential_race(logits: torch.Tensor, temperature: torch.Tensor, keys: list[int],
                     kernel: bool = True) -> torch.Tensor:
    """Rows of logits [rows, vocab] (-inf: never drawn), temperature [rows] > 0 (float64) and 64-bit noise keys ->
    each row's token (int64): argmax_i (l_i - max l) / T - log(E_i), the first on ties. In C on CPU tensors
    (csrc/sampling.c), else `race_torch`; `kernel=False`: torch. Both give the same tokens."""
    library = sampling_library() if kernel and logits.device.type == "cpu" else None
    if library is None:
        return race_torch(logits, temperature, keys)
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    temperature = temperature.to(torch.float64).contiguous()
    packed = _packed_keys(keys)
    tokens = torch.empty(len(keys), dtype=torch.int64)
    library.exp_race_f32(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                         temperature.data_ptr(), packed.data_ptr(), tokens.data_ptr(), torch.get_num_threads())
    return tokens


def race_torch(logits: torch.Tensor, temperature: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """`exponential_race` in torch ops, on any device: the C kernel's exact keys for every token (32 rows at a time,
    to bound the float64 temporaries)."""
    logits = logits.float()
    temperature = temperature.to(logits.device, torch.float64)
    tokens = []
    for start in range(0, logits.shape[0], 32):
        rows = logits[start:start + 32]
        peak = rows.max(dim=-1, keepdim=True).values
        scaled = (rows.double() - peak.double()) / temperature[start:start + 32, None]
        noise = exponential_noise(keys[start:start + 32], rows.shape[-1], rows.device)
        tokens.append((scaled - exact_log(noise)).argmax(dim=-1))
    return torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.int64, device=logits.device)


def noise_rows(keys: list[int], width: int) -> torch.Tensor:
    """Exp(1) noise [len(keys), width] float32 under each row's key: E_i of the race, rounded to float32."""
    library = sampling_library()
    if library is None:
        return exponential_noise(keys, width, torch.device("cpu")).float()
    noise, packed = torch.empty(len(keys), width), _packed_keys(keys)
    library.exp_noise_f32(packed.data_ptr(), len(keys), width, noise.data_ptr())
    return noise


def exponential_noise(keys: list[int], width: int, device: torch.device) -> torch.Tensor:
    """E_i = -log(u_i) [len(keys), width] float64, u_i = (h_i + 0.5) / 2^32, h_i the hash of token i under the key."""
    k0 = torch.tensor([key & 0xFFFFFFFF for key in keys], device=device)[:, None]
    k1 = torch.tensor([key >> 32 for key in keys], device=device)[:, None]
    bits = _mix32(_mix32(torch.arange(width, device=device) ^ k0) ^ k1)
    return -exact_log((bits.double() + 0.5) * 2.0 ** -32)


def exact_log(x: torch.Tensor) -> torch.Tensor:
    """log of normal float64 x > 0 with IEEE +, -, *, / and frexp only, as csrc/sampling.c's exact_log: the same
    bits."""
    mantissa, exponent = torch.frexp(x)
    small = mantissa < SQRT_HALF
    mantissa = torch.where(small, mantissa * 2.0, mantissa)
    exponent = torch.where(small, exponent - 1, exponent)
    f = mantissa - 1.0
    s = f / (2.0 + f)
    z = s * s
    series = torch.full_like(z, 1.0 / (2 * LOG_TERMS - 1))
    for k in range(LOG_TERMS - 2, -1, -1):
        series = series * z + 1.0 / (2 * k + 1)
    return exponent.double() * LN2 + 2.0 * s * series


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), without overflowing int64."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """csrc/sampling.c's mix32 on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x735A2D97)
    return x ^ (x >> 15)


def _packed_keys(keys: list[int]) -> torch.Tensor:
    """64-bit keys as int64 (two's complement), as the C kernel reads its uint64s."""
    return torch.tensor([key - (1 << 64) if key >> 63 else key for key in keys], dtype=torch.int64)


def record_logprobs(logprobs: torch.Tensor, layout: SampleLayout,
                    tokens: dict[int, list[int]]) -> dict[int, SampleLogprobs]:
    """For each sequence asking for logprobs, per new token {token: Logprob} for the sampled token and the top
    params.logprobs tokens of its row (a sequence with drafts: one row per accepted token)."""
    out: dict[int, SampleLogprobs] = {}
    for seq_id, seq in layout.seqs.items():
        k = seq.params.logprobs
        if k is None or not tokens[seq_id]:
            continue
        start = layout.first_row[seq_id]
        rows = logprobs[start:start + len(tokens[seq_id])]
        chosen = torch.tensor(tokens[seq_id], device=rows.device)[:, None]
        chosen_lp = rows.gather(1, chosen)
        ranks = ((rows > chosen_lp).sum(dim=-1) + 1).tolist()
        top = rows.topk(k, dim=-1) if k else None
        entries = out[seq_id] = []
        for i, token in enumerate(tokens[seq_id]):
            entry = {token: Logprob(chosen_lp[i, 0].item(), ranks[i])}
            if top is not None:
                for rank, (value, top_token) in enumerate(zip(top.values[i].tolist(), top.indices[i].tolist(),
                                                              strict=True), start=1):
                    entry.setdefault(top_token, Logprob(value, rank))
            entries.append(entry)
    return out
