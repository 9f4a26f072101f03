"""Steps an undeclared loop's backward runs ahead of ``optimizer.step()``, kept apart from the
chunks until the step shows they are the step it would have run.

# NOTE [ Speculative steps ]
1. Why: an undeclared loop (``rt.manage`` told nothing about the loop) may clip, scale or edit
   gradients, change hyperparameters or accumulate between backward and ``optimizer.step()``, so
   its chunks cannot step early in place (NOTE [ Declared steps ] rule 3). Its step phase then
   reads and writes every NVMe home while compute waits: on the 210M HF GPT-2 at 10% / 10% the
   plain loop took 9.9 s a step against the declared loop's 7.6. Most plain loops do none of
   those things, so their backward can step each NVMe chunk as a declared loop does, into a
   copy of its home, and ``optimizer.step()`` keeps the copies when nothing changed.
2. When: a backward of an undeclared loop without clipping arms them when it is the first
   backward since ``optimizer.step()`` after one forward with grad, no re-pack is due, no
   asynchronous checkpoint is pending, and the last window was *clean*: one counted backward,
   its gradients untouched until ``optimizer.step()`` (rule 4 of NOTE [ Declared steps ]
   records their versions), no optimizer attributes (``grad_scale``, ``found_inf``). So the
   first window never speculates, and neither does a loop that accumulates or edits by hand.
3. How: only chunks with NVMe homes. A chunk's *shadow* is a new host object filled from its
   home (the home stays where it is, untouched); its step (``ChunkStep``, on the step thread as
   any early step) computes over the shadow, with its small states (``step``) copies, and keeps
   the optimizer records it found aside; the shadow then goes to NVMe as a new object. Host
   room: a shadow counts as a staged home (the plan's ``staged_homes``); NVMe room: each
   shadow is one more home until ``optimizer.step()`` (a shadow that does not fit is not
   made: that chunk steps at ``optimizer.step()``). At the end of backward every step has
   finished and shadows of chunks that did not step are freed, so after backward no copy
   reads a home.
4. Kept: ``optimizer.step()`` keeps every shadow when the window held exactly one counted
   backward, no gradient changed since it ended (tensor and version), the optimizer's groups
   hold the same hyperparameters as when backward began (values compared, tensors by value),
   the optimizer carries no ``grad_scale``/``found_inf``, no re-pack is due, and the store's
   version (any write to a chunk or its optimizer records: parameter writes, state loads)
   is the one backward ended with. Keeping one swaps the chunk's home for its shadow, frees the
   old home and stores the records: the same bytes the step would have written in place.
5. Discarded otherwise, all of them: shadows freed, the records dropped, and every chunk steps
   at ``optimizer.step()`` from its untouched home, as if nothing had run ahead. Speculation is
   then off for the model (the loop showed it does such things), logged once with the reason.
6. Exactness: the kept step is ``ChunkStep`` over the same home bytes, gradients and
   hyperparameters as the step ``optimizer.step()`` would run, so bitwise the same; until
   ``optimizer.step()`` parameters, optimizer state, state dicts and checkpoints all read the
   untouched homes, as plain PyTorch's do before its step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from tiermem.registry import Handle, Transfer
from tiermem.states.chunks import Chunk
from tiermem.states.facts import ParamState

__all__ = ["Shadow", "hyperparameters", "same_hyperparameters"]


@dataclasses.dataclass(eq=False)
class Shadow:
    """Rule 3: a chunk's home copied to the host, stepped there, then on its way to NVMe."""

    chunk: Chunk
    handle: Handle
    #: the copies into :attr:`handle` (from the home, and from the device copy), until they landed
    fills: list[Transfer]
    #: the optimizer records the step found, once it ran (None: not stepped)
    records: dict[int, ParamState] | None = None

    def landed(self) -> bool:
        return all(fill.done() for fill in self.fills)

    def wait_filled(self) -> None:
        """Wait for every copy into the shadow; then raise the first one's error."""
        fills, self.fills = self.fills, []
        error: BaseException | None = None
        for fill in fills:
            try:
                fill.wait()
            except BaseException as exc:  # noqa: BLE001 - the others still write the shadow: wait for them too
                error = error or exc
        if error is not None:
            raise error


def hyperparameters(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rule 4: every group's settings but its parameters, tensors copied (a scheduler may change a
    tensor learning rate in place)."""
    return [
        {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in group.items() if k != "params"}
        for group in param_groups
    ]


def same_hyperparameters(before: list[dict[str, Any]], param_groups: Sequence[dict[str, Any]]) -> bool:
    """Rule 4: the groups still hold the settings :func:`hyperparameters` recorded."""
    now = [{k: v for k, v in group.items() if k != "params"} for group in param_groups]
    if len(now) != len(before) or any(a.keys() != b.keys() for a, b in zip(before, now, strict=True)):
        return False
    for a, b in zip(before, now, strict=True):
        for key, old in a.items():
            new = b[key]
            if isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor):
                if not (
                    isinstance(old, torch.Tensor)
                    and isinstance(new, torch.Tensor)
                    and old.shape == new.shape
                    and old.dtype == new.dtype
                    and torch.equal(old, new.detach().to(old.device))
                ):
                    return False
                continue
            try:
                if type(old) is not type(new) or bool(old != new):
                    return False
            except Exception:  # noqa: BLE001 - a value that cannot be compared counts as changed
                return False
    return True
