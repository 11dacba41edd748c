"""Embeddings against the reference: every vector of the bundled all-MiniLM-L6-v2 has cosine >= 0.9999 with
sentence-transformers' `encode(normalize_embeddings=True)` in float32, and a row batched with others gets the
vector it gets alone."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, PoolingParams
from tests.engine.cpu_flags import amx_expected
from tokenmill.bench.sentences import held_out_sentences

MODEL = "all-minilm-l6-v2"
pytestmark = pytest.mark.real_model  # the bundled embedding model


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    texts = held_out_sentences(24, seed=7, max_sentences=6)  # about 10 to 160 tokens
    return texts + ["Hi", "naïve café — 東京 🙂", "a " * 120]  # tiny, non-ASCII, long repetitive


@pytest.fixture(scope="module", params=["packed", "torch"])
def llm(request):
    """Both attention paths: the C kernel over packed rows, and torch's per bucket (the default in bfloat16 on AMX
    CPUs whose tiles don't take the head_dim)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TOKENMILL_ENCODER_ATTENTION", request.param)
        engine = LLM(model=MODEL, dtype="float32", num_threads=2)
    assert all(layer.packed_attention == (request.param == "packed") for layer in engine.engine.model.layers)
    return engine


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(_model_dir()), device="cpu")


def _model_dir():
    from engine.model_loader import resolve_model

    return resolve_model(MODEL)


def _matrix(outputs) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs], dtype=np.float32)


@pytest.fixture(scope="module")
def ours(llm, sentences) -> np.ndarray:
    return _matrix(llm.embed(sentences))


def test_matches_sentence_transformers(ours, reference, sentences):
    theirs = reference.encode(sentences, normalize_embeddings=True, convert_to_numpy=True)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert ours.shape == (len(sentences), 384)
    assert cosine.min() >= 0.9999, f"worst cosine {cosine.min():.6f} for {sentences[int(cosine.argmin())]!r}"
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)


def test_batched_same_as_alone(llm, ours, sentences):
    alone = np.concatenate([_matrix(llm.embed([s])) for s in sentences[::6]])
    assert np.abs(ours[::6] - alone).max() < 1e-5


def test_vllm_output_shape(llm):
    [output] = llm.embed("Hello world")
    assert output.request_id and output.finished
    assert output.prompt_token_ids == llm.get_tokenizer()("Hello world")["input_ids"]
    assert len(output.outputs.embedding) == output.outputs.hidden_size == 384
    assert llm.embed([[101, 7592, 2088, 102]])[0].outputs.embedding == output.outputs.embedding  # token ids in


def test_over_long_input_refused_or_truncated_as_sentence_transformers(llm, reference):
    text = " ".join(held_out_sentences(40, seed=3))
    with pytest.raises(ValueError, match="max_seq_length of 256"):
        llm.embed([text])
    [cut] = llm.embed([text], PoolingParams(truncate=True))
    assert len(cut.prompt_token_ids) == 256
    theirs = reference.encode([text], normalize_embeddings=True)[0]
    assert float(np.dot(cut.outputs.embedding, theirs)) >= 0.9999


def test_dimensions_refused_and_generation_refused(llm):
    with pytest.raises(ValueError, match="does not support 'dimensions'"):
        llm.embed(["x"], PoolingParams(dimensions=128))
    with pytest.raises(ValueError, match="embedding model: use LLM.embed"):
        llm.generate(["x"])


@pytest.fixture(scope="module")
def bfloat16_llm():
    return LLM(model=MODEL, dtype="bfloat16", num_threads=2)


def test_bfloat16_attention_takes_the_tiles_exactly_where_the_cpu_has_amx(bfloat16_llm):
    """Elsewhere the vector kernel or torch's run."""
    layers = bfloat16_llm.engine.model.layers
    assert all(layer.ops.tiles_take(layer.head_dim) == amx_expected() for layer in layers)


