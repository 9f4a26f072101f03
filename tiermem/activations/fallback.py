"""What the activation offloader does when a tier fails or the device budget runs short.

# NOTE [ Activation fallbacks ]
1. When: a block's policy is decided when its forward starts (its forward pre-hook),
   because ``recompute`` wraps the block's forward in ``torch.utils.checkpoint`` and cannot
   be chosen once that forward runs. A decision can only use what is known then: the
   failures reported so far, the device budget free now, and the bytes the block saved the
   last time it ran (scaled by the size of its first tensor input). So a disk that fails
   while block ``i`` runs changes blocks ``i+1...`` of this forward and the next forwards,
   never block ``i`` itself: block ``i`` is *kept*.
2. Which blocks: blocks that offload (``host``, ``nvme``) and blocks whose policy tiermem
   chose (every block under ``auto``; the last block of a plain ``host``/``nvme`` policy,
   kept because backward starts there). A block the user set to ``keep`` or ``recompute``
   is never changed: that is an instruction, and breaking the budget under it is an error.
3. Tier failures: a write-back that fails (disk full, I/O error, tier full) leaves its
   object resident on the device with its bytes intact (NOTE [ Managed object rules ] 2):
   that block is kept. The failure reaches the training thread through the
   :class:`WriteLedger` (filled on the scheduler's thread) and is acted on at the next
   block start or saved tensor. The tier is then *out* for the rest of this forward and the
   next 1, 2, 4, ... 64 forwards (doubling while retries keep failing; a write that lands
   after the outage ends clears it). Blocks planned for a tier that is out fall back to
   keep, or to recompute when the device cannot hold them (rule 4).
4. Device budget: the *room* is the device budget minus what stays resident: bytes in use
   now, less the write-backs in flight to working tiers (they free theirs on landing). A
   kept block needs its estimate in that room now; an offloaded block needs it in
   backward, to come back into (what stays resident now is still there when backward
   reaches it: kept blocks before it, tensors saved outside the blocks). A flexible block
   whose estimate exceeds the room is recomputed instead. The room also keeps back what the
   last forward saved outside the blocks (embeddings, head, loss): backward needs the
   head's tensors first, before any block frees its bytes. A block that fits by estimate
   but meets a full device while it runs waits for the write-backs in flight (rule 5).
5. A saved tensor that still does not fit on the device (the estimate was short, a failing
   write freed nothing, or the first forward had nothing to estimate from) first makes
   room by *evicting*: kept tensors of earlier flexible blocks of this forward are written
   synchronously to a working tier, the earliest block first (backward needs it last).
   If that is not enough, the tensor itself is written synchronously to the first working
   tier of: the block's offload tier, ``nvme``, ``host``. Both are stalls, not errors
   (blocks under a user's explicit ``keep`` excepted, rule 2). Only when nothing takes it
   does :class:`ActivationMemoryError` name the block, the bytes, each tier's state and
   what to change. A model's first forward has nothing measured: its first block's size
   and the bytes saved after the last block are unknown when decisions are made, so in a
   budget within about one block of the need the first step can still end in the clear
   error at backward (a tensor that cannot come back); later steps decide from
   measurements.
6. Every fallback logs a warning (once per block, forward and kind) and counts in
   ``activations.fallbacks`` and ``activations.fallback_reasons["<cause>-><action>"]``,
   cause ``disk_full | io_error | tier_full | device_full``, action ``keep | recompute |
   evict:<tier> | spill:<tier>``.
7. Gradients never change: keep and spill only move bytes, and recompute is
   ``torch.utils.checkpoint`` (which restores the RNG state), bitwise on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiermem.activations.ledger import WriteFailure, WriteLedger, failure_cause
from tiermem.activations.memory import MAX_OUTAGE_FORWARDS, ModelMemory, Outage
from tiermem.layout.activation_policy import BlockPolicy

# The ledger, the outages and the model memory lived here: importable from here still.
__all__ = [
    "MAX_OUTAGE_FORWARDS",
    "ModelMemory",
    "Outage",
    "WriteFailure",
    "WriteLedger",
    "decide",
    "failure_cause",
    "first_tensor_numel",
]


def first_tensor_numel(args: Sequence[object]) -> int:
    """Elements of a block's first tensor input (its hidden states), 0 when there is none."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.numel()
    return 0


def decide(planned: BlockPolicy, outage_cause: str | None, expected: int | None, room: int) -> tuple[BlockPolicy, str]:
    """A flexible block's policy for this forward (rules 3, 4) and the fallback taken
    ("" when none). ``outage_cause``: why the planned offload tier is out, or None;
    ``expected``: the block's estimated saved bytes (None: not measured yet); ``room``:
    the device budget minus what stays resident (rule 4)."""
    if planned is BlockPolicy.RECOMPUTE:
        return planned, ""
    cause = outage_cause or "device_full"
    if expected is not None and expected > room:
        return BlockPolicy.RECOMPUTE, f"{cause}->recompute"
    if planned.offloads and outage_cause is not None:
        return BlockPolicy.KEEP, f"{cause}->keep"
    return planned, ""
