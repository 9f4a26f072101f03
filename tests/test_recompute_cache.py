"""NOTE [ Recomputed blocks and caches ]: a checkpointed block's recomputation finds the decoding
cache as the block's first run found it; the first run writes the real one."""

from __future__ import annotations

import logging
import threading

import torch
from torch import nn

from tiermem.activations import recompute


class _Cache:
    """A decoding cache as Hugging Face's keep one: per layer, keys that each call extends."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor | None] = [None]

    def update(self, key: torch.Tensor) -> torch.Tensor:
        old = self.keys[0]
        self.keys[0] = key if old is None else torch.cat([old, key])
        return self.keys[0]


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, past_key_values: _Cache | None = None) -> torch.Tensor:
        keys = self.proj(x)
        if past_key_values is not None:
            keys = past_key_values.update(keys)  # attends over every key the cache holds
        return (x @ keys.transpose(0, 1)).softmax(-1) @ keys


def _step(layer: _Layer, x: torch.Tensor, cache: _Cache, checkpointed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    if checkpointed:
        out = recompute.checkpointed(layer, layer.forward, (x,), {"past_key_values": cache})
    else:
        out = layer(x, past_key_values=cache)
    loss = out.square().sum()
    loss.backward()
    assert layer.proj.weight.grad is not None
    return loss.detach(), layer.proj.weight.grad.clone()


def test_the_recomputation_finds_the_cache_as_the_first_run_found_it():
    torch.manual_seed(0)
    layer, x = _Layer(), torch.randn(3, 4)
    plain_cache, cache = _Cache(), _Cache()
    want = _step(layer, x, plain_cache, checkpointed=False)
    got = _step(layer, x, cache, checkpointed=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # the first run wrote the real cache, once, as the plain forward did
    assert cache.keys[0] is not None and plain_cache.keys[0] is not None
    assert torch.equal(cache.keys[0], plain_cache.keys[0]) and cache.keys[0].shape[0] == 3


def test_a_cache_that_cannot_be_copied_is_dropped_for_the_recomputed_layer(caplog):
    """Rule 3: ``copy.deepcopy`` refuses a lock; the layer runs without the cache, and says so."""
    torch.manual_seed(0)
    layer, x = _Layer(), torch.randn(3, 4)
    cache = _Cache()
    cache.lock = threading.Lock()  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="tiermem.activations"):
        loss, grad = _step(layer, x, cache, checkpointed=True)
    want = _step(layer, x, None, checkpointed=False)  # type: ignore[arg-type]
    assert torch.equal(loss, want[0]) and torch.equal(grad, want[1])
    assert cache.keys == [None]  # not written: the layer ran without it
    assert "cannot be copied for its recomputation" in caplog.text
