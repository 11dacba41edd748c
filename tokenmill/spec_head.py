"""`tokenmill spec train-head`: a Medusa head for a model, trained on the model's own greedy answers to ShareGPT
prompts (self-distillation) within a time budget, then cached beside the converted model.

Two phases share the budget: the engine's batched greedy generation (until GENERATE_SHARE of it), recording the
engine's own final hidden state at each answer token, then AdamW on the heads (the target and its LM head
frozen) until the budget ends. Head i at position t learns the target's token at t + 2 + i; the heads predict
over the answers' most frequent tokens only (a smaller draft GEMM), other targets are skipped."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("tokenmill")

GENERATE_SHARE = 0.7  # of the budget: greedy generation (the data); the rest: training
HELD_OUT = 16  # the first ShareGPT prompts of the seeded sample, never trained on (benchmarks use them)
GENERATE_BATCH = 64  # prompts per generate call: 16 gave the engine too small a batch (a third of the data)


@dataclass
class TrainSettings:
    seconds: float = 14 * 60
    num_heads: int = 4
    vocab_size: int = 8192  # the heads' vocabulary: the answers' most frequent tokens
    max_prompts: int = 2000
    max_tokens: int = 256  # per answer
    batch_size: int = 256  # positions per optimizer step
    lr: float = 1e-3
    threads: int = 2
    dtype: str = "float32"  # of the generation
    min_steps: int = 0  # optimizer steps even past the budget (a slow machine's generation may take it all)


def head_dir_for(model_dir: Path, method: str = "medusa") -> Path:
    """Where a model's trained head is cached: beside the converted models."""
    from engine.model_loader import tokenmill_home

    return tokenmill_home() / "heads" / f"{model_dir.name}-{method}"


def sharegpt_split(tokenizer, num_train: int) -> tuple[list[list[int]], list[list[int]]]:
    """(training prompts, held-out prompts): one seeded ShareGPT sample, its first HELD_OUT kept out (so the
    held-out prompts are those of `sharegpt_workload(tokenizer, HELD_OUT)` whatever `num_train`)."""
    from tokenmill.bench.sharegpt import sharegpt_workload

    workload = sharegpt_workload(tokenizer, num_train + HELD_OUT, seed=0)
    return workload.prompts[HELD_OUT:], workload.prompts[:HELD_OUT]


def generate_answers(model_dir: Path, prompts: list[list[int]], settings: TrainSettings,
                     deadline: float) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[int]]:
    """Greedy answers, GENERATE_BATCH prompts at a time until `deadline`, with the engine's own final hidden state
    at each answer token's logits row: (hidden states [n, hidden] float32, the tokens 2 .. num_heads + 1 places on
    [n, num_heads] (-1 past the answer's end), the answers, each answer's number of hidden states)."""
    from engine import LLM, SamplingParams
    from engine.step_types import SampleLayout

    llm = LLM(str(model_dir), dtype=settings.dtype, num_threads=settings.threads)
    runner = llm.engine.runner
    rows: dict[str, list[torch.Tensor]] = {}  # request id -> hidden state at each of its answer's tokens
    execute = runner.execute

    def recording_execute(plan):
        output = execute(plan)
        layout = SampleLayout.of(plan)
        for seq_id, seq in layout.seqs.items():
            if output.sampled_token_ids.get(seq_id):
                rows.setdefault(seq.request_id, []).append(output.sample_hidden[layout.first_row[seq_id]].float())
        return output

    runner.execute = recording_execute
    params = SamplingParams(max_tokens=settings.max_tokens, temperature=0)
    states, targets, answers = [], [], []
    for start in range(0, len(prompts), GENERATE_BATCH):
        if states and time.monotonic() >= deadline:  # one batch at least, however slow the start
            break
        rows.clear()
        for output in llm.generate(prompts[start:start + GENERATE_BATCH], params):
            answer = list(output.outputs[0].token_ids)
            answers.append(answer)
            hidden = rows[output.request_id][:len(answer)]
            padded = torch.tensor(answer + [-1] * (settings.num_heads + 1))
            ahead = torch.arange(len(hidden))[:, None] + 1 + torch.arange(settings.num_heads)[None, :]
            states.append(torch.stack(hidden))
            targets.append(padded[ahead])
        log.info("generated %d answers, %d positions", len(answers), sum(map(len, states)))
    del llm
    return torch.cat(states), torch.cat(targets), answers, [len(rows) for rows in states]


