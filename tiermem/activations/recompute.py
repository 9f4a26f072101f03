"""A block's forward under ``torch.utils.checkpoint``, as the ``recompute`` policy and the streamed
profiling pass run it (NOTE [ Profiling step ] rule 11 in :mod:`tiermem.planner.profiler`).

# NOTE [ Recomputed blocks and caches ]
1. A decoder layer given a decoding cache (Hugging Face's ``past_key_values`` or ``layer_past``; a
   T5 decoder passes one to every layer in training, whatever ``use_cache`` says) writes its keys
   and values into that cache as it runs. Recomputed in backward, the same call found the cache
   its first run wrote and took another path: the checkpoint raised ``CheckpointError`` (a T5
   built from a config and trained under ``block_policy="recompute"`` failed in its second
   step's backward, and its streamed first-step profile failed, leaving the default placement).
2. Dropping the cache for a recomputed layer, as Hugging Face's own gradient checkpointing does,
   runs but is not exact: a T5 layer without a cache attends over its keys by another path, and
   the loss moved in its last bit. So the forward's first run writes the real cache, as the
   plain forward does, and the recomputation gets a copy of each cache as that first run found
   it (taken before it ran), which it writes in turn: the same path, the same bits, and the
   cache the model returns is the plain forward's.
3. The copy is of the cache's structure (its objects, lists and dicts), its tensors shared: the
   layer's update replaces the tensors of its own entry (``torch.cat``), it does not write into
   them. A cache that cannot be copied so (a lock, a stream: ``copy.deepcopy`` refuses) is
   dropped for the layer instead (rule 2's inexact way, logged once), which still runs.
   What it costs: each copy holds the tensors the cache held as the layer ran (the keys and
   values of the layers before it) until the layer's recomputation. Where the caller drops the
   model's output at once (``model(...).loss``), up to one set of every recomputed decoder
   layer's keys and values lives until backward reaches it, which the plan's memory model does
   not count (a recomputed block holds its inputs there).
4. A layer that says it only reads the cache (``_can_checkpoint_with_cache``) is given it as is.
   A cache passed positionally is not seen.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("tiermem.activations")

#: rule 1: the keyword arguments through which a layer writes a decoding cache (``past_key_value``:
#: older transformers' name)
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


@functools.cache
def _warn_dropped(layer: str, error: str) -> None:
    """Rule 3, once per layer class and refusal: the recomputed layers run without their cache."""
    log.warning(
        "tiermem activations: %s's decoding cache cannot be copied for its recomputation (%s); the recomputed "
        "layers run without it, as Hugging Face's gradient checkpointing does (their results may differ from the "
        "plain forward's in the last bits)",
        layer,
        error,
    )


def _tensors_shared(root: Any) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo that maps every tensor reachable from ``root`` to itself (rule 3)."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            memo[id(obj)] = obj
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif not isinstance(obj, (str, bytes, int, float, bool, type(None))):
            stack.extend(getattr(obj, "__dict__", {}).values())
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
    return memo


def _structure_copy(cache: Any) -> Any:
    """Rule 3: ``cache``'s objects copied, its tensors shared."""
    return copy.deepcopy(cache, _tensors_shared(cache))


def checkpointed(
    block: nn.Module,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
) -> Any:
    """``forward(*args, **kwargs)`` (``block``'s) under a non-reentrant checkpoint whose
    recomputation finds the decoding caches as the first run found them (rules 2-4);
    ``context_fn`` as ``torch.utils.checkpoint.checkpoint`` takes it."""
    options: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}
    caches = {name: kwargs[name] for name in CACHE_ARGUMENTS if kwargs.get(name) is not None}
    if not caches or getattr(block, "_can_checkpoint_with_cache", False):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)
    try:
        before = {name: _structure_copy(cache) for name, cache in caches.items()}
    except Exception as exc:  # noqa: BLE001 - rule 3: any refusal to copy means the cache is dropped
        _warn_dropped(type(block).__name__, f"{type(exc).__name__}: {exc}")
        dropped = {**kwargs, **dict.fromkeys(caches)}
        if dropped.get("use_cache"):
            dropped["use_cache"] = False
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **options, **dropped)
    runs = 0

    def run(*call_args: Any, **call_kwargs: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs > 1:  # a recomputation: each cache as the first run found it, in a copy it may write
            call_kwargs = {**call_kwargs, **{name: _structure_copy(cache) for name, cache in before.items()}}
        return forward(*call_args, **call_kwargs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **options, **kwargs)
