"""Where chunk steps compute: inline on the training thread, or on one step thread that overlaps
backward and the state I/O.

# NOTE [ Step threads ]
1. A chunk step is split (``chunk_step.py``): staging its home, waiting for its gradients,
   gathering views and cleaning settings run on the training thread (the thread that runs
   forward and backward and makes every registry call: NOTE [ Model-state rules ] rule 7);
   only :meth:`ChunkStep.compute` may run on the step thread. It reads and writes tensors already
   in memory (the staged home, the gradient bytes) and nothing else: no registry handle, no chunk
   record, no ``p.grad`` of a managed parameter.
2. At most one step is in flight. The next chunk's step finishes the one in flight before it
   stages its own home, so one home at most is held by a compute while the next is prefetched,
   within the plan's host room (``staged_homes``), and an error of the compute surfaces before
   anything else is staged. In backward, an early step that would have to wait for the one in
   flight is queued instead (NOTE [ Declared steps ] rule 9 in ``stepping.py``). Steps over
   device tensors (a CUDA device's own chunks) run inline: their kernels go to the training
   thread's current stream, as plain PyTorch's do.
3. Finishing a step runs on the training thread: it waits for the compute, records the optimizer
   state, writes the home back and frees what the step was lent (gradients given up under
   ``keep_gradients=False``). An error of the compute is raised there, after the home was sent
   back as it is.
4. A step finishes before anything reads or moves the chunk's bytes again: ``Homes`` and
   ``Gradients`` call the fence (:meth:`StepThread.wait_for`) before they stage, read or write a
   home, or move, bring back or free a gradient buffer; the end of every backward and every
   ``optimizer.step()`` finish all steps, so the next forward's fetches, state dicts, checkpoints
   and re-packs see stepped chunks. Hooks poll between (a finished step's write-back starts at
   the next chunk's backward).
5. Exactness: the step thread runs torch's step with as many intra-op threads as the training
   thread had when the step was handed over (``torch.set_num_threads`` on the step thread when
   they differ), so kernels split their work as plain PyTorch does. Element-wise steps (Adam,
   AdamW, SGD, single-tensor, ``foreach`` and ``fused``) give bitwise the same values on any
   thread; the tests compare each flag with plain PyTorch, with and without the step thread.
6. Policy: ``[model_states] step_thread`` (``TIERMEM_MODEL_STATES_STEP_THREAD``) = ``on``, ``off``
   or ``auto`` (the default). ``auto`` runs the step thread when the process may use at least
   :data:`AUTO_MIN_CORES` cores and the step has a core to itself: the model computes on an
   accelerator (the training thread only launches kernels), or the process may use more cores
   than the training thread's intra-op threads (:func:`spare_core`, asked at each step, since
   ``torch.set_num_threads`` may change between steps). Where the model computes on every core,
   a step on another thread does not overlap anything: it takes cores from the compute's OpenMP
   team, whose other threads then wait for the preempted one at every barrier. Measured on the
   210M Hugging Face GPT-2 of ``bench/hf_states.py`` (2-vCPU EPYC, torch's 2 threads, ``--worker``
   processes alternated, ``on`` against ``off``): declared loop 7.28 / 7.70 / 7.23 / 6.37 / 6.36 /
   6.31 s a step against 6.73 / 6.31 / 6.94 / 6.23 / 6.18 / 6.06 (6 of 6 pairs faster inline),
   0.3-2.2 CPU s a step less (the step thread's AdamW took 0.35-0.44 CPU s, the same steps inline
   about 0.1 more of the training thread's team), ru_maxrss 1,464-1,496 MiB against 1,671-1,925;
   plain loop 6.68 / 6.47 / 6.25 / 6.88 / 6.51 / 6.51 against 7.79 / 6.31 / 6.41 / 6.86 / 5.98 /
   6.05 (4 of 6). ``bench/optimizer_step.py --rounds 6`` (8.4M parameters, declared, the same
   VM): NVMe homes 0.285 s on against 0.291 off, host homes 0.204 against 0.196, within the
   noise. Also under ``auto``, steps whose groups are all ``fused=True`` over homes already in
   memory (host-homed chunks) run inline: torch's fused kernel is so short that handing it over
   costs more than it overlaps (an earlier run of ``bench/optimizer_step.py``: fused over host
   homes 0.161 s a step inline against 0.179 s on the thread).
7. A staged NVMe home's write-back is submitted as its step is handed over, to start when the
   compute ends (``Handle.move_to(..., after=)``: NOTE [ Managed object rules ] rule 11 in
   ``registry.py``), not when rule 3's finish runs: hooks poll only between modules, and where
   one module's backward takes longer than a step (the 2.5x-RAM headline GPT: a 133 MiB chunk
   a module, 200-300 ms of backward each, a 25-35 ms step) the home held the host room the
   next home's read needed for the rest of that backward. The call is still the training
   thread's (rule 1); finishing finds the write on its way, or landed. So the compute drops its
   views into the home as it ends (``ChunkStep.compute``): a block some tensor still views when
   its write-back lands is let go, not kept for the next home (NOTE [ Spare tier blocks ] rule 3),
   and holding them to the finish made every home's block afresh (210M HF GPT-2 declared: 1.7-1.9
   GiB of pages faulted in a step against 0.44-0.50; the 2.5x-RAM headline GPT's declared step
   42.9 s against 37.5-38.1 s).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import Any

import torch

from tiermem import tracing

__all__ = ["AUTO_MIN_CORES", "ENV_VAR", "StepThread", "spare_core", "step_thread_setting", "step_thread_wanted"]

ENV_VAR = "TIERMEM_MODEL_STATES_STEP_THREAD"
SETTINGS = ("auto", "on", "off")
#: rule 6: cores from which ``auto`` runs chunk steps on the step thread
AUTO_MIN_CORES = 2


def usable_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def spare_core(cores: int | None = None, threads: int | None = None) -> bool:
    """Rule 6: whether the process may use more cores than the training thread's intra-op threads
    (``cores`` defaults to :func:`usable_cores`, ``threads`` to ``torch.get_num_threads()``)."""
    return (usable_cores() if cores is None else cores) > (torch.get_num_threads() if threads is None else threads)


def step_thread_setting(setting: str | None = None) -> str:
    """Rule 6: ``setting`` checked, or the environment's (``auto`` when unset)."""
    value = (os.environ.get(ENV_VAR, "") if setting is None else setting).strip().lower() or "auto"
    if value not in SETTINGS:
        raise ValueError(
            f"tiermem model states: {ENV_VAR}={value!r} is not a step-thread setting; use one of "
            f"{', '.join(SETTINGS)} (NOTE [ Step threads ] rule 6)"
        )
    return value


