"""The cost model's early steps: how long a declared loop's backward waits for the NVMe homes its
chunks step in, through the host's staging room. Pure. Rule 11 of NOTE [ Cost model ] (in
:mod:`tiermem.planner.costmodel`).

# NOTE [ Early-step staging ]
1. A loop whose gradients stream (``grads_stream``) steps each NVMe chunk as its backward ends
   (NOTE [ Declared steps ] rule 3): its home's optimizer states are read into one of the plan's
   ``staged_homes`` staging slots when its backward begins (its parameters are copied from the
   device copy), the step runs on the training thread once its gradients are complete, and the
   whole home is written back, holding its slot until that write lands. A chunk whose backward
   begins while every slot is held has its read asked for again at each hook of backward once a
   slot frees (``backward_progress``); within one chunk's backward that hook is its step, so the
   read starts at the step (or when the slot frees, if later) and the step waits for all of it.
   Trace of the 210M HF GPT-2 of ``bench/hf_states.py`` with two slots: each MLP chunk's slot
   freed 8-25 ms before its step, inside one module's backward, and its 56 MiB read, issued at
   the step, was waited for 21-50 ms; a walk starting such reads as the slot freed predicted
   0.02 s of waits a step where 0.6 s were measured, and the planner kept two slots.
2. The walk: chunks in backward order (the reverse of execution order), each taking its share
   of the backward compute of the places forward used it in (each block's backward, its forward
   again when recomputed, the head's; split by parameter bytes); a chunk's step starts once its
   compute and its home's read are done (the wait is the stall), and its write-back starts as
   the step ends. Tied chunks step after the whole backward and take no slot here; persistent
   chunks only compute, host-homed ones compute and step in place, with no slot either.
3. Rates: backward's reads (saved activations, parameters fetched again, these homes) keep the
   link busy, so a home's read gets the prefetch share of the read bandwidth and its write-back
   the rest of the write bandwidth (NOTE [ Scheduling rules ] rule 4: prefetches hold at most
   ``PREFETCH_SHARE`` of the in-flight bound). Measured on the 210M HF GPT-2 of
   ``bench/hf_states.py`` (2 cores, read 2.2 GB/s, write 2.6 GB/s): a 56 MiB home read took
   34-51 ms and an 84 MiB write-back 105-130 ms beside backward's reads. Write-backs queue one
   behind another (first in, first out within a priority: a 60 MiB one queued 22-57 ms behind
   the 84 MiB one before it), where the walk lets them overlap: walked in turn, both depths
   predicted about 0.5 s of waits there (the profile's backward outruns the writes), which the
   three slots' measured 0.12-0.31 s do not show, so it is not modelled.
4. What it is for: the depth. Closed-form bounds (backward's compute, its disk time, the slots'
   occupancy over the depth) give the same time for two and three slots there, while the
   measured backward waits 0.3-0.7 s a step for homes with two slots and 0.1-0.3 s with three:
   each slot cycles through a read, a wait for its step, the step and a slow write-back, and a
   read issued late behind a write-back is a bubble no bound sees.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiermem.layout.shares import PREFETCH_SHARE
from tiermem.planner.profile import Profile
from tiermem.planner.state_costs import StatesChoice


def backward_seconds(
    profile: Profile, block_visits: Sequence[Sequence[int]], sizes: Sequence[int], policies: Sequence[str]
) -> list[float]:
    """Rule 2: each chunk's share of backward's compute: of each place forward used it in (per
    ``block_visits``: before the blocks, each block, the head), in proportion to the chunks'
    parameter bytes (``sizes``; a chunk spanning two places weighs its whole bytes in each). A
    recomputed block's backward runs its forward again."""
    seconds = [0.0] * len(sizes)
    count = len(profile.blocks)
    for place, chunks in enumerate(block_visits):
        if place == 0:
            continue  # embeddings: their backward reads no weight and takes next to nothing
        if place > count:
            place_s = profile.outside.backward_s
        else:
            block = profile.blocks[place - 1]
            recomputed = place - 1 < len(policies) and policies[place - 1] == "recompute"
            place_s = block.backward_s + (block.forward_s if recomputed else 0.0)
        used = set(chunks)
        total = sum(sizes[c] for c in used)
        for c in used:
            seconds[c] += place_s * sizes[c] / total if total else 0.0
    return seconds


def early_chunks(choice: StatesChoice) -> list[int]:
    """Rule 2: the chunks a streaming loop steps in backward from NVMe homes staged whole
    (trainable, not in slices, not tied: tied chunks step after the whole backward)."""
    pk = choice.packing
    if not pk.grads_stream:
        return []
    shared = set(pk.shared)
    first = max(choice.host_end, choice.persistent)
    return [
        c
        for c in range(first, pk.chunks)
        if pk.needs[c].trainable and not pk.needs[c].sliced(pk.chunk_size) and c not in shared
    ]


def staging_stall(profile: Profile, choice: StatesChoice, policies: Sequence[str]) -> float:
    """Rules 1-3: the seconds a streaming loop's backward waits for the homes of its early
    steps with ``choice``'s staging depth (0 for a loop that steps at ``optimizer.step()``)."""
    pk = choice.packing
    early = early_chunks(choice)
    read_bw = profile.links.get("nvme->host") or profile.links.get("nvme->device") or 0.0
    write_bw = profile.links.get("host->nvme") or profile.links.get("device->nvme") or 0.0
    if not early or not pk.block_visits or read_bw <= 0 or write_bw <= 0:
        return 0.0
    read_rate, write_rate = read_bw * PREFETCH_SHARE, write_bw * (1 - PREFETCH_SHARE)
    needs = pk.needs
    compute = backward_seconds(profile, pk.block_visits, [n.nbytes for n in needs], policies)
    stepping = set(early)
    shared = set(pk.shared)
    # host-homed chunks step in backward too, in place: their step's time only
    in_place = {c for c in range(choice.persistent, choice.host_end) if needs[c].trainable and c not in shared}
    clock = stall = 0.0
    landed: list[float] = []  # each early chunk's write-back landing, in backward order
    for c in range(len(needs) - 1, -1, -1):
        entered = clock
        clock += compute[c]
        if c in in_place:
            clock += profile.optimizer_s_per_byte * needs[c].nbytes
        if c not in stepping:
            continue
        need = needs[c]
        # its read starts as its backward begins if the write-back ``staged_homes`` early steps
        # back has freed its slot by then; else at its step (or once the slot frees, if later),
        # which is where the runtime next asks for it; its parameters come from the device copy
        # (NOTE [ Declared steps ] rule 7), so only the states are read
        freed = landed[-pk.staged_homes] if len(landed) >= pk.staged_homes else 0.0
        read_end = (entered if freed <= entered else max(clock, freed)) + (need.home_bytes - need.nbytes) / read_rate
        stall += max(0.0, read_end - clock)
        clock = max(clock, read_end) + profile.optimizer_s_per_byte * need.nbytes
        landed.append(clock + need.home_bytes / write_rate)
    return stall
