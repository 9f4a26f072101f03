"""The instrumented step: what the planner needs, measured on a sample batch. Its link probes
(rule 5) are in :mod:`~tiermem.planner.probes` (re-exported here).

# NOTE [ Profiling step ]
1. It runs on the parameters in plain PyTorch (not chunked; rule 8: streamed), on a sample: what the user gives
   (``rt.manage(..., sample=...)``: a tuple of the model's positional arguments, or a
   callable ``sample(model) -> loss``), or else the arguments of the managed model's first
   forward with grad, as a :class:`Batch` (the manager plans as that forward starts in
   training mode, else at the next ``optimizer.step()``: NOTE [ Model-state rules ] rule 9).
   A tuple's or a batch's backward
   is that of its scalar outputs (a loss), or of every differentiable output with ones when
   there is none.
2. It changes nothing training depends on (TRAPS 10): the RNG states (CPU and CUDA) are
   forked, every buffer (BatchNorm running statistics, ``num_batches_tracked``) is copied
   back, the parameters' ``.grad`` are put back as they were, and the mode is left alone.
3. Pass 1 measures bytes: saved tensors per block through saved-tensor hooks (first saver
   counts, parameters, buffers and their views left out, as the offloader does), and the
   live tensor bytes around every operator through a dispatch mode (the transient peaks).
   It also warms up. The next passes (none when streamed: rule 9) measure time with only block
   hooks installed: three (of two, the lower middle is the faster: a 3 s Hugging Face GPT-2 step
   was predicted 7-34% fast),
   and more while they have taken under ``TIMING_BUDGET_S`` together (at most
   ``MAX_TIMING_PASSES``); the median pass counts (the lower middle of an even count): the
   cost model predicts the median step a run measures, and the fastest pass of a shared
   machine predicted 5-25% too fast (bench/README.md, Planner); a small model's step swung
   0.04-0.32 s between consecutive plain steps here under load, so two short passes are too
   few.
4. Backward time per block: from the pre-hook of its output's ``grad_fn`` to the gradient of
   its input; where the input needs no gradient, to the next block's start.
5. Links are probed through the real tiers (registry moves, the path training uses), the
   optimizer on a sample of the real parameter shapes (a parameter larger than the sample on
   its first elements), scaled by bytes: the fastest of warm steps timed for up to
   ``OPTIMIZER_TIMING_BUDGET_S`` (a process's first steps over fresh memory run several times
   slower than its steady state, which the training steps reach). Where ``[nvme]
   paths`` stripes over several paths, each path's own write and read are probed too,
   straight through the NVMe tier on the stripe units that live on it (the cost model reads
   the aggregate links only; the per-path ones show a slow drive).
6. On a CUDA device the dispatch mode does not see backward (it runs on the device's own
   threads): transient backward peaks are then those of forward.
7. What a managed step adds beyond this plain step (hooks, saved-tensor registration, per
   chunk moves) is measured separately, on the real machinery (NOTE [ Overhead calibration ]
   in ``tiermem.planner.calibrate``), and counted per unit: saved tensors per block here.
8. Streamed (the first-step plan of a model whose plain copy would not fit the capacities:
   NOTE [ Streamed first-step profiling ] in ``tiermem.states.streamed_profile``): the
   parameters stay views into their chunks, streamed through the device budget while the
   passes run. Times are read on :func:`~tiermem.planner.streaming.profiling_clock`, which
   leaves out the training thread's fetch waits: compute without the I/O waits (compute that
   ran beside a prefetch's copy counts as compute, so they err slow). Bytes, order, modules
   and first blocks are measured as on plain parameters. The optimizer is timed on synthetic
   tensors of the real shapes (the step's arithmetic does not depend on the values), as many
   bytes as fit with their gradient and states in what the memory tiers have free, between
   ``STREAMED_OPTIMIZER_SAMPLE_BYTES`` and ``OPTIMIZER_SAMPLE_BYTES``: estimated, a sample
   that fits the CPU caches errs fast (here 0.4-0.5 ns/byte on 4 MiB, 0.75-1.0 on 32 MiB).
   Measured: streamed passes of a GPT took 0.15-0.22 s where plain ones took 0.30-0.39 s (a
   plain pass allocates every gradient afresh; a streamed one drops each as it accumulates,
   as a managed step does, which took 0.21 s): the streamed times are the closer ones.
9. Streamed, one pass measures everything: no timing passes follow the bytes pass. Each was a
   forward and backward streamed from NVMe (of a 210M GPT's 131 s of first-step profiling,
   90 s). The times are that one pass's, not a median: the real first step has just run, so
   the process is warm.
10. That pass reads a clock without the dispatch mode's own bookkeeping (its Python around
   each operator), since the pass that counts bytes is now the one timed. Measured on a 2-core
   VM under load: a 30M GPT-2's forward and backward (1,450 operators) took 7-11% more CPU
   seconds under the mode; the timed bookkeeping is about a third of that, and the rest, not
   found, makes the times err slow.
11. The pass holds its activations as recompute would, so profiling stays near the capacities
   (the plain pass held every block's activations: +520 MiB of a 200M LoRA run's peak). Each
   block's forward runs under a non-reentrant ``torch.utils.checkpoint`` (RNG restored, so the
   values are bitwise the same), and only the checkpoints' inputs stay alive through forward.
12. A counting hook is chained in front of the checkpoint's own pack hook (TRAPS 6: one pushed
   without chaining would keep every tensor), so each block's saved bytes are counted as the
   plain pass counts them; the outer hook leaves what runs inside a block to it (the checkpoint
   also saves the block's inputs, which plain autograd saves only where an operator does).
13. The recompute context times each recomputation, and that time is taken out of the block's
   backward and the pass's. A block inside other saved-tensor hooks (the model's own checkpoint
   around it) runs as they say, and is counted as the plain pass counts it.
14. A recomputed block runs its forward again inside backward, beside the chunks that
   backward pins: the device must hold one module's span of streamed chunks more than the
   pool's buffers. Where it cannot (``Streaming.recompute`` is False), the pass keeps its
   blocks' activations as a plain pass does, beyond the capacities, rather than fail: a LoRA
   base of 1 MiB chunks at a device of 1.9 MiB failed its profiling pass there (a chunk needs
   1.01 MiB, 1.01 MiB of 1.91 MiB in use) and kept the default placement.
15. Backward stops short of the blocks it can do without: in the streamed pass, and in the timing
   passes on plain parameters (their bytes pass runs backward whole, for every block's backward
   peak). A block is the *twin* of another of the same class with the same parameters (names,
   shapes, dtypes, which train); of each class the last ``MEASURED_TWINS`` blocks are measured. The
   pass detaches the output of the block before the first measured one (the *cut*), so its backward
   runs the head, the measured blocks and what follows them, and none of the blocks before the cut,
   nor their recomputation. Their forward is measured as before (bytes, time, transient peaks;
   streamed, the first of each class's only: rule 16); their backward time is their forward time
   times their measured twins' backward / forward, and their backward transient peak (streamed,
   where no backward ran them) their twins' largest. Why: of a 210M GPT-2's 35 CPU s first step, 10
   were the streamed pass's backward with every block recomputed, for 16 blocks of one class. The
   cut is made only where it splits the blocks in execution order (every block before it ran, none
   after it), once a pass; a block before it that backward still reaches (a skip connection around
   the cut) is measured where it ran. What it leaves out: the backward of whatever runs before the
   first block (an embedding's, a few milliseconds), which the outside part then lacks. The output
   at the cut is a copy of the detached one: a model may write into a block's output in place,
   which autograd refuses on a leaf that needs grad.
16. The streamed pass and the timing passes (not the plain bytes pass, which measures every block's
   bytes) also skip the forward of the blocks before the cut but the first of each class
   (:class:`_Skipped`): such a block returns what the first block of its class returned, its first
   output tensor replaced by the block's own first input, so the hidden state passes through and
   none of its parameters is read or fetched (where the twin returned no tensor of the input's
   shape, dtype and device, the block runs). Its forward time is its measured twins' mean in the
   same pass; streamed, its saved bytes and forward transient peak are the first measured twin's
   and its input bytes its own; its parameters enter the execution order where its forward would
   have put them, in the order its twin used theirs, as first used in it; the pass's forward counts
   the stand-in seconds. Why: the pass ran the forward of all 16 blocks of a 210M GPT-2, each
   block's chunks read from NVMe, for numbers 13 of them share with their twins. Uncached first
   step of ``bench/first_step.py --size 210M`` (instrumented worker, 3 pairs alternated in fresh
   processes, 2-vCPU EPYC): the pass 3.7-4.2 s -> 1.6-1.7 s, the first step 2.40-2.71x ->
   1.89-2.08x a steady step in wall time (1.61-1.85x in CPU seconds), the same plan and losses. On
   plain parameters, ``measure`` of a 12-layer HF GPT-2 (d=512, batch 2 x 256; three calls in a
   process, old and new code alternated twice): 3.1-3.9 s -> 2.35-2.6 s a call. What it assumes:
   twins compute alike whatever the values they are given (a router that picks experts by value
   would not), and what a model hands every block to keep across calls takes no harm from a block
   that did not run (Hugging Face's ``DynamicCache`` keeps each layer's entries apart). The
   stand-ins hold only where the cut is made: a pass that skipped a block and made no cut (a block
   before it was not called) is run again with every block.
17. On a CUDA device every time the passes read (:func:`~tiermem.planner.streaming.profiling_clock`)
   first waits for the kernels queued on the profiled device's current stream: they run after the
   host queued them, so the host's clock alone reads when a block's work was queued, not how long
   it ran. An H200's plan read 21 ms of compute in a step that ran 93 ms with every activation
   kept, and put the other 98 ms under overhead. The calibration's steps are timed the same way
   (NOTE [ Overhead calibration ]). Other streams are not waited for: a copy in flight beside
   compute is I/O. Rule 10's bookkeeping is not taken out there: it ran on the host while the
   kernels ran on the device. The device is the one profiled, named, not the current one (a
   rank's device need not be current).
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from tiermem.activations.blocks import BlockSpec, ForwardPatches, find_blocks
from tiermem.activations.recompute import checkpointed
from tiermem.planner.errors import ProfileError
from tiermem.planner.profile import BlockStats, ParamStats
from tiermem.planner.streaming import profiling_clock, streamed


@dataclass(frozen=True)
class Batch:
    """A forward call's positional and keyword arguments, as a profiling sample: what a managed
    model's first real forward was given (NOTE [ Model-state rules ] rule 9 in
    ``tiermem.states.manager``). Its backward follows rule 1, as a tuple's does."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]


