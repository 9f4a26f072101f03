"""Freed host memory goes back to the system (glibc only; TRAPS 8).

# NOTE [ Returning freed memory ]
1. Why: glibc raises its mmap threshold each time a large block (up to 32 MiB) is freed, so
   later large allocations (staging buffers, gradient copies, activations) come from the heap
   and stay in the process after they are freed: a process that moved a few GiB through host
   buffers keeps them resident, and the host capacity the user set is broken in RSS, the
   meter users read. Measured: a GPT of 840 MB streamed through 400 MB of device and host
   capacity held 960 MB of anonymous memory after three steps; with the threshold fixed at 4 MiB,
   380 MB. Rules 4 and 5 now return what the heap frees, so the threshold is set for speed
   (rule 2); that GPT was not measured again at 32 MiB.
2. What: when the first runtime starts, ``mallopt`` fixes the mmap threshold at
   :data:`MMAP_THRESHOLD` (blocks from that size are mapped, and unmapped when freed) and the trim
   threshold at :data:`TRIM_THRESHOLD`: where glibc's dynamic thresholds end up once a 32 MiB block
   was freed, from the first step on instead. Smaller allocations keep glibc's heap, which reuses a
   freed block where its layout lets it (not always: with few small blocks free, torch's
   page-aligned requests of 16 MiB, ``THP_MEM_ALLOC_ENABLE`` in ``tiermem/__init__.py``, each
   missed the one freed last and took fresh pages above it: glibc 2.36's ``memalign`` asks its
   heap for the size plus the alignment, which that block is short of, ``tests/test_malloc.py``);
   rules 4 and 5 hand its free pages back. A mapped block's pages are faulted in and zeroed
   afresh each time it is allocated (TRAPS 22), which is why the
   threshold is not lower: at 4 MiB, each weight's gradient and each MLP activation of a 210M
   Hugging Face GPT-2 (12-16 MiB and 8 MiB, fresh every step) was a new mapping, and a step faulted
   in 1.2-1.6 GiB (plain PyTorch 0.07-0.19 GiB; this rule's faults are counted as small pages,
   TRAPS 22). ``bench/hf_states.py --size 210M`` in fresh processes, 4 MiB then 32 MiB each round
   (2-vCPU EPYC, quiet): declared loop 7.74, 7.98, 8.21 s against 7.71, 7.72, 7.67 s a step,
   0.32-0.38 GiB faulted in, ru_maxrss 1,421 against 1,433 MiB; plain loop 9.81, 9.05 s against
   8.87, 8.18 s (1.25 CPU s a step less), ru_maxrss 1,423 against 1,504-1,545 MiB (0.32-0.33x plain
   PyTorch's). The code before and after, rule 5's offloader trims included, in fresh processes,
   three rounds: plain loop 10.17, 10.49, 9.56 against 10.29, 9.87, 9.13 s, declared 7.78, 8.06,
   7.63 against 8.73, 7.46, 7.58 (about 3% off each median; faulted in 1.2-1.6 GiB against
   0.37-0.56 GiB a step; ru_maxrss +5-8% in the plain loop). The 4 MiB of rule 1's measurement
   predates rule 5's trims.
3. The user decides first: when ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` is in
   the environment (glibc read it at start), or ``TIERMEM_KEEP_MALLOC=1``, nothing changes. On
   another C library nothing changes either.
4. After a step that allocated far more than training does (the first step's profiling and
   re-pack), :func:`trim` hands the heap's free pages back (``malloc_trim(0)``): blocks below
   the mmap threshold (a 200M GPT's 2 MiB activations) freed in the middle of the heap stay
   resident otherwise, since only its top is trimmed. Measured on the 200M LoRA of
   ``bench/lora.py``: 907 MiB resident after the profiling step, 440 MiB after the trim before
   the re-pack; the steps after held 575-633 MiB, against 795-827 MiB without it (the same
   steps with the plan made at ``rt.manage``: 492-554 MiB). The profiling step's own peak
   stays. It changes no setting, so it runs whatever the environment says, but
   ``TIERMEM_KEEP_MALLOC=1`` turns it off.
5. The heap is also trimmed while chunks stream, between a step's phases: the chunk pool counts
   the bytes it fetches, and once :data:`TRIM_EVERY_STREAMED` were counted since the last trim
   made anywhere in the process, the next phase to begin trims first (:class:`StreamingTrim`:
   the managed model's forward, its backward, its optimizer step). The activation offloader
   counts the saved bytes its blocks offloaded and trims the same way at each forward's end.
   Why: blocks below the mmap threshold that a step frees in the middle of the heap (a block's
   2 MiB activations once written out or recomputed, gradients and their temporaries) otherwise
   stay resident until the heap reuses them, so the process holds the heap's high-water mark
   beside whatever the tiers hold later in the step, and the mark creeps up from step to step.
   Why not within a phase: what a trim hands back, the rest of the phase takes again, and each
   page taken is faulted in and zeroed (TRAPS 22: with transparent huge pages a 2 MiB page a
   fault). Trimmed at every 64 MiB fetched (about once a transformer block, forward and
   backward), a 210M Hugging Face GPT-2 step (``bench/hf_states.py --size 210M``, device and
   host 10%) faulted in 2.1-2.4 GiB of fresh pages and ``clear_page_erms`` took 17-22% of its
   CPU samples; trimmed only between phases, 0.5-0.8 GiB (plain PyTorch 0.3-0.4). Fresh processes,
   alternated, 2 rounds (2-vCPU VM): plain loop 7.58 and 6.86 s a step against 9.04 and 9.38
   (CPU 11.0-11.9 against 13.9-14.3 s), declared 8.52 and 6.60 against 9.40 and 7.57; ru_maxrss
   1,675-1,686 against 1,536-1,542 MiB (plain loop) and 1,841-1,942 against 1,433-1,442
   (declared): 0.36x and 0.39-0.41x plain PyTorch's 4,713 MiB, where the goal is 0.45x.
   Without any streaming trim the plain loop held 2,051 MiB (0.44x) for about the same steps.
   Why trims at all: on the 200M LoRA of ``bench/lora.py`` (a 4 MiB mmap threshold, as the bench
   sets it) the bench's ru_maxrss went from 727 and 802 MiB without them to 588-598 MiB with
   them (0.41-0.45x plain PyTorch's to 0.33-0.34x). Measured before: trimmed at each block's
   end, the offloader trimmed 15 times a 210M GPT-2 step and faulted in more; trimmed at each
   chunk fetched, 148 trims took 0.35-0.75 s of a 26 s step (a trim walks the heap's free
   blocks: 0.15 ms with little to give back, 16 ms for 200 MiB of holes). The same switches as
   rule 4 apply.
   What the trims cost where it matters most: on a VM whose balloon reports free pages to the
   hypervisor (TRAPS 22, ``bench/fresh_pages.py``), a huge page faulted in over memory freed a
   few seconds before costs 2.5-7 ms a MiB against 0.17. There the 210M GPT-2 above held
   490-880 MiB of freed heap between phases and took all of it again each step, and its steps
   spent 1-6.6 s of system time each, mostly ``clear_page_erms``. Tried, not kept: trimming at a
   boundary only past 1 GiB of freed resident heap beyond the last trim (anonymous RSS less
   ``mallinfo2``'s bytes in use). Alternated against this rule (``bench/hf_states.py --worker
   --warmup 2 --steps 4``, 2 rounds, 2-vCPU Intel VM): plain loop 7.16 / 9.13 s against 6.09 /
   8.29 s, declared 7.48 / 4.99 s against 5.77 / 4.80 s; but ru_maxrss rose from 1,705-1,764 to
   1,806-2,099 MiB, and the whole bench (``--rounds 3 --steps 3``) held 2,006-2,199 MiB =
   0.42-0.47x plain PyTorch's 4,726: over its 0.45x goal in 2 of 6 processes and within 3 MiB of
   it in 2 more, where this rule holds 0.37-0.40x. A 512 MiB slack still trimmed every step. What
   would cut the faults without the RSS: a step that frees less of what the next one takes again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from typing import Any

log = logging.getLogger("tiermem")

MMAP_THRESHOLD = 32 << 20
"""Rule 2: blocks of 32 MiB and more are mapped on their own (glibc's cap for its dynamic
threshold). Lower costs speed: every mapped block is faulted in afresh (a Hugging Face GPT-2 step,
8 x 512, batch 4 x 256, took 3.46-3.67 s at 1 MiB against 2.85-3.09 s with glibc's default and
2.93 s at 4 MiB; the 210M one of rule 2, 3-10% more at 4 MiB than here). Without rule 5's trims
lower held less (a 840 MB GPT streamed through 400 MB of capacities: 380 MB anonymous after three
steps at 4 MiB, 354 MB at 1 MiB, 772 MB at 16 MiB, 960 MB with glibc's default)."""
TRIM_THRESHOLD = 64 << 20
"""Rule 2: free heap above this at the top of the heap is returned (twice the mmap threshold,
as glibc's dynamic one sets it)."""

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_done: bool | None = None


def return_freed_memory() -> bool:
    """Rule 2, once per process; True when glibc now returns freed large blocks."""
    global _done
    if _done is None:
        _done = _configure()
    return _done


def _configure() -> bool:
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False  # rule 3: the user's own settings
    if os.environ.get("TIERMEM_KEEP_MALLOC") == "1" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("tiermem: glibc refused mallopt; freed host buffers may stay in the process (TRAPS 8)")
    return ok


_trims_done = 0  # every trim in the process, for rule 5's counters to see each other's


def trim() -> bool:
    """Rule 4: give the heap's free pages back to the system; True when glibc released some."""
    global _trims_done
    if os.environ.get("TIERMEM_KEEP_MALLOC") == "1":
        return False
    _trims_done += 1
    malloc_trim = _malloc_trim()
    return malloc_trim is not None and bool(malloc_trim(0))


TRIM_EVERY_STREAMED = 64 << 20
"""Rule 5: chunk bytes fetched between two trims (a 200M GPT block's weights are 48 MiB)."""


class StreamingTrim:
    """Rule 5: counts the bytes a chunk pool fetches, or an activation offloader sends out, and
    trims the heap at the next boundary between a step's phases once :data:`TRIM_EVERY_STREAMED`
    of them were counted since the last trim made anywhere in the process (a trim returns what
    every user of the heap freed)."""

    def __init__(self, every: int = TRIM_EVERY_STREAMED) -> None:
        self.every = every
        self._since = 0
        self._seen = _trims_done
        #: trims done (read by tests and traces)
        self.trims = 0
        #: trim as soon as the interval is full, not at the next phase: while the first step's
        #: profiling streams the model (paid once a run; its peak is the process's otherwise)
        self.eager = False

    def streamed(self, nbytes: int) -> None:
        """``nbytes`` of a chunk were fetched, or a block's saved activations went out."""
        self._restart_if_trimmed()
        self._since += nbytes
        if self.eager:
            self.boundary()

    def boundary(self) -> None:
        """A phase of the step begins (a forward, a backward, the optimizer step): trim first when
        the interval is full, so what the phase allocates can take the pages given back."""
        self._restart_if_trimmed()
        if self._since >= self.every:
            self._since = 0
            self.trims += 1
            trim()
            self._seen = _trims_done

    def _restart_if_trimmed(self) -> None:
        if self._seen != _trims_done:  # trimmed elsewhere since: count from there
            self._seen, self._since = _trims_done, 0


_trim_function: Any = None  # glibc's malloc_trim once looked up; False where there is none


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``: far more than a
    trim costs, and rule 5 trims many times a step); None on another C library."""
    global _trim_function
    if _trim_function is None:
        _trim_function = False
        if platform.libc_ver()[0] == "glibc":
            try:
                function = ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
            except (OSError, AttributeError):
                function = None
            if function is not None:
                function.argtypes = (ctypes.c_size_t,)
                function.restype = ctypes.c_int
                _trim_function = function
    return _trim_function or None
