"""Medusa heads (Cai et al., 2024): K small heads reading the target's final hidden state at a sequence's last
sampled position, head i proposing the token i + 1 places after the one the target just sampled, all K in one
shot. Each head is a residual SiLU block, h + SiLU(W h + b), followed by the target's own LM head restricted to
the head's vocabulary (the tokens it was trained to predict: a smaller GEMM than the whole vocabulary). The drafts
are deterministic, so the verifier's exact checks keep the target's output unchanged.

A head directory holds `medusa.safetensors` (weights and vocabulary) and `medusa_config.json`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.step_types import SampleLayout

if TYPE_CHECKING:
    from engine.sequence import Sequence
    from engine.spec_decode.draft import DraftSetup
    from engine.step_types import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("tokenmill.engine")

CONFIG_FILE = "medusa_config.json"
WEIGHTS_FILE = "medusa.safetensors"


class MedusaHeads(nn.Module):
    """K residual blocks over a hidden state; `vocab`: the token ids the heads predict (the LM head's rows)."""

    def __init__(self, hidden_size: int, num_heads: int, vocab: torch.Tensor, target_vocab_size: int) -> None:
        super().__init__()
        if not 1 <= num_heads <= 16:
            raise ValueError(f"a Medusa head set has 1 to 16 heads, got {num_heads}")
        self.hidden_size, self.num_heads, self.target_vocab_size = hidden_size, num_heads, target_vocab_size
        self.weight = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))  # zero: each head starts as
        self.bias = nn.Parameter(torch.zeros(num_heads, hidden_size))  # the LM head itself
        self.register_buffer("vocab", vocab.long())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> each head's hidden state, [n, num_heads, hidden]."""
        inner = torch.einsum("nh,koh->nko", hidden, self.weight) + self.bias
        return hidden[:, None, :] + F.silu(inner)

    def config(self) -> dict:
        return {"method": "medusa", "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                "vocab_size": int(self.vocab.numel()), "target_vocab_size": self.target_vocab_size}

    def save(self, directory: Path, extra: dict | None = None) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.detach().float().contiguous(), "bias": self.bias.detach().float().contiguous(),
                   "vocab": self.vocab.contiguous()}, directory / WEIGHTS_FILE)
        (directory / CONFIG_FILE).write_text(json.dumps({**self.config(), **(extra or {})}, indent=2))

    @classmethod
    def load(cls, directory: str | Path, hidden_size: int | None = None,
             target_vocab_size: int | None = None) -> MedusaHeads:
        """The heads of `directory`, checked against the target's hidden size and vocabulary when given."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{directory} holds no Medusa head ({CONFIG_FILE} and {WEIGHTS_FILE}); "
                                    "train one with `tokenmill spec train-head`")
        config = json.loads((directory / CONFIG_FILE).read_text())
        if config.get("method") != "medusa":
            raise ValueError(f"{directory} holds a {config.get('method')!r} head, not a Medusa head")
        if hidden_size is not None and config["hidden_size"] != hidden_size:
            raise ValueError(f"the Medusa head's hidden size ({config['hidden_size']}) differs from the target's "
                             f"({hidden_size})")
        if target_vocab_size is not None and config["target_vocab_size"] != target_vocab_size:
            raise ValueError(f"the Medusa head was trained for a vocabulary of {config['target_vocab_size']} tokens, "
                             f"the target has {target_vocab_size}")
        tensors = load_file(directory / WEIGHTS_FILE)
        heads = cls(config["hidden_size"], config["num_heads"], tensors["vocab"], config["target_vocab_size"])
        with torch.no_grad():
            heads.weight.copy_(tensors["weight"])
            heads.bias.copy_(tensors["bias"])
        return heads


class MedusaProposer:
    """Drafts from the heads; `observe` keeps each sequence's hidden state at its last sampled position."""

    def __init__(self, config, setup: DraftSetup) -> None:
        target = setup.model
        heads = MedusaHeads.load(config.model, target.config.hidden_size, target.config.vocab_size)
        if config.num_speculative_tokens > heads.num_heads:  # each head drafts one position
            log.info("num_speculative_tokens %d lowered to the Medusa head's %d heads", config.num_speculative_tokens,
                     heads.num_heads)
            config.num_speculative_tokens = heads.num_heads
        self.heads = heads.to(device=setup.shape.device, dtype=setup.shape.dtype).eval()
        self.vocab = self.heads.vocab
        self.head_weight = target.lm_head_weight.index_select(0, self.vocab).contiguous()
        self.hidden: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (its num_tokens then, hidden state)

    @torch.inference_mode()
    def observe(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """After a step: the hidden state at the row of each sampled sequence's last new token."""
        rows = output.sample_hidden
        kept: dict[int, tuple[int, torch.Tensor]] = {}
        if rows is not None:
            layout = SampleLayout.of(plan)
            for seq_id, seq in layout.seqs.items():
                tokens = output.sampled_token_ids.get(seq_id)
                if tokens:
                    kept[seq_id] = (seq.num_tokens + len(tokens), rows[layout.first_row[seq_id] + len(tokens) - 1])
        self.hidden = kept

    @torch.inference_mode()
    def propose(self, work: list[tuple[Sequence, int]]) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """k drafts for each sequence whose last hidden state is known (none for the others)."""
        drafts: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in work}
        known = [(seq, k) for seq, k in work
                 if seq.seq_id in self.hidden and self.hidden[seq.seq_id][0] == seq.num_tokens]
        if known:
            hidden = torch.stack([self.hidden[seq.seq_id][1] for seq, _ in known])
            k_max = max(k for _, k in known)
            states = self.heads(hidden)[:, :k_max]
            logits = F.linear(states.reshape(-1, states.shape[-1]), self.head_weight)
            tokens = self.vocab[logits.argmax(dim=-1)].view(len(known), k_max).tolist()
            for (seq, k), row in zip(known, tokens, strict=True):
                drafts[seq.seq_id] = row[:k]
        return drafts, {}
