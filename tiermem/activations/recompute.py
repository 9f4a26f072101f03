"""A block's forward under ``torch.utils.checkpoint``, as the ``recompute`` policy and the streamed
profiling pass run it (NOTE [ Profiling step ] rule 11 in :mod:`tiermem.planner.profiler`).

# NOTE [ Recomputed blocks and caches ]
1. A decoder layer given a decoding cache (Hugging Face's ``past_key_values`` or ``layer_past``,
   with ``use_cache=True``, a model config's default) writes its keys and values into that cache
   as it runs. Recomputed in backward, the same call finds the cache its first run wrote and
   attends over the keys twice: the checkpoint raises ``CheckpointError`` (a T5 built from a config
   and trained under ``block_policy="recompute"`` failed in its second step's backward, and its
   streamed first-step profile failed, leaving the default placement), or, where the counts
   happened to agree, other gradients.
2. So a recomputed block runs without the cache, as Hugging Face's own gradient checkpointing runs
   its layers (``GradientCheckpointingLayer``): ``use_cache=False``, and ``past_key_values``,
   ``past_key_value`` (older versions' name) and ``layer_past`` None unless the layer says it only
   reads the cache (``_can_checkpoint_with_cache``). A training forward reads nothing back from the
   cache it writes, so no value changes: a T5 trains to bitwise the same losses with ``use_cache`` on
   and off, and its step under ``recompute`` is plain PyTorch's (tests/test_activations_hf.py). The
   cache the model returns lacks the recomputed layers' entries, as under Hugging Face's
   checkpointing. A cache passed positionally is not seen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

#: rule 2: the keyword arguments through which a layer writes a decoding cache
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def without_cache(block: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Rule 2: ``kwargs`` for ``block``'s recomputed forward (a new dict where one changes)."""
    if kwargs.get("use_cache"):
        kwargs = {**kwargs, "use_cache": False}
    if not getattr(block, "_can_checkpoint_with_cache", False):
        for name in CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs = {**kwargs, name: None}
    return kwargs


def checkpointed(
    block: nn.Module,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
) -> Any:
    """``forward(*args, **kwargs)`` (``block``'s) under a non-reentrant checkpoint, without a cache
    to write twice (rule 2); ``context_fn`` as ``torch.utils.checkpoint.checkpoint`` takes it."""
    options: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}
    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False, **options, **without_cache(block, kwargs)
    )
