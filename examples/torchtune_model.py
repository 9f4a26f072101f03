"""A small Llama-style decoder in torchtune's module layout (``TransformerDecoder`` with
``tok_embeddings``, ``layers`` of self-attention layers with RoPE and grouped-query attention,
a SwiGLU ``FeedForward``, RMSNorm, ``output``), used unchanged by ``torchtune_finetune.py`` and
``torchtune_finetune_tiermem.py``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, dim: int, max_seq_len: int, base: int = 10_000) -> None:
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        idx_theta = torch.einsum("i,j->ij", torch.arange(max_seq_len, dtype=theta.dtype), theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [b, s, n_h, h_d]."""
        seq_len = x.size(1)
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope = self.cache[:seq_len].view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        out = torch.stack(
            [
                xshaped[..., 0] * rope[..., 0] - xshaped[..., 1] * rope[..., 1],
                xshaped[..., 1] * rope[..., 0] + xshaped[..., 0] * rope[..., 1],
            ],
            -1,
        )
        return out.flatten(3).type_as(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, max_seq_len: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_embeddings = RotaryPositionalEmbeddings(self.head_dim, max_seq_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.pos_embeddings(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.pos_embeddings(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, hidden_dim: int, max_seq_len: int) -> None:
        super().__init__()
        self.sa_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attn = MultiHeadAttention(dim, num_heads, num_kv_heads, max_seq_len)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-5)
        self.mlp = FeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.sa_norm(x))
        return h + self.mlp(self.mlp_norm(h))


class TransformerDecoder(nn.Module):
    def __init__(
        self, vocab_size: int, num_layers: int, dim: int, num_heads: int, num_kv_heads: int, max_seq_len: int
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(
            TransformerSelfAttentionLayer(dim, num_heads, num_kv_heads, 4 * dim, max_seq_len) for _ in range(num_layers)
        )
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))