def head_vocabulary(answers: list[list[int]], size: int) -> torch.Tensor:
    """The `size` most frequent answer tokens, sorted."""
    counts = torch.bincount(torch.tensor([t for answer in answers for t in answer]))
    keep = min(size, int((counts > 0).sum()))
    return counts.topk(keep).indices.sort().values


def train_heads(states: torch.Tensor, targets: torch.Tensor, lm_head: torch.Tensor, vocab: torch.Tensor,
                settings: TrainSettings, deadline: float, test_from: int):
    """AdamW on the heads until `deadline`; returns the heads and each head's top-1 accuracy on the positions
    from `test_from` on (whole answers held out of training: positions of a trained answer's neighbours are
    no test, the heads learn them by heart)."""
    from engine.spec_decode.medusa import MedusaHeads

    heads = MedusaHeads(states.shape[1], settings.num_heads, vocab, lm_head.shape[0])
    index_of = torch.full((lm_head.shape[0] + 1,), -100, dtype=torch.long)
    index_of[vocab] = torch.arange(len(vocab))
    labels = index_of[targets]  # -1 (past the end) maps to the last slot: -100, skipped
    weight = lm_head.index_select(0, vocab).detach()
    generator = torch.Generator().manual_seed(0)
    train, test = torch.arange(test_from), torch.arange(test_from, len(states))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=settings.lr, weight_decay=0.0)
    decay = torch.tensor([0.8 ** i for i in range(settings.num_heads)])
    steps = 0
    while time.monotonic() < deadline or steps < settings.min_steps:
        for batch in train[torch.randperm(len(train), generator=generator)].split(settings.batch_size):
            logits = F.linear(heads(states[batch]), weight)  # [b, heads, vocab]
            losses = torch.stack([F.cross_entropy(logits[:, i], labels[batch, i], ignore_index=-100)
                                  for i in range(settings.num_heads)])
            loss = (torch.nan_to_num(losses) * decay).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            if time.monotonic() >= deadline and steps >= settings.min_steps:
                break
    with torch.no_grad():
        predicted = vocab[F.linear(heads(states[test]), weight).argmax(dim=-1)]
        accuracy = [round(float((predicted[:, i] == targets[test, i])[targets[test, i] >= 0].float().mean()), 4)
                    for i in range(settings.num_heads)]
    log.info("trained %d steps on %d positions; head accuracy on %d held-out positions %s", steps, test_from,
             len(test), accuracy)
    return heads, accuracy, steps


def train_medusa_head(model_dir: Path, out: Path, settings: TrainSettings) -> dict:
    """Generate, extract, train and save a Medusa head for `model_dir` into `out`; returns its training summary."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    started = time.monotonic()
    torch.set_num_threads(settings.threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, _ = sharegpt_split(tokenizer, settings.max_prompts)
    states, targets, answers, positions = generate_answers(model_dir, prompts, settings,
                                                           started + GENERATE_SHARE * settings.seconds)
    weights = load_file(model_dir / "model.safetensors")
    lm_head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight")).float()
    vocab = head_vocabulary(answers, settings.vocab_size)
    generated = time.monotonic()
    test_answers = max(1, len(answers) // 10)  # the last answers: a test of prompts the heads never saw
    test_from = len(states) - sum(positions[-test_answers:])
    heads, accuracy, steps = train_heads(states, targets, lm_head, vocab, settings, started + settings.seconds,
                                         test_from)
    summary = {"model": model_dir.name, "prompts": len(answers), "positions": len(states), "steps": steps,
               "head_accuracy": accuracy, "test_prompts": test_answers,
               "generate_seconds": round(generated - started, 1),
               "train_seconds": round(time.monotonic() - generated, 1)}
    heads.save(out, {"training": summary})
    return summary
