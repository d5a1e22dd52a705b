"""A small decoder-only transformer language model (GPT-2's layout, Radford et al., 2019).

``tok_emb + pos_emb -> Dropout -> n_layers x Block -> LayerNorm -> logits = h @ tok_emb.weight.T``,
where a Block is pre-norm: ``x + attn(LayerNorm(x))`` then ``x + mlp(LayerNorm(x))``; the
attention is causal (``scaled_dot_product_attention(..., is_causal=True)``), the MLP
``Linear(d_model, d_ff) -> GELU -> Linear(d_ff, d_model)``. ``forward(x[B, T]) -> logits[B, T, V]``,
as the LSTM LM's; every window stands alone (no state is carried from one window to the next),
and positions run 0 .. T-1 with T <= ``max_len``.

The output layer is the token embedding itself (tied: ``TiedEmbedding``): one parameter,
``tok_emb.weight``, in ``named_parameters()``, so the gradient exchange sees it once. Parameter
names (``tok_emb``, ``pos_emb``, ``blocks.<i>.attn.qkv``, ``blocks.<i>.mlp.fc``, ...) share no
word with the LSTM LM's (``embedding``, ``lstm``, ``decoder``), so a ``policy.layers`` pattern
written for one model does not match the other by accident.

Initialisation as GPT-2's: weights normal(0, 0.02), biases 0, LayerNorms 1 and 0; the two
projections that write into the residual stream (``attn.proj``, ``mlp.proj``) normal(0,
0.02 / sqrt(2 * n_layers)), so the stream's variance does not grow with depth. Only torch's
global RNG is used: ``torch.manual_seed`` makes the weights bit-identical.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02


class TiedEmbedding(nn.Embedding):
    """The token embedding, which is also the output layer: ``forward(ids)`` looks rows up,
    ``forward(h, logits=True)`` gives ``h @ weight.T``. Both go through the module's own call, so
    a wrapper that gathers its weight around each call (FSDP2's ``fully_shard``) sees both uses."""

    def forward(self, x: torch.Tensor, logits: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if logits else super().forward(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, d_ff, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
                 dropout: float, max_len: int):
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len
        self.tok_emb = TiedEmbedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self._init(n_layers)

    def _init(self, n_layers: int) -> None:
        for module in self.modules():   # in registration order: the same draws on every rank
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, INIT_STD)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, 0.0, INIT_STD / math.sqrt(2 * n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: LongTensor [B, T] of token ids -> logits [B, T, V]; T at most ``max_len``."""
        t = x.shape[1]
        if t > self.max_len:
            raise ValueError(f"gpt got windows of {t} tokens but has position embeddings for max_len={self.max_len}; "
                             f"set model.options.max_len >= {t} (or data.options.seq_len <= {self.max_len})")
        pos = torch.arange(t, device=x.device)
        h = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks:
            h = block(h)
        return self.tok_emb(self.ln_f(h), logits=True)


def build_gpt(num_classes: int, input_shape: tuple, *, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
              d_ff: Optional[int] = None, dropout: float = 0.1, max_len: Optional[int] = None) -> GPT:
    """Build the GPT LM; ``num_classes`` is the vocabulary size, ``input_shape`` ``(seq_len,)``:
    ``max_len`` (the number of positions) defaults to that ``seq_len``, ``d_ff`` to 4 * d_model."""
    if max_len is None:
        if len(input_shape) != 1:
            raise ValueError(f"gpt reads windows of token ids (input_shape (seq_len,)), got input_shape "
                             f"{tuple(input_shape)}; train it on a language data set, or set model.options.max_len")
        max_len = int(input_shape[0])
    d_ff = 4 * int(d_model) if d_ff is None else int(d_ff)
    if min(int(d_model), int(n_layers), int(n_heads), d_ff, int(max_len)) < 1 or not 0.0 <= dropout < 1.0:
        raise ValueError(f"gpt needs d_model, n_layers, n_heads, d_ff, max_len >= 1 and 0 <= dropout < 1, got "
                         f"{d_model}, {n_layers}, {n_heads}, {d_ff}, {max_len}, {dropout}")
    if int(d_model) % int(n_heads):
        raise ValueError(f"gpt option d_model={d_model} must be a multiple of n_heads={n_heads} (each head gets "
                         f"d_model / n_heads dimensions); e.g. n_heads: {math.gcd(int(d_model), 4)}")
    return GPT(int(num_classes), int(d_model), int(n_layers), int(n_heads), d_ff, float(dropout), int(max_len))
