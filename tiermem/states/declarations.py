"""What ``rt.manage`` was told about the training loop, checked (rule 1 of NOTE [ Declared steps ] in
``tiermem.states.stepping``), and the clipping it declares (rule 5)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from tiermem.states.hostgrad import HostGradient, host_bytes
from tiermem.states.stored_grads import StoredGradient

__all__ = ["Declarations", "check_declarations", "clip_declared", "grad_norm", "grads_stream"]


def check_declarations(grad_accumulation_steps: Any, clip_grad_norm: Any) -> tuple[int | None, float | None]:
    """Validate what ``rt.manage`` was told about the loop (rule 1)."""
    steps: int | None = None
    if grad_accumulation_steps is not None:
        if isinstance(grad_accumulation_steps, bool) or not isinstance(grad_accumulation_steps, int):
            raise TypeError(
                f"tiermem manage: grad_accumulation_steps must be an int >= 1, got {grad_accumulation_steps!r}"
            )
        if grad_accumulation_steps < 1:
            raise ValueError(f"tiermem manage: grad_accumulation_steps must be >= 1, got {grad_accumulation_steps}")
        steps = grad_accumulation_steps
    norm: float | None = None
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)):
            raise TypeError(f"tiermem manage: clip_grad_norm must be a max norm > 0, got {clip_grad_norm!r}")
        if not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0:
            raise ValueError(f"tiermem manage: clip_grad_norm must be a finite max norm > 0, got {clip_grad_norm}")
        norm = float(clip_grad_norm)
        steps = steps or 1
    return steps, norm


def grads_stream(accumulation: int | None, max_norm: float | None, keep_gradients: bool) -> bool:
    """Whether every backward steps each offloaded chunk as it ends and frees its gradients
    (rules 3 and 6), so NVMe chunks' gradients only pass through the host: a declared loop
    stepping every backward, without clipping (which needs the whole norm first), that gave
    up its gradients (NOTE [ Default placement rule ] rule 3)."""
    return accumulation == 1 and max_norm is None and not keep_gradients


@dataclasses.dataclass(frozen=True)
class Declarations:
    """Rule 1: what ``rt.manage`` was told about the loop."""

    #: backwards per step; None when the loop is undeclared
    accumulation: int | None
    max_norm: float | None
    keep_gradients: bool

    @classmethod
    def check(cls, grad_accumulation_steps: Any, clip_grad_norm: Any, keep_gradients: bool = True) -> Declarations:
        accumulation, max_norm = check_declarations(grad_accumulation_steps, clip_grad_norm)
        if not keep_gradients and accumulation is None:
            raise ValueError(
                "tiermem manage: keep_gradients=False frees gradients as chunks step during backward, which only "
                "declared loops do: give grad_accumulation_steps= too"
            )
        return cls(accumulation, max_norm, bool(keep_gradients))

    @property
    def grads_stream(self) -> bool:
        """NVMe chunks' gradients only pass through the host (NOTE [ Default placement rule ] 3)."""
        return grads_stream(self.accumulation, self.max_norm, self.keep_gradients)


@dataclasses.dataclass
class _GradientHolder:
    """What ``clip_grad_norm_`` reads of a parameter: its ``.grad``."""

    grad: torch.Tensor


def _real_gradients(params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """The gradients of ``params`` as ``clip_grad_norm_`` reads them, and whether they are host
    bytes standing for HostGradients (NOTE [ Host gradients ] rule 6)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, HostGradient) for g in grads) or any(isinstance(g, StoredGradient) for g in grads):
        return grads, False
    return [host_bytes(g) for g in grads], True


def grad_norm(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The total L2 norm ``clip_grad_norm_(params, inf)`` returns, without its multiply by 1.0:
    ``clip_grad_norm_`` is ``get_total_norm`` then that in-place scale, which leaves the values
    bitwise as they were but bumps every gradient's version (rule 4 would take it for an edit).
    What a trainer logs each step when it does not clip (NOTE [ Declared steps ] rule 10)."""
    grads, on_host = _real_gradients(params)
    total = torch.nn.utils.get_total_norm(grads)
    return total.to(device) if on_host else total


def clip_declared(params: Sequence[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
    """Rule 5: ``clip_grad_norm_`` over the real gradients. HostGradients are read in place on
    the host (NOTE [ Host gradients ] rule 6): torch's function reads only ``.grad`` of what
    it is given, so it gets holders of the host bytes (a test checks it stays bitwise)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(isinstance(g, HostGradient) for g in grads) or any(isinstance(g, StoredGradient) for g in grads):
        # stored gradients are staged chunk by chunk as torch reads and scales them
        # (NOTE [ Stored gradients ] rule 3): never all in memory at once
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    holders = [_GradientHolder(host_bytes(g)) for g in grads]
    total = torch.nn.utils.clip_grad_norm_(holders, max_norm)  # type: ignore[arg-type]
    return total.to(device)  # where plain PyTorch's norm is (the first gradient's device)
