"""Medusa heads: exact greedy output whatever the head proposes (a tiny random model and random heads), the head
directory's round trip and its checks, and a head trained for a few seconds on the real model by
`tokenmill spec train-head`'s code, which loads, keeps the greedy tokens and gets drafts accepted."""

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.medusa import CONFIG_FILE, MedusaHeads
from tests.engine.test_tiny_models import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny(path, tokenizer, "llama")
    return path


def random_heads(path, vocab_size: int, scale: float, seed: int, vocab: torch.Tensor | None = None) -> MedusaHeads:
    generator = torch.Generator().manual_seed(seed)
    vocab = torch.arange(vocab_size) if vocab is None else vocab
    heads = MedusaHeads(64, 4, vocab, vocab_size)
    with torch.no_grad():
        heads.weight.copy_(scale * torch.randn(heads.weight.shape, generator=generator))
        heads.bias.copy_(scale * torch.randn(heads.bias.shape, generator=generator))
    heads.save(path)
    return heads


@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_random_heads_keep_greedy_tokens(scale, tiny, tokenizer, tmp_path):
    """Zero heads propose the LM head's own token again (which checks that the hidden state read is the last
    token's); random ones propose noise: either way the tokens are those of plain decoding."""
    vocab = None if scale == 0 else torch.randperm(len(tokenizer), generator=torch.Generator().manual_seed(3))[:2000]
    random_heads(tmp_path / "head", len(tokenizer), scale, seed=1, vocab=vocab)
    prompts = [tokenizer.encode(t) for t in ("Hello there", "1 2 3 4 5 6 7 8 9", "The quick brown fox " * 5)]
    params = SamplingParams(max_tokens=40, temperature=0)
    plain = [o.outputs[0].token_ids for o in LLM(str(tiny), dtype="float32", num_threads=2).generate(prompts, params)]
    spec = {"method": "medusa", "model": str(tmp_path / "head"), "num_speculative_tokens": 4}
    llm = LLM(str(tiny), dtype="float32", num_threads=2, speculative_config=spec)
    proposer, seen = llm.engine.spec.draft, []
    real_propose = proposer.propose

    def propose(work):
        drafts, probs = real_propose(work)
        seen.extend((seq.token_ids[-1], drafts[seq.seq_id][0]) for seq, _ in work if drafts[seq.seq_id])
        return drafts, probs

    proposer.propose = propose
    for batch in (prompts, *[[p] for p in prompts]):  # together and one at a time (batch 1)
        outs = llm.generate(batch, params)
        assert [o.outputs[0].token_ids for o in outs] == [plain[prompts.index(p)] for p in batch]
    stats = llm.engine.spec.stats
    assert stats.draft_tokens > 0
    assert len(seen) == stats.drafted_by_position[0] > 0  # every step had the hidden state of each last token
    if scale == 0:  # zero heads are the LM head: their drafts repeat the token the hidden state there gave
        assert all(last == first for last, first in seen)


def test_head_round_trip_and_checks(tmp_path):
    heads = random_heads(tmp_path / "head", 500, 0.5, seed=2, vocab=torch.arange(0, 500, 5))
    loaded = MedusaHeads.load(tmp_path / "head", hidden_size=64, target_vocab_size=500)
    assert torch.equal(loaded.weight, heads.weight) and torch.equal(loaded.bias, heads.bias)
    assert torch.equal(loaded.vocab, heads.vocab)
    hidden = torch.randn(3, 64)
    assert torch.equal(loaded(hidden), heads(hidden))
    with pytest.raises(ValueError, match="hidden size"):
        MedusaHeads.load(tmp_path / "head", hidden_size=32)
    with pytest.raises(ValueError, match="vocabulary"):
        MedusaHeads.load(tmp_path / "head", target_vocab_size=501)
    with pytest.raises(FileNotFoundError, match="train-head"):
        MedusaHeads.load(tmp_path / "nothing")
    config = json.loads((tmp_path / "head" / CONFIG_FILE).read_text())
    (tmp_path / "head" / CONFIG_FILE).write_text(json.dumps({**config, "method": "eagle"}))
    with pytest.raises(ValueError, match="not a Medusa head"):
        MedusaHeads.load(tmp_path / "head")
    with pytest.raises(ValueError, match="1 to 16 heads"):
        MedusaHeads(64, 0, torch.arange(5), 5)


def test_config_checks(tiny, tmp_path, tokenizer):
    with pytest.raises(ValueError, match='"medusa" needs "model"'):
        SpeculativeConfig.from_dict({"method": "medusa"})
    random_heads(tmp_path / "head", len(tokenizer), 0.1, seed=4)
    MedusaHeads(32, 2, torch.arange(10), len(tokenizer)).save(tmp_path / "other")
    spec = {"method": "medusa", "model": str(tmp_path / "head"), "num_speculative_tokens": 5}
    llm = LLM(str(tiny), dtype="float32", num_threads=2, speculative_config=spec)
    assert llm.engine.spec.config.num_speculative_tokens == 4  # one draft per head at most
    with pytest.raises(ValueError, match="hidden size"):  # a head of another model
        llm.engine.set_speculative_config({**spec, "model": str(tmp_path / "other")})


def test_short_training_gives_a_head_that_keeps_greedy_tokens(model_dir, tokenizer, tmp_path):
    """`tokenmill spec train-head`'s code on a few prompts and seconds: the head loads, the greedy tokens stay
    those of plain decoding (batch-invariant, so that verifying 1 + k rows sums as decoding one does: no near-tie
    flips), and some drafts are accepted (on the prompts it was trained on)."""
    from tokenmill.spec_head import TrainSettings, sharegpt_split, train_medusa_head

    settings = TrainSettings(seconds=6, max_prompts=4, max_tokens=24, vocab_size=1024, min_steps=150)
    summary = train_medusa_head(model_dir, tmp_path / "head", settings)
    assert summary["prompts"] == 4 and summary["steps"] >= 150
    assert json.loads((tmp_path / "head" / CONFIG_FILE).read_text())["training"] == summary
    prompts, held_out = sharegpt_split(tokenizer, 4)
    assert not {tuple(p) for p in prompts} & {tuple(p) for p in held_out}
    params = SamplingParams(max_tokens=24, temperature=0)
    llm = LLM(str(model_dir), dtype="float32", num_threads=2, batch_invariant=True, num_kv_blocks=256)
    plain = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    llm.engine.set_speculative_config({"method": "medusa", "model": str(tmp_path / "head"),
                                       "num_speculative_tokens": 4})
    sped = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]  # batch 1
    assert sped == plain
    stats = llm.engine.spec.stats
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0, stats
