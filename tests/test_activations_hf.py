"""Activation offloading on Hugging Face transformers models (built from configs: no downloads).

Decoder-only (GPT-2), encoder-only (BERT) and encoder-decoder (T5): gradients under every
policy are bitwise those of plain PyTorch, and the blocks are found automatically.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import tiermem
from tests.test_activations import offloaded
from tiermem.activations import find_blocks

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(config)


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def _t5() -> torch.nn.Module:
    config = transformers.T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=64,
        d_ff=128,
        num_heads=4,
        d_kv=16,
        vocab_size=128,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        # use_cache stays the config's default (True): a recomputed layer runs without the cache
        # it would write twice (NOTE [ Recomputed blocks and caches ])
    )
    return transformers.T5ForConditionalGeneration(config)


MODELS = {"gpt2": _gpt2, "bert": _bert, "t5": _t5}


def _loss(name: str, model: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 48), generator=generator)
    labels = torch.randint(0, 128, (2, 48), generator=generator)
    if name == "t5":
        return model(input_ids=ids, labels=labels).loss
    return model(input_ids=ids, labels=ids if name == "gpt2" else labels).loss


@pytest.fixture
def runtime(tmp_path):
    config = {
        "device": {"capacity": "512MiB", "device": "cpu"},
        "host": {"capacity": "512MiB"},
        "nvme": {"paths": [str(tmp_path)], "capacity": "1GiB", "block_size": "256KiB"},
        "activations": {"min_bytes": "4KiB"},
        "scheduler": {"loop": "asyncio"},
    }
    with tiermem.Runtime(config) as rt:
        yield rt


@pytest.mark.parametrize("policy", ["keep", "recompute", "host", "nvme", "auto"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_models_bitwise_under_every_policy(runtime, name, policy):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()

    def step(context) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with context:
            loss = _loss(name, model)
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = step(contextlib.nullcontext())
    got = step(runtime.offload_activations(model, policy=policy))
    assert torch.equal(got[0], want[0])
    assert len(got[1]) == len(want[1])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)
    if policy == "nvme":
        assert offloaded(runtime.stats().as_dict()["activations"], "nvme")


def test_hf_blocks_are_found():
    assert [n for n, _ in find_blocks(_gpt2())] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert len(find_blocks(_bert())) == 3
    t5 = [n for n, _ in find_blocks(_t5())]
    assert t5 == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
