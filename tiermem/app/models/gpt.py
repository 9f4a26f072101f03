"""A small GPT (decoder-only transformer) built in, so ``tiermem train`` needs no downloads.

The shape follows GPT-2/nanoGPT: token + learned position embeddings, ``n_layer`` identical
pre-LayerNorm blocks in ``GPT.blocks`` (an ``nn.ModuleList``, which is how the activation
offloader finds the repeated layers), a final LayerNorm and an LM head tied to the token
embedding. Everything is initialised from torch's global RNG, so ``torch.manual_seed(s)``
before ``GPT(config)`` gives the same weights every time.

:func:`activation_bytes_per_step` *measures* what autograd saves for one forward, so the
train command can pick a device budget that is really below what the model needs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "ActivationBytes",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "activation_bytes_per_step",
    "measure_activations",
]


@dataclass(frozen=True)
class GPTConfig:
    """The sizes of a :class:`GPT`. Raises ``ValueError`` naming the field when one is unusable."""

    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    vocab_size: int = 512
    seq_len: int = 256
    dropout: float = 0.0
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("n_layer", "d_model", "n_head", "vocab_size", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig: d_model ({self.d_model}) must be divisible by n_head ({self.n_head}), "
                "so every attention head gets the same width"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    q, k and v are views of one ``qkv`` output, so autograd saves three tensors that share one
    storage: the case the offloader's deduplication exists for.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, seq, width) -> (batch, heads, seq, head_dim), the layout SDPA expects
        q, k, v = (t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer; ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Weight tying (GPT-2): one Parameter object serves both, so optimizers and offloaders
        # see it once; it must stay one object, not two tensors with equal values.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream keeps its
        # variance from growing with depth.
        scaled = 0.02 / math.sqrt(2 * config.n_layer)
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(param, mean=0.0, std=scaled)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Distinct parameter elements (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``idx``: (batch, seq) token ids; ``targets``: the same shape, or None for no loss."""
        _, seq = idx.shape
        if seq > self.config.seq_len:
            raise ValueError(f"GPT: sequence of {seq} tokens is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


@dataclass(frozen=True)
class ActivationBytes:
    """What autograd saves in one forward, measured: ``total`` = ``sum(blocks) + outside``.

    ``blocks[i]``: bytes first saved while ``blocks[i]`` ran; ``outside``: the rest
    (embeddings, final LayerNorm, LM head and loss), which no block policy can move.
    """

    total: int
    blocks: tuple[int, ...]
    outside: int


def measure_activations(
    config: GPTConfig,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str = "cpu",
) -> ActivationBytes:
    """Bytes autograd saves for backward during one forward of ``GPT(config)`` on a batch.

    Measured, not estimated: one real forward (with loss) runs under saved-tensor hooks that
    add up the bytes of every distinct storage a saved tensor lives in, counting each storage
    once however many saved tensors view it (q, k, v of one ``qkv`` output) and leaving out
    parameters and views of them (``weight.t()``), which are model state, not activations.
    A storage counts for the block that saved it first. The caller's RNG is untouched
    (TRAPS 10), so measuring does not change a later run.
    """
    if batch_size < 1:
        raise ValueError(f"activation_bytes_per_step: batch_size must be at least 1, got {batch_size}")
    device = torch.device(device)
    seen: set[int] = set()
    per_block = [0] * config.n_layer
    outside = 0
    running: list[int] = []  # the block whose forward is running (a stack: blocks do not nest here)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        storage = tensor.untyped_storage()
        # Keying on data_ptr is safe only here: pack returns the tensor itself, so the graph
        # keeps every counted storage alive until the measurement ends (no address reuse).
        key = storage.data_ptr()
        if key not in param_storages and key not in seen:
            seen.add(key)
            if running:
                per_block[running[-1]] += storage.nbytes()
            else:
                outside += storage.nbytes()
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    fork_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(0)
        model = GPT(config).to(device=device, dtype=dtype)
        param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for index, block in enumerate(model.blocks):
            block.register_forward_pre_hook(functools.partial(_enter_block, running, index))
            block.register_forward_hook(functools.partial(_leave_block, running))
        idx = torch.randint(config.vocab_size, (batch_size, config.seq_len), device=device)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            _, loss = model(idx, idx)
        del loss  # drops the graph and with it every saved tensor
    return ActivationBytes(total=sum(per_block) + outside, blocks=tuple(per_block), outside=outside)


def _enter_block(running: list[int], index: int, module: nn.Module, args: object) -> None:
    running.append(index)  # returns None: a value would replace the block's inputs


def _leave_block(running: list[int], module: nn.Module, args: object, output: object) -> None:
    running.pop()  # not returned: a value would replace the block's output


def activation_bytes_per_step(
    config: GPTConfig,
    batch_size: int,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str = "cpu",
) -> int:
    """The measured bytes autograd saves in one forward (see :func:`measure_activations`)."""
    return measure_activations(config, batch_size, dtype, device=device).total
