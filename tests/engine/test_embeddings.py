"""Embeddings against the reference: every vector of the bundled all-MiniLM-L6-v2 has cosine >= 0.9999 with
sentence-transformers' `encode(normalize_embeddings=True)` in float32, and a row batched with others gets the
vector it gets alone."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, PoolingParams
from tokenmill.bench.sentences import held_out_sentences

MODEL = "all-minilm-l6-v2"
pytestmark = pytest.mark.real_model  # the bundled embedding model


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    texts = held_out_sentences(24, seed=7, max_sentences=6)  # about 10 to 160 tokens
    return texts + ["Hi", "naïve café — 東京 🙂", "a " * 120]  # tiny, non-ASCII, long repetitive


@pytest.fixture(scope="module", params=["packed", "torch"])
def llm(request):
    """Both attention paths: the C kernel over packed rows, and torch's per bucket (the default on AMX CPUs)."""
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
