"""The planner's bytes per link (NOTE [ Cost model ] rules 9 and 10): what a LoRA plan predicts
each link moves in a step is what ``rt.stats()`` counts, recomputed blocks' fetches included."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import tiermem

tf = pytest.importorskip("tests.test_states_frozen")  # its LoRA Llama, loop and capacities (needs transformers)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: one OpenMP thread (TRAPS 7)

#: the links a LoRA step reads chunks over (from host homes, from NVMe homes)
READS = ("host->device", "nvme->device")


def small_lora() -> nn.Module:
    """The hand-written LoRA of tests/test_states_frozen.py over a smaller Llama (4 x 128)."""
    model = tf.llama(0, layers=4, width=128).requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = tf.LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = tf.LoRALinear(layer.self_attn.v_proj)
    return model


def per_step(before: dict[str, Any], after: dict[str, Any], steps: int) -> dict[str, int]:
    return {k: (after[k]["bytes"] - before.get(k, {"bytes": 0})["bytes"]) // steps for k in after}


def test_a_recomputing_lora_plan_predicts_the_bytes_each_link_reads(tmp_path):
    """Every block recomputed, the base streamed from NVMe through the device: backward runs each
    block's forward again, fetching its chunks again. Predicted chunk reads per link within 10%
    of the measured (charged once a pass, the NVMe link's were 20% under them)."""
    model = small_lora()
    capacity = tf.frozen_bytes(model) * 4 // 10
    steps = 2
    with tiermem.Runtime(tf.config(tmp_path, capacity, capacity)) as rt:
        model, optimizer = rt.manage(
            model,
            torch.optim.AdamW,
            lr=1e-3,
            plan={"block_policy": "recompute"},
            sample=lambda m: m(input_ids=tf.ids(0), labels=tf.ids(0)).loss,
        )
        assert set(rt.plan.block_policy) == {"recompute"} and rt.plan.persistent_chunks < rt.plan.chunks
        assert "nvme" in rt.plan.state_home
        predicted = rt.decision.estimate.links
        before = rt.stats().as_dict()["links"]
        for step in range(steps):
            loss = model(input_ids=tf.ids(step), labels=tf.ids(step)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        measured = per_step(before, rt.stats().as_dict()["links"], steps)
        tf.within_capacities(rt)
    print({k: (predicted.get(k, 0), measured.get(k, 0)) for k in READS})
    for link in READS:
        assert abs(predicted.get(link, 0) - measured.get(link, 0)) <= 0.1 * measured.get(link, 0), link
