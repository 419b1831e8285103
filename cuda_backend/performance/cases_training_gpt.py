"""The GPT of the training row `train_gpt` (cases_training.py) and of examples/train_gpt.py,
ours (cuda_backend.nn: `GPT`, `Block`) and PyTorch's (`torch_gpt`), with the same parameter
names, so that one loads the other's weights: token and position embeddings, pre-norm blocks
of causal self-attention and a Linear+GELU -> Linear MLP, a final layer norm and a linear
head; `torch_linear_gelu` is PyTorch's Linear+GELU (the MLP row's too). Both frameworks'
classes share one forward per module (`block_forward`, `gpt_forward`).
This module imports cuda_backend.nn: cases_training.py imports it only where the nn stack
loads (inside a row's build).
"""
from __future__ import annotations

from typing import Any

from .. import nn


def block_forward(self: Any, x: Any) -> Any:
    """A block's forward, ours and PyTorch's: attention, then the MLP, each on the layer norm
    of the residual stream and added to it."""
    x = x + self.attn(self.ln1(x))
    return x + self.proj(self.fc(self.ln2(x)))


def gpt_forward(self: Any, ids: Any, positions: Any) -> Any:
    """The model's forward, ours and PyTorch's: the logits at every position."""
    x = self.tok(ids) + self.pos(positions)                 # (B, T, C) + (T, C)
    for block in self.blocks:
        x = block(x)
    return self.head(self.ln_f(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadSelfAttention(dim, heads, causal=True)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim, gelu=True)
        self.proj = nn.Linear(4 * dim, dim)

    forward = block_forward


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int) -> None:
        self.tok = nn.Embedding(vocab, dim, check_bounds=False)
        self.pos = nn.Embedding(seq, dim, check_bounds=False)
        self.blocks = [Block(dim, heads) for _ in range(layers)]
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    forward = gpt_forward


def torch_linear_gelu(T: Any, in_features: int, out_features: int) -> Any:
    """PyTorch's Linear followed by GELU (tanh form): our Linear(gelu=True)."""

    class LinearGELU(T.nn.Linear):
        def forward(self, x: Any) -> Any:
            return T.nn.functional.gelu(super().forward(x), approximate="tanh")
    return LinearGELU(in_features, out_features)


def torch_gpt(T: Any, vocab: int, seq: int, dim: int, heads: int, layers: int) -> Any:
    """The same GPT in PyTorch (torch module T), parameter names as ours."""
    tnn, F = T.nn, T.nn.functional
    Module: Any = tnn.Module

    class Attention(Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = tnn.Linear(dim, 3 * dim)
            self.proj = tnn.Linear(dim, dim)

        def forward(self, x: Any) -> Any:
            B, S, C = x.shape
            q, k, v = self.qkv(x).view(B, S, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(B, S, C))

    class TorchBlock(Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.attn, self.ln2 = tnn.LayerNorm(dim), Attention(), tnn.LayerNorm(dim)
            self.fc = torch_linear_gelu(T, dim, 4 * dim)
            self.proj = tnn.Linear(4 * dim, dim)

        forward = block_forward

    class TorchGPT(Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = tnn.Embedding(vocab, dim), tnn.Embedding(seq, dim)
            self.blocks = tnn.ModuleList([TorchBlock() for _ in range(layers)])
            self.ln_f = tnn.LayerNorm(dim)
            self.head = tnn.Linear(dim, vocab, bias=False)

        forward = gpt_forward
    return TorchGPT()
