"""The built-in GPT and its generated data: shapes, tied weights, determinism, a falling loss,
and the measured activation bytes. Plain PyTorch only; no tiermem runtime."""

from __future__ import annotations

import math

import pytest
import torch

from tiermem.app.models import GPT, Block, GPTConfig, MarkovChainData, activation_bytes_per_step
from tiermem.app.models.gpt import measure_activations

TINY = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab_size=64, seq_len=32)


def _model(config: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def test_forward_and_backward_shapes() -> None:
    model = _model()
    x, y = MarkovChainData(TINY.vocab_size, TINY.seq_len, seed=1).batch(3)
    logits, loss = model(x, y)
    assert logits.shape == (3, TINY.seq_len, TINY.vocab_size)
    assert loss is not None and loss.shape == () and math.isfinite(loss.item())
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.shape == param.shape, name
    # A shorter sequence works (positions are sliced); no targets means no loss.
    logits, none = model(x[:, :5])
    assert logits.shape == (3, 5, TINY.vocab_size) and none is None


def test_blocks_are_identical_pre_layernorm_blocks_in_a_module_list() -> None:
    model = _model()
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == TINY.n_layer
    assert all(type(block) is Block for block in model.blocks)


def test_lm_head_is_tied_to_the_token_embedding() -> None:
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    # Counted once: the optimizer and offloaders see one Parameter.
    assert sum(1 for p in model.parameters() if p is model.wte.weight) == 1
    assert model.num_parameters() == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    _, loss = model(*MarkovChainData(TINY.vocab_size, TINY.seq_len).batch(2))
    assert loss is not None
    loss.backward()
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


def test_init_and_forward_are_deterministic_under_a_seed() -> None:
    a, b, c = _model(seed=5), _model(seed=5), _model(seed=6)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)
    x, y = MarkovChainData(TINY.vocab_size, TINY.seq_len).batch(2)
    assert torch.equal(a(x, y)[0], b(x, y)[0])


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"d_model": 65}, "divisible"), ({"n_layer": 0}, "n_layer"), ({"dropout": 1.0}, "dropout")],
)
def test_config_rejects_unusable_sizes(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**TINY.__dict__, **changes})  # type: ignore[arg-type]


def test_sequence_longer_than_seq_len_is_an_error() -> None:
    with pytest.raises(ValueError, match="longer than seq_len"):
        _model()(torch.zeros(1, TINY.seq_len + 1, dtype=torch.int64))


def test_data_is_deterministic_per_seed_and_shifted_by_one() -> None:
    a = MarkovChainData(100, 20, seed=3)
    b = MarkovChainData(100, 20, seed=3)
    c = MarkovChainData(100, 20, seed=4)
    for _ in range(3):
        (xa, ya), (xb, yb) = a.batch(4), b.batch(4)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    xa, ya = a.batch(4)
    xc, _ = c.batch(4)
    assert not torch.equal(xa, xc)
    assert xa.shape == ya.shape == (4, 20) and xa.dtype == torch.int64
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert int(xa.min()) >= 0 and int(xa.max()) < 100


def test_data_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    MarkovChainData(50, 10, seed=1).batch(2)
    assert torch.equal(torch.rand(3), expected)


def test_data_follows_a_sparse_chain() -> None:
    data = MarkovChainData(64, 50, seed=0)
    x, y = data.batch(64)
    successors: dict[int, set[int]] = {}
    for a, b in zip(x.flatten().tolist(), y.flatten().tolist(), strict=True):
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4
    assert sum(len(s) >= 2 for s in successors.values()) > len(successors) // 2
    # The chain's entropy is about 1 nat, far below uniform guessing.
    assert 0.5 < data.optimal_loss() < 1.5 < data.uniform_loss() == pytest.approx(math.log(64))


def test_a_tiny_model_learns_the_data_within_forty_steps() -> None:
    model = _model()
    data = MarkovChainData(TINY.vocab_size, TINY.seq_len, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        _, loss = model(*data.batch(16))
        assert loss is not None
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(data.uniform_loss(), abs=0.3)  # starts at uniform guessing
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5  # and visibly learns (measured: 4.2 -> 1.7)


def test_activation_bytes_are_measured_and_grow_with_batch() -> None:
    one = activation_bytes_per_step(TINY, 1)
    two = activation_bytes_per_step(TINY, 2)
    four = activation_bytes_per_step(TINY, 4)
    assert 0 < one < two < four
    # Nearly all saved bytes scale with the batch; what does not (tiny index tensors) is small.
    assert four == pytest.approx(4 * one, rel=0.05)
    # At least the inputs of every Linear layer's backward (4 per block), as float32:
    tokens = TINY.seq_len
    assert one >= TINY.n_layer * 4 * tokens * TINY.d_model * 4
    assert activation_bytes_per_step(TINY, 2, dtype=torch.bfloat16) < two


def test_activation_measurement_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    activation_bytes_per_step(TINY, 1)
    assert torch.equal(torch.rand(3), expected)


def test_activation_bytes_are_attributed_to_blocks() -> None:
    measured = measure_activations(TINY, 2)
    assert measured.total == sum(measured.blocks) + measured.outside == activation_bytes_per_step(TINY, 2)
    assert len(measured.blocks) == TINY.n_layer and len(set(measured.blocks)) == 1  # identical blocks
    # Outside the blocks: embedding output, final LayerNorm, logits and the loss's log-softmax.
    assert measured.outside >= 2 * 2 * TINY.seq_len * TINY.vocab_size * 4