def step_thread_wanted(setting: str | None = None, cores: int | None = None) -> bool:
    """Rule 6: whether chunk steps run on the step thread; ``setting`` defaults to the environment."""
    value = step_thread_setting(setting)
    if value == "auto":
        return (usable_cores() if cores is None else cores) >= AUTO_MIN_CORES
    return value == "on"


def _compute_with(compute: Callable[[], None], threads: int) -> None:
    """Rule 5, on the step thread."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    compute()


class StepThread:
    """Chunk steps in flight: at most one (rule 2), computed on the step thread or inline."""

    @classmethod
    def configured(cls, setting: str | None = None, *, compute_on_cpu: bool = True) -> StepThread:
        """Rule 6: from ``[model_states] step_thread`` (None: the environment's, ``auto`` when unset);
        ``compute_on_cpu``: the model computes on the CPU, so ``auto`` wants a spare core."""
        value = step_thread_setting(setting)
        auto = value == "auto"
        return cls(step_thread_wanted(value), fused_inline=auto, spare_core_only=auto and compute_on_cpu)

    def __init__(self, threaded: bool, fused_inline: bool = False, spare_core_only: bool = False) -> None:
        self.threaded = threaded
        #: rule 6 (``auto``): fused steps over homes in memory run inline
        self.fused_inline = fused_inline
        #: rule 6 (``auto``, the model on the CPU): steps go to the step thread only beside a spare core
        self.spare_core_only = spare_core_only
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        #: the step in flight: its chunk index, the compute's future and the training-thread finish
        self._in_flight: tuple[int, concurrent.futures.Future[None], Callable[[bool], None]] | None = None

    @property
    def busy(self) -> bool:
        return self._in_flight is not None

    def run(
        self, chunk: int, compute: Callable[[], None], finish: Callable[[bool], None], *, inline: bool = False
    ) -> concurrent.futures.Future[None] | None:
        """Step ``chunk``: ``compute`` (rule 1), then ``finish(ok)`` on the training thread (rule 3),
        now when inline (or told so: rule 2), else when the step is waited for or polled. The
        compute's future when it runs on the step thread (done when the compute ends, before
        ``finish``: rule 7); None when it ran inline."""
        self.finish_all()
        if inline or not self.threaded or (self.spare_core_only and not spare_core()):
            ok = False
            try:
                compute()
                ok = True
            finally:
                finish(ok)
            return None
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tiermem-step")
        future = self._executor.submit(_compute_with, compute, torch.get_num_threads())
        self._in_flight = (chunk, future, finish)
        return future

    def wait_for(self, chunk: int) -> None:
        """Rule 4: ``chunk``'s step, if in flight, is finished when this returns."""
        if self._in_flight is not None and self._in_flight[0] == chunk:
            self.finish_all()

    def poll(self) -> None:
        """Finish the step in flight if its compute is done (rule 4)."""
        if self._in_flight is not None and self._in_flight[1].done():
            self.finish_all()

    def finish_all(self) -> None:
        """Wait for the step in flight and finish it (rule 3); its compute's error is raised here."""
        entry, self._in_flight = self._in_flight, None
        if entry is None:
            return
        chunk, future, finish = entry
        traced = None if future.done() else tracing.span("wait chunk step", "wait", chunk)  # NOTE [ Timeline trace ]
        try:
            future.result()
        except BaseException:
            finish(False)  # the home goes back as it is; the compute's error follows
            raise
        finally:
            if traced is not None:
                traced.end()
        finish(True)

    def close(self) -> None:
        """Finish what is in flight and stop the step thread (a later step starts a new one)."""
        try:
            self.finish_all()
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)

    def __del__(self) -> None:
        executor: Any = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