@pytest.mark.skipif(not amx_expected(), reason="no AMX on this CPU: bfloat16 encoder attention on the tiles")
def test_bfloat16_attention_runs_on_amx_tiles_where_it_can(bfloat16_llm, sentences, reference, monkeypatch):
    """On CPUs with AMX, bfloat16 attention over the packed rows runs on the tiles (amx_gemm.c), close to torch's
    fused attention per bucket and to the float32 reference."""
    tiled = bfloat16_llm
    layers = tiled.engine.model.layers
    assert all(layer.ops.tiles_take(layer.head_dim) for layer in layers)
    assert all(layer.packed_attention for layer in layers)
    monkeypatch.setenv("TOKENMILL_ENCODER_ATTENTION", "torch")
    by_torch = LLM(model=MODEL, dtype="bfloat16", num_threads=2)
    ours, torchs = _matrix(tiled.embed(sentences)), _matrix(by_torch.embed(sentences))
    theirs = reference.encode(sentences, normalize_embeddings=True, convert_to_numpy=True)
    assert (ours * torchs).sum(1).min() >= 0.9995  # both unit vectors
    assert (ours * theirs).sum(1).min() >= 0.999


def test_without_amx_the_encoder_ops_never_take_the_tiles(monkeypatch):
    """On every CPU: as built without AMX (amx_ready False), bfloat16 encoder attention stays off the tiles."""
    import torch

    from engine.kernels import cpu_kernel

    if amx_expected():
        monkeypatch.setattr(cpu_kernel, "amx_ready", lambda: False)
    ops = cpu_kernel.encoder_ops(torch.bfloat16)
    assert ops is None or not ops.tiles_take(32)


@pytest.mark.skipif(not amx_expected(), reason="no AMX on this CPU: the tiles' attention kernel")
def test_the_tiles_attention_kernel_matches_softmax_attention_per_row():
    """Rows of 1 to 256 tokens (across tile edges), head_dim 32 and 64, against torch's attention in float32."""
    import torch

    from engine.kernels import cpu_kernel

    ops = cpu_kernel.encoder_ops(torch.bfloat16)
    assert ops.tiles_take(32) and ops.tiles_take(64)
    generator = torch.Generator().manual_seed(3)
    lengths = [1, 3, 16, 17, 31, 32, 33, 50, 64, 100, 256]
    starts = torch.tensor([sum(lengths[:i]) for i in range(len(lengths))])
    for heads, head_dim in ((12, 32), (4, 64)):
        qkv = torch.randn(sum(lengths), 3 * heads * head_dim, generator=generator).bfloat16()
        out = ops.packed_attention(qkv, starts, torch.tensor(lengths), max(lengths), heads).float()
        for start, length in zip(starts.tolist(), lengths, strict=True):
            q, k, v = qkv[start:start + length].float().view(length, 3, heads, head_dim).permute(1, 2, 0, 3)
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(length, -1)
            assert (out[start:start + length] - expected).abs().max() < 0.03, f"length {length}, head_dim {head_dim}"


def test_float32_matmul_precision_high_runs_on_amx_tiles_within_the_bound(sentences, reference, caplog):
    """float32 with matmul precision "high": on CPUs with AMX every projection runs as three bfloat16 products on
    the tiles, still within the bound against sentence-transformers and batched the same as alone; elsewhere as
    "highest", with a warning that says so."""
    from engine.config import EngineConfig
    from engine.kernels import cpu_kernel
    from engine.kernels.cpu_gemm import Linear

    with pytest.raises(ValueError, match="float32_matmul_precision must be one of"):
        EngineConfig(model=MODEL, float32_matmul_precision="medium")
    with caplog.at_level("WARNING", logger="tokenmill.engine"):
        llm = LLM(model=MODEL, dtype="float32", num_threads=2, float32_matmul_precision="high")
    kinds = {m.packed.kind for m in llm.engine.model.modules() if isinstance(m, Linear)}
    assert (kinds == {"amx_split"}) == cpu_kernel.amx_ready(), kinds
    assert ("runs at 'highest'" in caplog.text) != cpu_kernel.amx_ready(), caplog.text
    ours = _matrix(llm.embed(sentences))
    theirs = reference.encode(sentences, normalize_embeddings=True, convert_to_numpy=True)
    assert (ours * theirs).sum(1).min() >= 0.9999
    alone = np.concatenate([_matrix(llm.embed([s])) for s in sentences[::6]])
    assert np.abs(ours[::6] - alone).max() < 1e-5
