"""Word-level LSTM language model (Zaremba et al., 2014 / PyTorch word_language_model).

``Embedding(V, embed_dim) -> Dropout -> LSTM(hidden, num_layers, dropout) -> Dropout ->
Linear(hidden, V)``.  ``forward(x[B, T]) -> logits[B, T, V]`` (batch-first).  The embedding
and decoder dominate the parameter count (2 * V * 200 = 4M for PTB's 10k vocab) and are the
layers whose gradients are sparse/compressible, which is why this model is a standard
gradient-compression benchmark.  Weights start uniform in [-0.1, 0.1] as in Zaremba et al.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int = 200, hidden: int = 200, num_layers: int = 2,
                 dropout: float = 0.2, tie_weights: bool = False):
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=num_layers, batch_first=True,
                            dropout=dropout if num_layers > 1 else 0.0)
        self.decoder = nn.Linear(hidden, vocab_size)
        init_range = 0.1
        nn.init.uniform_(self.embedding.weight, -init_range, init_range)
        for name, p in self.lstm.named_parameters():
            if "weight" in name:
                nn.init.uniform_(p, -init_range, init_range)
            else:
                nn.init.zeros_(p)
        nn.init.uniform_(self.decoder.weight, -init_range, init_range)
        nn.init.zeros_(self.decoder.bias)
        if tie_weights:
            self.decoder.weight = self.embedding.weight

    def forward(self, x: torch.Tensor, state: Optional[tuple] = None, return_state: bool = False):
        """``x``: LongTensor [B, T] of token ids -> logits [B, T, V] (and the LSTM state if asked)."""
        out, new_state = self.lstm(self.drop(self.embedding(x)), state)
        logits = self.decoder(self.drop(out))
        return (logits, new_state) if return_state else logits


def build_lstm_lm(num_classes: int, input_shape: tuple, *, vocab_size: Optional[int] = None,
                  embed_dim: int = 200, hidden: int = 200, num_layers: int = 2,
                  dropout: float = 0.2, tie_weights: bool = False) -> LSTMLanguageModel:
    """Build the LM; ``num_classes`` is the vocabulary size (``vocab_size`` may repeat it).

    ``input_shape`` (normally ``(seq_len,)``) is accepted for interface symmetry and ignored:
    the LSTM handles any sequence length.
    """
    if vocab_size is not None and int(vocab_size) != int(num_classes):
        raise ValueError(f"lstm_lm option 'vocab_size'={vocab_size} disagrees with "
                         f"num_classes={num_classes}; pass the vocabulary size as num_classes")
    if tie_weights and embed_dim != hidden:
        raise ValueError(f"lstm_lm option 'tie_weights' needs embed_dim == hidden, "
                         f"got {embed_dim} != {hidden}")
    if num_layers < 1 or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lstm_lm needs num_layers >= 1 and 0 <= dropout < 1, "
                         f"got {num_layers}, {dropout}")
    return LSTMLanguageModel(int(num_classes), int(embed_dim), int(hidden), int(num_layers),
                             float(dropout), bool(tie_weights))
