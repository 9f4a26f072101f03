"""What the activation offloader's collaborators share: the saved tensors autograd holds,
each block's group of them per forward pass, and small reads of a managed object's state.

The rules these serve are NOTE [ Activation offload rules ] (``tiermem/activations/offloader.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from tiermem.layout.activation_policy import BlockPolicy
from tiermem.registry import Handle


def in_backward() -> bool:
    """True while autograd runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class SavedActivation:
    """What autograd holds for one saved tensor: a handle plus its version at pack."""

    __slots__ = ("__weakref__", "group", "handle", "modified", "tensor_ref", "version")

    def __init__(self, handle: Handle, tensor: torch.Tensor, group: BlockGroup | None) -> None:
        self.handle = handle
        self.version = tensor._version
        # Weak: holding the tensor would keep its storage in memory after the write-back.
        self.tensor_ref = weakref.ref(tensor)
        self.group = group
        #: The error to raise at unpack, when the block's end found the tensor modified.
        self.modified: RuntimeError | None = None

    def __del__(self) -> None:
        # NOTE [ Activation offload rules ] rule 6: the graph released this saved tensor.
        with contextlib.suppress(Exception):
            self.handle.free()


class KeptTensor:
    """What autograd holds for a saved tensor kept as it is (NOTE [ Activation offload rules ]
    rule 3): the tensor and its version at pack, which unpack checks (rule 5). Returning the
    tensor bare would hide an in-place change from autograd too: hooks switch its own check off
    for every saved tensor, kept or not (TRAPS 1)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unpacked(self) -> torch.Tensor:
        """The tensor, unless it changed in place since pack: then autograd's own error."""
        if self.tensor._version != self.version:
            raise version_error(self.tensor, self.version)
        return self.tensor


@dataclass(eq=False)
class BlockGroup:
    """One block's saved tensors in one forward pass."""

    forward_id: int
    index: int
    policy: BlockPolicy
    saved: list[weakref.ref[SavedActivation]] = field(default_factory=list)
    #: Saved tensors held until the block's forward ends, so an in-place change made
    #: inside the block is seen even when the tensor dies before backward (TRAPS 1).
    pending: list[tuple[SavedActivation, torch.Tensor]] = field(default_factory=list)
    saved_bytes: int = 0
    started: float = 0.0
    forward_s: float = 0.0
    prefetched: bool = False
    #: Elements of the block's first tensor input, to scale size estimates by.
    input_numel: int = 0
    #: A fallback may change this block's policy (NOTE [ Activation fallbacks ] rule 2).
    flexible: bool = False
    #: The block's estimated saved bytes when it started (None: nothing measured yet).
    expected: int | None = None
    #: On CUDA, under adaptive keep: events recorded on the device's current stream as the block
    #: started and ended (NOTE [ Adaptive keep ] rule 4)
    events: list[torch.cuda.Event] = field(default_factory=list)

    def compute_seconds(self) -> float:
        """The block's forward time: on CUDA the GPU's, from its events once the end one ran (NOTE
        [ Adaptive keep ] rule 4); elsewhere the host's, which is the compute's."""
        if len(self.events) == 2:
            start, end = self.events
            try:
                start.synchronize()  # recorded on another stream where the block changed the current one
                end.synchronize()
                return float(start.elapsed_time(end)) / 1000
            except RuntimeError:  # an event CUDA cannot time: the host's reading, as before rule 4
                return self.forward_s
        return self.forward_s


class Forwards:
    """The forward passes of one offloader: every block's group by (forward, block), the
    block running now and the current forward's number. Written by the offloader's block
    hooks; read by its collaborators."""

    def __init__(self, forward_id: int, blocks: int) -> None:
        self.groups: dict[tuple[int, int], BlockGroup] = {}
        self.current: BlockGroup | None = None
        self.forward_id = forward_id
        #: The index of the block that started last: a block at or before it begins a new forward.
        self.last_index = blocks

    def group(self, forward_id: int, index: int) -> BlockGroup | None:
        return self.groups.get((forward_id, index))

    def prune(self) -> None:
        """Forget groups of earlier forwards whose saved tensors autograd has released
        (or that saved none, e.g. recomputed blocks)."""
        dead = [
            key
            for key, g in self.groups.items()
            if g.forward_id < self.forward_id and all(ref() is None for ref in g.saved)
        ]
        for key in dead:
            del self.groups[key]


def version_error(tensor: torch.Tensor, expected: int) -> RuntimeError:
    # The wording of autograd's own check (torch/csrc/autograd/saved_variable.cpp).
    name = f"{tensor.type()} {list(tensor.shape)}"
    grad_fn = tensor.grad_fn
    origin = f", which is output 0 of {grad_fn.name()}" if grad_fn is not None else ""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"[{name}]{origin}, is at version {tensor._version}; expected version {expected} instead. "
        "Hint: the backtrace further above shows the operation that failed to compute its gradient. "
        "(tiermem checked this: saved-tensor hooks turn autograd's own check off, TRAPS 1.)"
    )


def live_handles(refs: Sequence[weakref.ref[SavedActivation]]) -> Iterator[Handle]:
    """The handles of the saved tensors in ``refs`` that autograd still holds."""
    for ref in refs:
        saved = ref()
        if saved is not None and not saved.handle.freed:
            yield saved.handle
