"""The model this template serves: a one-layer GRU language model with random weights.

It stands in for *your* engine. What the adapter needs from it is small and
is what every inference engine has in some form: feed tokens, get next-token
logits, and keep per-request state (here the GRU hidden state; in a
transformer engine, the KV cache) so each decoding step feeds only new tokens.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyGRULM(nn.Module):
    """Embedding -> GRU -> linear head. ``forward`` continues from an optional hidden state."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.rnn = nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.head = nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` ``[batch, time]`` -> logits ``[batch, time, vocab]`` and the hidden state after the last token."""
        out, state = self.rnn(self.embed(tokens), state)
        return self.head(out), state


def build(vocab_size: int, hidden_size: int, seed: int, device: str) -> TinyGRULM:
    """Version-0 weights: random from ``seed``, so two engines built alike hold the same policy."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGRULM(vocab_size, hidden_size)
    return model.to(device).eval()
