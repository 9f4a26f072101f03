"""Model-state management on Hugging Face transformers models (built from configs: no downloads):
training is bitwise plain PyTorch, ``generate`` works on a managed model in eval mode, and
``torch.compile`` of a managed model is refused with a clear error (issue 5)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tiermem
from tests.test_activations_hf import MODELS
from tests.test_states import assert_bitwise, config
from tiermem.states import StatesUsageError

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)


def make(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def inputs(name: str, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 128, (2, 12), generator=generator)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(0, 128, (2, 6), generator=generator)}
    return {"input_ids": ids, "labels": ids}


def train(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    losses = []
    for step in range(3):
        loss = model(**inputs(name, step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def state_bytes(model: torch.nn.Module) -> int:
    return 16 * sum(p.numel() for p in model.parameters())


def generate(model: torch.nn.Module, mode: Callable[[], Any] = torch.no_grad) -> torch.Tensor:
    model.eval()
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(7))
    with mode():
        return model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", ["gpt2", "t5", "bert"])
def test_hf_training_and_generate_match_plain(tmp_path, name):
    plain = make(name)
    want = train(name, plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    model = make(name)
    with tiermem.Runtime(config(tmp_path, int(state_bytes(model) * 0.25))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-2)
        got = train(name, model, optimizer)
        assert rt.plan.persistent_chunks < rt.plan.chunks  # chunks streamed through the pool
        # planned at the first step, its profile streamed (a T5's recomputed layers once failed
        # there on their decoding cache: NOTE [ Recomputed blocks and caches ])
        assert rt.plan.predicted.step_s is not None
        if name != "bert":
            assert torch.equal(generate(model), generate(plain))
            assert torch.equal(generate(model, torch.inference_mode), generate(plain, torch.inference_mode))
        stats = rt.stats().as_dict()
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert stats["tiers"]["device"]["peak_bytes"] <= stats["tiers"]["device"]["capacity"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hf_training_with_every_block_recomputed_is_plain_pytorchs(tmp_path, name):
    """NOTE [ Recomputed blocks and caches ]: a T5 decoder layer writes the decoding cache it is
    given as it runs; recomputed, it finds that cache as its first run found it. Under
    ``block_policy="recompute"`` the T5 failed in its second step's backward (``CheckpointError``),
    and with the cache dropped for recomputed layers (Hugging Face's way) its loss moved in the
    last bit; now every step is plain PyTorch's, bitwise."""
    plain = make(name)
    want = train(name, plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    model = make(name)
    with tiermem.Runtime(config(tmp_path, int(state_bytes(model) * 0.25))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-2, plan={"block_policy": "recompute"})
        got = train(name, model, optimizer)
        assert set(rt.plan.block_policy) == {"recompute"}
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_a_t5_first_step_profiled_streamed_plans_and_trains_as_plain(tmp_path, caplog):
    """NOTE [ Recomputed blocks and caches ]: the streamed first-step profile recomputes every block,
    and a T5's decoder layers write the decoding cache (``use_cache``, the config's default) as they
    run; recomputed with it, the profile failed (``CheckpointError``) and the default placement
    stayed. Now the first step plans, and training is plain PyTorch's."""
    plain = make("t5")
    assert plain.config.use_cache
    want = train("t5", plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    model = make("t5")
    capacity = state_bytes(model) // 4
    with (
        caplog.at_level(logging.INFO, logger="tiermem.states"),
        tiermem.Runtime(config(tmp_path, capacity, capacity)) as rt,
    ):
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-2)
        got = train("t5", model, optimizer)
        assert rt.plan.predicted.step_s is not None
    assert "profiling the first step with the chunks streamed" in caplog.text
    assert_bitwise(got, want)
    assert_bitwise([p.detach() for p in model.parameters()], [p.detach() for p in plain.parameters()])
    assert list(tmp_path.iterdir()) == []


def test_torch_compile_of_a_managed_model_is_refused(tmp_path):
    model = make("gpt2")
    with tiermem.Runtime(config(tmp_path, int(state_bytes(model) * 0.25))) as rt:
        model, optimizer = rt.manage(model, torch.optim.AdamW, lr=1e-2)
        compiled = torch.compile(model, backend="eager")
        with pytest.raises(StatesUsageError, match=r"torch\.compile of a whole model whose states"):
            compiled(**inputs("gpt2", 0))
        torch._dynamo.reset()
        # The model still trains eagerly afterwards.
        loss = model(**inputs("gpt2", 0)).loss
        loss.backward()
        optimizer.step()
    assert list(tmp_path.iterdir()) == []
