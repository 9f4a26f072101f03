"""Activation policy: what happens to each block's saved tensors. Pure: no hooks, no I/O.

# NOTE [ Adaptive keep ]
TBA keeps the last blocks resident when their offload cannot be hidden. Block ``i``'s
saved bytes are written while forward continues; backward needs them back after the
later blocks' backward. With measured per-block forward times ``f``, saved bytes ``b``,
write and read bandwidths, and backward taken as twice forward:

1. Writes queue behind each other: block ``i``'s write ends at
   ``W_i = max(W_{i-1}, F_i) + b_i / write_bw`` where ``F_i`` is the end of its forward.
2. Backward reaches block ``i`` at ``R_i = F_N + 2 * sum_{j>i} f_j``; its read must fit
   before that: the offload is hidden when ``W_i + b_i / read_bw <= R_i``.
3. Keep every block from the first (counting back from the end) whose offload is not
   hidden; offload the rest. The last block is always kept: backward starts with it.
4. The forward times are the compute's. On CUDA kernels run after the host queues them, so the
   host's clock reads a block's queueing, which made every offload look unhidden (the planner's
   profile read 21 ms of compute in a 93 ms step on an H200, NOTE [ Profiling step ] rule 17):
   each block's time comes from CUDA events recorded on the device's current stream as it starts
   and ends, read once the forward ended (one wait for the GPU a forward, under ``auto`` only).
   The link bandwidths it weighs them against are the scheduler's busy time, which on CUDA starts
   before a write's wait for the kernel that makes its bytes: they err slow there.

# NOTE [ Prefetch window ]
Backward brings offloaded tensors back ahead of need, but every byte fetched early is
device memory held early: whole blocks fetched ahead put a block or two on top of the
gradients that accumulate through backward, the very moment (the first block's backward)
where recompute peaks too (TRAPS 23). So prefetch is bounded by bytes, not blocks:

1. At each unpack the offloader prefetches, in the order backward needs them (the rest of
   the block, then earlier blocks, at most ``lookahead`` blocks back), until the bytes
   prefetched and not unpacked yet reach the window.
2. The window starts at a quarter of the largest measured block (``PREFETCH_START``), which
   keeps the tensors next in line a few operators ahead; a stream of reads that is fast
   against backward (the CPU device, where backward consumes a few hundred MB/s) waits for
   none.
3. After each backward, the window doubles if backward waited for reads more than
   ``WAIT_TOLERANCE`` of its duration (a GPU consuming faster than the drive reads), up to
   the ``lookahead + 1`` blocks the block-wise prefetch held; it never shrinks, so it
   settles instead of oscillating. What was learned outlives the context (the model's
   ``OffloadHistory``, like adaptive keep's choice).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class BlockPolicy(str, enum.Enum):
    KEEP = "keep"
    RECOMPUTE = "recompute"
    HOST = "host"
    NVME = "nvme"

    @property
    def offloads(self) -> bool:
        return self in (BlockPolicy.HOST, BlockPolicy.NVME)


PolicySpec = str | Mapping[int | str, str] | None
POLICY_NAMES = ("auto", "keep", "recompute", "host", "nvme")


def resolve_policies(spec: PolicySpec, block_names: Sequence[str], default: str) -> tuple[list[BlockPolicy], bool]:
    """Per-block policies from ``spec`` (a name, or a mapping from block index or
    qualified name to a name), plus whether ``auto`` asks for adaptive keep.

    Under a plain offload policy the last block is kept (rule 3): backward starts there.
    """
    if spec is None:
        spec = default
    count = len(block_names)
    if isinstance(spec, str):
        if spec not in POLICY_NAMES:
            raise ValueError(f"tiermem activations: policy {spec!r} is not one of {', '.join(POLICY_NAMES)}")
        if spec == "auto":
            return [BlockPolicy.NVME] * (count - 1) + [BlockPolicy.KEEP], True
        policy = BlockPolicy(spec)
        policies = [policy] * count
        if policy.offloads and count:
            policies[-1] = BlockPolicy.KEEP
        return policies, False
    if not isinstance(spec, Mapping):
        hint = " (a list: give dict(enumerate(policies)))" if isinstance(spec, (list, tuple)) else ""
        raise TypeError(
            f"tiermem activations: policy= takes a policy name ({', '.join(POLICY_NAMES)}) or a mapping from block "
            f"index or qualified name to one, such as {{0: 'recompute', 3: 'nvme'}}; got {spec!r} of type "
            f"{type(spec).__name__}{hint}"
        )
    policies = [BlockPolicy.KEEP] * count
    problems = []
    for key, value in spec.items():
        index = key if isinstance(key, int) else (block_names.index(key) if key in block_names else None)
        if index is None or not 0 <= index < count:
            problems.append(f"block {key!r} is not one of 0..{count - 1} or {list(block_names)}")
        elif value not in POLICY_NAMES[1:]:
            problems.append(f"block {key!r}: {value!r} is not one of keep, recompute, host, nvme")
        else:
            policies[index] = BlockPolicy(value)
    if problems:
        raise ValueError("tiermem activations: bad policy mapping: " + "; ".join(problems))
    return policies, False


def flexible_blocks(spec: PolicySpec, policies: Sequence[BlockPolicy], adaptive: bool) -> list[bool]:
    """Which blocks a fallback may change (NOTE [ Activation fallbacks ] rule 2): those that
    offload, and those whose policy tiermem chose (all under ``auto``; the kept last block
    of a plain ``host``/``nvme`` policy). A user's explicit ``keep``/``recompute`` stays."""
    chosen_last = isinstance(spec, str) and spec in ("host", "nvme")
    return [
        adaptive or policy.offloads or (chosen_last and i == len(policies) - 1) for i, policy in enumerate(policies)
    ]


PREFETCH_START = 0.25
"""NOTE [ Prefetch window ] rule 2: the first window, as a fraction of the largest block."""
WAIT_TOLERANCE = 0.02
"""Rule 3: the share of backward spent waiting for reads above which the window grows."""


def next_prefetch_window(window: int, waited_s: float, backward_s: float, cap: int) -> int:
    """NOTE [ Prefetch window ] rule 3: the window for the next backward."""
    if backward_s > 0 and waited_s > WAIT_TOLERANCE * backward_s:
        return min(cap, max(2 * window, 1))
    return window


@dataclass(frozen=True)
class BlockProfile:
    """What one forward measured of a block."""

    forward_s: float
    saved_bytes: int


def adaptive_keep(profile: Sequence[BlockProfile], write_bw: float, read_bw: float) -> int:
    """How many trailing blocks to keep resident (NOTE [ Adaptive keep ]); at least one."""
    if not profile:
        return 0
    if write_bw <= 0 or read_bw <= 0:
        return len(profile)
    ends, clock = [], 0.0
    for block in profile:
        clock += block.forward_s
        ends.append(clock)
    forward_end = clock
    write_end = 0.0
    hidden = []
    for i, block in enumerate(profile):
        write_end = max(write_end, ends[i]) + block.saved_bytes / write_bw
        needed_at = forward_end + 2 * sum(b.forward_s for b in profile[i + 1 :])
        hidden.append(write_end + block.saved_bytes / read_bw <= needed_at)
    keep = 1
    for i in range(len(profile) - 2, -1, -1):
        if hidden[i]:
            break
        keep += 1
    return keep