Sample = tuple[Any, ...] | Batch | Callable[[nn.Module], torch.Tensor]

MEASURED_TWINS = 2
"""NOTE [ Profiling step ] rule 15: the blocks of one class measured through backward, the last ones."""

MIN_TIMING_PASSES = 3
MAX_TIMING_PASSES = 8
TIMING_BUDGET_S = 1.0
"""NOTE [ Profiling step ] rule 3: timing passes, and the seconds below which more are run."""


@dataclass
class _Marks:
    """Timestamps and byte counts of one pass."""

    forward: list[tuple[float, float]] = field(default_factory=list)
    backward_start: dict[int, float] = field(default_factory=dict)
    backward_end: dict[int, float] = field(default_factory=dict)
    saved: list[int] = field(default_factory=list)
    saved_count: list[int] = field(default_factory=list)
    small: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)
    outside_saved: int = 0
    outside_saved_count: int = 0
    outside_small: int = 0


class _LiveBytes(TorchDispatchMode):
    """Live tensor bytes after every operator, and their peak since :meth:`mark` (rule 3); and
    the seconds its own bookkeeping took, which :meth:`clock` leaves out (rule 10: the pass it
    counts in is also the one timed)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._clock = profiling_clock(device)
        self.live = 0
        self.peak = 0
        self.spent = 0.0
        self._seen: set[int] = set()

    def mark(self) -> int:
        self.peak = self.live
        return self.live

    def clock(self) -> float:
        """:func:`~tiermem.planner.streaming.profiling_clock` less this mode's bookkeeping so far. On
        CUDA the bookkeeping ran on the host while queued kernels ran on the device, so none of it is
        taken out (rule 17)."""
        now = self._clock()
        return now if self.device.type == "cuda" else now - self.spent

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returned = time.perf_counter()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                self._track(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        self.spent += time.perf_counter() - returned
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


@contextlib.contextmanager
def unchanged_training_state(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Rule 2 (TRAPS 10): RNG, buffers and ``.grad`` as they were, whatever happens inside."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for p, grad in grads:
            p.grad = grad


def _loss(model: nn.Module, sample: Sample) -> list[torch.Tensor]:
    """Rule 1: the tensors to run backward from."""
    if callable(sample):
        loss = sample(model)
        outputs = [loss] if isinstance(loss, torch.Tensor) else []
    else:
        result = model(*sample.args, **sample.kwargs) if isinstance(sample, Batch) else model(*sample)
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t.requires_grad]
    scalars = [t for t in outputs if t.dim() == 0]
    chosen = scalars or outputs
    if not chosen:
        raise ProfileError(
            "tiermem planner: the profiling sample gave no output that requires grad; pass sample=(inputs...) "
            "whose forward returns a loss or differentiable outputs, or sample=lambda model: loss"
        )
    return chosen


def _run(model: nn.Module, sample: Sample, device: torch.device) -> tuple[float, float]:
    """One forward and backward: (forward seconds, backward seconds)."""
    clock = profiling_clock(device)
    start = clock()
    outputs = _loss(model, sample)
    middle = clock()
    torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    return middle - start, clock() - middle


class _BlockHooks:
    """Per-block forward and backward timestamps (rules 3 and 4), and saved bytes when asked."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        protected: set[int],
        min_bytes: int,
        live: _LiveBytes | None,
        device: torch.device,
    ):
        self.blocks = blocks
        self.protected = protected
        self.min_bytes = min_bytes
        self.live = live
        self.marks = _Marks()
        self.running: int | None = None
        #: storage id -> versions counted, while the storage lives (recomputed blocks free their
        #: saved tensors in forward, so an id can come back as another storage's)
        self.seen: dict[int, set[int]] = {}
        #: rules 11-12: blocks run checkpointed; their saved tensors are counted by :meth:`count`
        #: from inside the checkpoint, so the outer hook leaves what runs inside a block alone
        self.inner_only = False
        self.peaks: dict[tuple[str, int], int] = {}
        #: rule 15: the first measured block; the output of the block before it is detached
        #: (0: nothing is cut), and whether the cut was made in this pass
        self.cut = 0
        self.cut_made = False
        self._ran: set[int] = set()  # blocks whose forward ended in this pass
        self._base: dict[tuple[str, int], int] = {}
        self._handles: list[Any] = []
        self._started = 0.0
        #: the pass's clock: without the dispatch mode's bookkeeping where one counts bytes
        self.clock: Callable[[], float] = live.clock if live is not None else profiling_clock(device)

    def __enter__(self) -> _BlockHooks:
        count = len(self.blocks)
        self.marks.saved = [0] * count
        self.marks.saved_count = [0] * count
        self.marks.small = [0] * count
        self.marks.inputs = [0] * count
        self.marks.forward = [(0.0, 0.0)] * count
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._pre, index)))
            self._handles.append(block.register_forward_hook(functools.partial(self._post, index), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, index: int, _module: nn.Module, args: Any) -> None:
        self.running = index
        self._started = self.clock()
        tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        if tensors:
            self.marks.inputs[index] = tensors[0].untyped_storage().nbytes()
            first = tensors[0]
            if first.requires_grad:
                first.register_hook(functools.partial(self._input_grad, index))
        if self.live is not None:
            self._base[("forward", index)] = self.live.mark()

    def _post(self, index: int, _module: nn.Module, _args: Any, output: Any) -> Any:
        self.marks.forward[index] = (self._started, self.clock())
        self.running = None
        self._ran.add(index)
        if self.live is not None:
            # Rule 3: peak above what the block leaves behind (its saved tensors and output).
            self.peaks[("forward", index)] = self.live.peak - self.live.live
            self.live.mark()  # the next peak is that of what runs after this block
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                t.grad_fn.register_prehook(functools.partial(self._backward_start, index))
                break
        if index == self.cut - 1 and self._splits_here():
            self.cut_made = True
            # a copy of the detached leaf, as a block's output is no leaf: a model may write into it
            # in place (``x = block(x); x.mul_(s)``), which autograd refuses on a leaf that needs grad
            return tree_map_only(torch.Tensor, _cut, output)
        return None

    def _splits_here(self) -> bool:
        """Rule 15: the cut after block ``cut - 1`` splits the blocks in execution order: every
        block before it ran, none after it; once a pass, and only where backward will follow."""
        return torch.is_grad_enabled() and not self.cut_made and self._ran == set(range(self.cut))

    def _backward_start(self, index: int, _grads: Any) -> None:
        self.marks.backward_start.setdefault(index, self.clock())
        if self.live is not None:
            self._base[("backward", index)] = self.live.mark()

    def _input_grad(self, index: int, _grad: torch.Tensor) -> None:
        self.marks.backward_end.setdefault(index, self.clock())
        if self.live is not None and ("backward", index) in self._base:
            self.peaks[("backward", index)] = self.live.peak - self._base[("backward", index)]

    # -- saved tensors, counted per block ----------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (self.inner_only and self.running is not None):
            self.count(tensor)
        return tensor  # kept: recompute (rule 11) drops tensors by its own hooks, not by these

    def count(self, tensor: torch.Tensor) -> None:
        """One tensor autograd saves: the first saver of a (storage, version) counts it."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.protected:
            return
        versions = self.seen.get(key)
        if versions is None:
            versions = self.seen[key] = set()
            weakref.finalize(storage, self.seen.pop, key, None)
        elif tensor._version in versions:
            return
        versions.add(tensor._version)
        nbytes = storage.nbytes()
        big = nbytes >= self.min_bytes
        if self.running is None:
            if big:
                self.marks.outside_saved += nbytes
                self.marks.outside_saved_count += 1
            else:
                self.marks.outside_small += nbytes
        elif big:
            self.marks.saved[self.running] += nbytes
            self.marks.saved_count[self.running] += 1
        else:
            self.marks.small[self.running] += nbytes


class _Recomputed:
    """Rule 9: while entered, every block's forward runs under a non-reentrant
    ``torch.utils.checkpoint`` whose forward context counts what autograd saves (chained in
    front of the checkpoint's own pack hook, which then drops it: TRAPS 6) and whose recompute
    context times the recomputation, so it can be taken out of the block's backward."""

    def __init__(self, blocks: Sequence[nn.Module], hooks: _BlockHooks) -> None:
        self.blocks = blocks
        self.hooks = hooks
        self.recompute_s = [0.0] * len(blocks)
        self._patches = ForwardPatches()

    def __enter__(self) -> _Recomputed:
        self.hooks.inner_only = True
        for index, block in enumerate(self.blocks):
            self._patches.patch(block, functools.partial(self._forward, index, block.forward))
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.inner_only = False
        self._patches.restore()

    def _forward(self, index: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if not torch.is_grad_enabled() or top is None or top[0] != self.hooks.pack:
            # Other saved-tensor hooks decide what this block keeps (the user's own checkpoint
            # around it, save_on_cpu): as in the plain pass, they are not ours to count or drop.
            return original(*args, **kwargs)
        contexts = functools.partial(self._contexts, index)
        # its recomputation finds a decoding cache as its first run did (NOTE [ Recomputed blocks and caches ])
        return checkpointed(self.blocks[index], original, args, kwargs, context_fn=contexts)

    def _contexts(self, index: int) -> tuple[contextlib.AbstractContextManager[None], ...]:
        return self._counted(), self._timed(index)

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert top is not None  # entered inside the checkpoint's own hooks
        pack, unpack = top

        def counted(tensor: torch.Tensor) -> Any:
            self.hooks.count(tensor)
            return pack(tensor)

        with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
            yield

    @contextlib.contextmanager
    def _timed(self, index: int) -> Iterator[None]:
        start = self.hooks.clock()
        try:
            yield
        finally:
            self.recompute_s[index] += self.hooks.clock() - start


class _Skipped:
    """Rule 16: while entered, the forward of each block in ``skip`` (block -> the twin it stands
    for) returns what its twin returned with the twin's first output tensor replaced by the
    block's own first input: the hidden state passes through unchanged, nothing is computed, no
    parameter of it is read (streamed, none fetched). Where the twin has not run or returned no
    tensor of the input's shape and dtype, the block runs."""

    def __init__(self, blocks: Sequence[nn.Module], skip: Mapping[int, int]) -> None:
        self.blocks = blocks
        self.skip = skip
        #: the blocks that were skipped in this pass
        self.done: list[int] = []
        self._outputs: dict[int, Any] = {}
        self._patches = ForwardPatches()
        self._handles: list[Any] = []

    def __enter__(self) -> _Skipped:
        for twin in sorted(set(self.skip.values())):
            self._handles.append(self.blocks[twin].register_forward_hook(functools.partial(self._ran, twin)))
        for index in sorted(self.skip):
            block = self.blocks[index]
            self._patches.patch(block, functools.partial(self._forward, index, block.forward))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._patches.restore()
        self._outputs.clear()

    def _ran(self, index: int, _module: nn.Module, _args: Any, output: Any) -> None:
        self._outputs[index] = output

    def _forward(self, index: int, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        template = self._outputs.get(self.skip[index])
        first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        out = next((t for t in tree_leaves(template) if isinstance(t, torch.Tensor)), None)
        if first is None or out is None or _kind(out) != _kind(first):
            return original(*args, **kwargs)
        self.done.append(index)
        replaced = False

        def passed(t: torch.Tensor) -> torch.Tensor:
            nonlocal replaced
            if replaced:
                return t
            replaced = True
            return first

        return tree_map_only(torch.Tensor, passed, template)


def _kind(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.device


def skipped_forwards(blocks: Sequence[nn.Module], cut: int, twins: Mapping[int, Sequence[int]]) -> dict[int, int]:
    """Rule 16: the blocks before the cut whose forward the streamed pass skips, each with the
    twin that stands for it: the first block of its class, which runs."""
    first: dict[tuple[Any, ...], int] = {}
    skip: dict[int, int] = {}
    for index in range(cut):
        cls = _twin_class(blocks[index])
        if cls not in first:
            first[cls] = index
        elif twins.get(index):
            skip[index] = first[cls]
    return skip


def _with_skipped(
    order: list[int],
    first_block: dict[int, int],
    params: Sequence[nn.Parameter],
    blocks: Sequence[nn.Module],
    skipped: Sequence[int],
    skip: Mapping[int, int],
) -> None:
    """Rule 16: the parameters of the skipped blocks into ``order`` and ``first_block``, as their
    forward would have put them there: each block's in the order its twin's ran, after
    everything used before it and before anything used after it."""
    index = {id(p): i for i, p in enumerate(params)}
    seen = set(order)
    for block in sorted(skipped):
        names = {index[id(p)]: name for name, p in blocks[skip[block]].named_parameters()}
        own = {name: index[id(p)] for name, p in blocks[block].named_parameters()}
        ran = [own[names[i]] for i in order if i in names and names[i] in own]
        new = [i for i in ran if i not in seen]
        at = next((k for k, i in enumerate(order) if first_block.get(i, -1) > block), len(order))
        order[at:at] = new
        for i in new:
            first_block[i] = block
            seen.add(i)


def _cut(t: torch.Tensor) -> torch.Tensor:
    """Rule 15: a block output backward stops at."""
    return t.detach().requires_grad_().clone() if t.requires_grad else t


def _twin_class(block: nn.Module) -> tuple[Any, ...]:
    """Rule 15: what makes two blocks twins."""
    params = tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters())
    return (type(block), params)


def backward_cut(blocks: Sequence[nn.Module]) -> tuple[int, dict[int, list[int]]]:
    """Rule 15: the first block measured through backward (0: all are), and for each block
    before it the twins measured in its stead."""
    if len({id(b) for b in blocks}) < len(blocks):
        return 0, {}  # one module listed twice: calls, not blocks, would be cut
    classes = [_twin_class(b) for b in blocks]
    measured: dict[tuple[Any, ...], list[int]] = {}
    for index in reversed(range(len(blocks))):
        chosen = measured.setdefault(classes[index], [])
        if len(chosen) < MEASURED_TWINS:
            chosen.append(index)
    cut = min((min(chosen) for chosen in measured.values()), default=0)
    return cut, {i: sorted(measured[classes[i]]) for i in range(cut)}


def _blocks_and_order(model: nn.Module, blocks: BlockSpec) -> tuple[list[tuple[str, nn.Module]], list[nn.Parameter]]:
    try:
        found = find_blocks(model, blocks)
    except ValueError as exc:
        raise ProfileError(f"tiermem planner: {exc}") from exc
    return found, list(model.parameters())


def _record_order(
    model: nn.Module, params: Sequence[nn.Parameter], where: Callable[[], int]
) -> tuple[list[Any], list[int], set[int], dict[int, int]]:
    """Hooks recording the parameters' execution order as the manager will (NOTE [ Model-state
    rules ] rule 2): each module's own parameters as its forward pre-hook runs; and ``where()``
    (the running block) each was first used in (NOTE [ Profile fields ] rule 4)."""
    index = {id(p): i for i, p in enumerate(params)}
    order: list[int] = []
    seen: set[int] = set()
    blocks: dict[int, int] = {}

    def pre(module: nn.Module, _args: Any) -> None:
        for p in module._parameters.values():
            if p is not None and index[id(p)] not in seen:
                seen.add(index[id(p)])
                order.append(index[id(p)])
                blocks[index[id(p)]] = where()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules() if any(True for _ in m._parameters)]
    return handles, order, seen, blocks


def _param_modules(model: nn.Module, params: Sequence[nn.Parameter]) -> tuple[list[tuple[int, ...]], list[int]]:
    """Each module's own parameters (indices into ``params``), and the parameters more than
    one module owns (tied)."""
    index = {id(p): i for i, p in enumerate(params)}
    owners: dict[int, int] = {}
    modules: list[tuple[int, ...]] = []
    for module in model.modules():
        own = tuple(index[id(p)] for p in module._parameters.values() if p is not None)
        if own:
            modules.append(own)
            for i in own:
                owners[i] = owners.get(i, 0) + 1
    return modules, sorted(i for i, n in owners.items() if n > 1)


def _bytes_pass(
    model: nn.Module,
    sample: Sample,
    params: Sequence[nn.Parameter],
    hooks: _BlockHooks,
    live: _LiveBytes,
    recomputed: _Recomputed | None = None,
    skipped: _Skipped | None = None,
) -> tuple[list[int], dict[int, int], int, float, float]:
    """Pass 1 (rule 3): bytes, the execution order, warm-up; its times, which rule 9 keeps.
    (order, first block each parameter was used in, the head's transient peak, forward seconds,
    backward seconds less the recomputation)."""

    def where() -> int:
        if hooks.running is not None:
            return hooks.running
        ended = [i for i, (_, end) in enumerate(hooks.marks.forward) if end]
        return max(ended) + 1 if ended else -1  # between blocks: backward reaches it after the next

    handles, order, seen, first_block = _record_order(model, params, where)
    try:
        with (
            hooks,
            recomputed or contextlib.nullcontext(),
            skipped or contextlib.nullcontext(),
            live,
            torch.autograd.graph.saved_tensors_hooks(hooks.pack, lambda t: t),
        ):
            live.mark()
            start = hooks.clock()
            outputs = _loss(model, sample)
            middle = hooks.clock()
            # Peak since the last block ended (the head and loss) above what remains.
            head_transient = live.peak - live.live
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            end = hooks.clock()
            del outputs
    finally:
        for handle in handles:
            handle.remove()
    if skipped is not None:
        _with_skipped(order, first_block, params, hooks.blocks, skipped.done, skipped.skip)
        seen.update(order)
    order += [i for i in range(len(params)) if i not in seen]
    recompute_s = sum(recomputed.recompute_s) if recomputed is not None else 0.0
    return order, first_block, head_transient, middle - start, max(end - middle - recompute_s, 0.0)


def _timing_passes(
    model: nn.Module,
    sample: Sample,
    params: Sequence[nn.Parameter],
    blocks: Sequence[nn.Module],
    protected: set[int],
    min_bytes: int,
    cut: int = 0,
    twins: Mapping[int, Sequence[int]] | None = None,
    *,
    device: torch.device,
) -> tuple[float, float, _Marks, bool]:
    """Rule 3: at least two timed passes, more while they are short; the median one's
    (forward seconds, backward seconds, block marks, whether its backward stopped at ``cut``:
    rule 15). Rule 16: each skips the forward of the blocks before the cut that ``twins`` stand
    for, but the first of each class."""
    timings = []
    spent = 0.0
    skip = skipped_forwards(blocks, cut, twins or {})
    while len(timings) < MIN_TIMING_PASSES or (spent < TIMING_BUDGET_S and len(timings) < MAX_TIMING_PASSES):
        with _BlockHooks(blocks, protected, min_bytes, None, device) as timer, _Skipped(blocks, skip) as skipped:
            timer.cut = cut
            forward_s, backward_s = _run(model, sample, device)
        for p in params:
            p.grad = None
        if skipped.done and not timer.cut_made:  # rule 16 stands in for blocks the cut leaves out
            skip = {}
            continue  # this pass again, every block run
        forward_s += _stand_in(timer.marks, skipped.done, twins or {})
        timings.append((forward_s + backward_s, forward_s, backward_s, timer.marks, timer.cut_made))
        spent += forward_s + backward_s
    # The median pass (the lower middle of an even count), not the fastest: the cost model
    # predicts the median step a run measures (rule 3).
    _, forward_s, backward_s, times, cut_made = sorted(timings, key=lambda t: t[0])[(len(timings) - 1) // 2]
    return forward_s, backward_s, times, cut_made


def _block_stats(
    found: Sequence[tuple[str, nn.Module]],
    times: _Marks,
    hooks: _BlockHooks,
    forward_s: float,
    backward_s: float,
    head_transient: int,
    recompute_s: Sequence[float] = (),
    twins: Mapping[int, Sequence[int]] | None = None,
) -> tuple[list[BlockStats], BlockStats]:
    """Rules 3 and 4: per block, its times (from the timed pass ``times``) and bytes (from the
    bytes pass ``hooks``); then the part outside blocks, what the pass took beyond them. Rule 9:
    ``recompute_s``, each block's recomputation, is not its backward's. Rule 15: ``twins``, the
    blocks before the cut, each with the measured blocks its backward is estimated from where
    the pass's backward did not reach it."""
    marks = hooks.marks
    peaks = hooks.peaks
    forward: list[float] = []
    backward: dict[int, float] = {}  # measured
    backward_peak: dict[int, int] = {}  # measured: backward's peak above the block's saved bytes
    for i in range(len(found)):
        start, end = times.forward[i]
        forward.append(max(end - start, 0.0))
        b_start = times.backward_start.get(i)
        b_end = times.backward_end.get(i)
        if b_end is None and b_start is not None:  # rule 4: input needed no gradient
            b_end = times.backward_start.get(i - 1) if i > 0 else None
        if b_start is not None and b_end is not None:
            again = recompute_s[i] if i < len(recompute_s) else 0.0
            backward[i] = max(b_end - b_start - again, 0.0)
        if ("backward", i) in peaks:
            backward_peak[i] = peaks[("backward", i)] - marks.saved[i]
    stats = []
    block_fwd = block_bwd = 0.0
    for i, (name, _) in enumerate(found):
        f = forward[i]
        estimated_from = [j for j in (twins or {}).get(i, ()) if j in backward]
        if i in backward:
            b = backward[i]
            block_bwd += b  # the part of the pass's backward outside blocks is what is left
            peak = backward_peak.get(i, 0)
        elif estimated_from:  # cut off before backward reached it: its twins' ratio (rule 15)
            twin_f = sum(forward[j] for j in estimated_from)
            b = f * sum(backward[j] for j in estimated_from) / twin_f if twin_f > 0 else 2 * f
            # its own where the bytes pass ran its backward (on plain parameters), else its twins'
            peak = backward_peak.get(i, max(backward_peak.get(j, 0) for j in estimated_from))
        else:
            b = 2 * f
            block_bwd += b
            peak = backward_peak.get(i, 0)
        block_fwd += f
        transient = max(peaks.get(("forward", i), 0), peak)
        stats.append(
            BlockStats(
                name, f, b, marks.saved[i], marks.small[i], marks.inputs[i], max(transient, 0), marks.saved_count[i]
            )
        )
    outside = BlockStats(
        "outside",
        max(forward_s - block_fwd, 0.0),
        max(backward_s - block_bwd, 0.0),
        marks.outside_saved,
        marks.outside_small,
        0,
        max(head_transient, 0),
        marks.outside_saved_count,
    )
    return stats, outside


def _stand_in(marks: _Marks, skipped: Sequence[int], twins: Mapping[int, Sequence[int]]) -> float:
    """Rule 16: each skipped block's forward time as the mean of its measured twins' in the same
    pass; the seconds this adds to the pass's forward."""
    added = 0.0
    for block in skipped:
        measured = [j for j in twins[block] if marks.forward[j][1] > 0]
        if not measured:
            continue
        seconds = sum(marks.forward[j][1] - marks.forward[j][0] for j in measured) / len(measured)
        start, end = marks.forward[block]
        added += max(seconds - (end - start), 0.0)
        marks.forward[block] = (start, start + seconds)
    return added


def _stand_in_bytes(hooks: _BlockHooks, skipped: Sequence[int], twins: Mapping[int, Sequence[int]]) -> None:
    """Rule 16: each skipped block's saved bytes and forward transient peak as its first measured
    twin's (its input bytes are its own, seen as it was called)."""
    marks = hooks.marks
    for block in skipped:
        twin = twins[block][0]
        marks.saved[block] = marks.saved[twin]
        marks.saved_count[block] = marks.saved_count[twin]
        marks.small[block] = marks.small[twin]
        if ("forward", twin) in hooks.peaks:
            hooks.peaks[("forward", block)] = hooks.peaks[("forward", twin)]


def measure(
    model: nn.Module,
    sample: Sample,
    *,
    sections: Callable[[int], int],
    min_bytes: int,
    device: torch.device,
    blocks: BlockSpec = None,
) -> tuple[list[BlockStats], BlockStats, list[ParamStats], list[int], list[tuple[int, ...]], list[int], list[int]]:
    """Rules 1-4: blocks, the part outside them, parameters, execution order, modules, shared."""
    found, params = _blocks_and_order(model, blocks)
    modules_list = [m for _, m in found]
    protected = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    modules, shared = _param_modules(model, params)
    with unchanged_training_state(model, device):
        live = _LiveBytes(device)
        hooks = _BlockHooks(modules_list, protected, min_bytes, live, device)
        # backward stops before the blocks whose twins it measures (rule 15)
        cut, twins = backward_cut(modules_list)
        if (info := streamed()) is not None:  # rules 9-16: one pass, its blocks recomputed where they fit
            skip = skipped_forwards(modules_list, cut, twins)
            while True:
                recomputed = _Recomputed(modules_list, hooks) if info.recompute else None
                skipped = _Skipped(modules_list, skip)
                hooks.cut = cut
                order, first_block, head_transient, forward_s, backward_s = _bytes_pass(
                    model, sample, params, hooks, live, recomputed, skipped
                )
                if hooks.cut_made or not skipped.done:
                    break
                # rule 16 stands in for blocks the cut leaves out: without the cut, measured again whole
                live = _LiveBytes(device)
                hooks = _BlockHooks(modules_list, protected, min_bytes, live, device)
                skip = {}
            cut_made = hooks.cut_made
            times, recompute_s = hooks.marks, recomputed.recompute_s if recomputed is not None else []
            forward_s += _stand_in(hooks.marks, skipped.done, twins)
            _stand_in_bytes(hooks, skipped.done, twins)
        else:
            order, first_block, head_transient, _, _ = _bytes_pass(model, sample, params, hooks, live)
            for p in params:
                p.grad = None
            forward_s, backward_s, times, cut_made = _timing_passes(
                model, sample, params, modules_list, protected, min_bytes, cut, twins, device=device
            )
            recompute_s = []
        if not cut_made:  # nothing was estimated: every block's backward ran
            twins = {}
    stats, outside = _block_stats(found, times, hooks, forward_s, backward_s, head_transient, recompute_s, twins)
    param_stats = [ParamStats(p.numel() * p.element_size(), p.requires_grad, sections(i)) for i, p in enumerate(params)]
    param_block = [first_block.get(i, -1) for i in range(len(params))]
    return stats, outside, param_stats, order, modules, shared, param_block
