"""The cost model: a candidate plan's step time and its peak bytes on every tier. Pure.
The model states' part is :mod:`~tiermem.planner.state_costs` (rules 1, 5, 7-10), the
activations' part :mod:`~tiermem.planner.activation_costs` (rules 2, 6, 7); this module
combines them (rules 1, 3-5) and re-exports their names.

# NOTE [ Cost model ]
1. Device bytes (what the device tier accounts, NOTE [ Model-state rules ] rule 6):
   persistent chunks (parameters and optimizer states), ``buffers`` streamed chunks'
   parameters (the largest streamed chunks' slots: an outlier's own chunk its own bytes, every
   other the largest other's, NOTE [ Spare chunk storage ]), gradient chunks, and the saved
   activations the offloader manages (rule 4).
   Gradients (``zero_grad(set_to_none=True)``, the default, drops them between steps) are
   allocated during backward, as activations are freed: a persistent chunk's gradient chunk
   appears when backward reaches the block that first used its last parameter (NOTE
   [ Profile fields ] rule 4); streamed chunks' gradients stay on the device only until their
   write-back lands (one being filled, counted at the largest untied streamed chunk's bytes;
   a fresh gradient buffer waits for the write-backs in flight, NOTE [ Model-state rules ]
   rule 6, so a loaded machine does not leave more on the device). A
   streamed chunk of shared, tied parameters keeps its gradient to the end of backward, from
   the same stage as a persistent chunk would: a tied weight's gradient accumulates once, when
   its last use (its first in forward) is done. Counted all backward instead, the 6-layer tied
   GPT of ``tests/test_manage_activations.py`` at device 40% (everything streamed) was predicted
   at 477,184 bytes, measured 423,936 (now 432,128). The device peak
   is the largest sum over that backward timeline and the end of forward, where no gradient
   exists yet: counting the streamed gradients in flight there too, and a persistent tied
   chunk twice, overestimated the 200M GPT of issue 20 at device and host 10% by 48 MiB
   (288 MiB predicted, 236-244 MiB measured; now 240 MiB) and refused plans that fit.
2. Activations on the device: the part outside blocks, kept blocks, offloaded blocks whose
   write has not landed yet (the offloader keeps a tensor readable at its source until its
   write lands) and, in backward, the block being fetched back plus the prefetch window
   ahead of it at the size it can grow to (NOTE [ Prefetch window ]: a quarter of the largest
   block, up to ``LOOKAHEAD`` blocks once backward waits for reads, which a loaded machine
   makes it do whatever the link's speed: predicted at its start, a GPT of
   ``tests/test_oversized_chunks.py`` peaked 6% above the prediction beside other work);
   prefetches only take room that is free: the offloader drops one that does not fit).
   Earlier blocks' writes in flight are opportunistic too: a block
   that meets a full device waits for them to land (NOTE [ Activation fallbacks ] rules 4
   and 5), so what must fit (``device_demand``) holds each offloaded block's own bytes
   beside what stays, not the queue (a timing the link probes decide: on a 16 x 128 GPT at
   device 10% the queued writes of a slower probe refused every plan while the default
   placement peaked at 81%); the predicted peak keeps them, capped at the capacity. A
   recomputed block's checkpoint keeps only its input until the block's backward; the
   offloader registers that input like a kept tensor (measured: 4 x 1 MiB on the device tier
   at the end of forward on the 4x256 GPT, all blocks recomputed), so it counts on the device
   from the block's forward to its backward (in ``ram_bytes`` instead when below
   ``min_bytes``, as are saved tensors below it). The block's other tensors never reach the
   tier (checkpoint's own hooks hold them, in forward only while an operator runs, in
   backward while it recomputes): the device peak counts none of them.
3. The transient operator peak (memory inside and between operators, unmanaged) is predicted
   separately: the largest ``transient_bytes`` of a block, or of the part outside blocks.
4. Fragmentation margin: a plan fits when every tier's predicted peak times
   ``1 + FRAGMENTATION_MARGIN`` is within its capacity. The tiers account exact bytes with
   page-rounded chunks, so the margin covers the model's approximations (in-flight timing,
   gradient chunks), not allocator fragmentation; on CUDA the caching allocator adds its own.
5. Time on the CPU device (TRAPS 7): compute, recompute, every device<->host copy, the
   staging copy of every NVMe byte and the optimizer step run on the same cores, so they
   add up; NVMe transfers themselves (DMA) overlap compute and only their excess over the
   compute they can hide behind is added (a stall). On CUDA, copies overlap compute too, and
   only offloaded chunks' optimizer step counts (on the CPU; persistent ones step on the GPU).
6. NVMe activation I/O follows NOTE [ Adaptive keep ]: writes queue in forward order;
   backward prefetches ``LOOKAHEAD`` blocks ahead, reads queue; backward waits when a read
   lands after it needs the block. Chunk reads from NVMe homes share that link, spread over
   the pass that needs them (the pool fetches a few chunks ahead of compute, not all at the
   pass's start): activation I/O gets the link's time the chunk reads leave over the pass,
   and at least ``1 - PREFETCH_SHARE`` of it once chunk reads saturate the link (the
   scheduler's rule 4 caps prefetch so write-backs always find room; an approximation: the
   cap is on bytes in flight, not link time, and demand fetches are not capped). Queuing the whole
   pass's chunk reads ahead of the first activation write instead kept several blocks'
   writes pending at forward's end in the model, ~190 MiB at the 200M GPT of issue 5, that
   the measured device peak never showed, and refused plans that fit.
7. A managed step's own work (NOTE [ Profile fields ] rule 6, measured by NOTE [ Overhead
   calibration ]) runs on the training thread and adds up with the rest: per parameter
   (hooks, per-parameter optimizer calls), per saved tensor the offloader registers (blocks
   kept, offloaded to host or NVMe, and outside blocks; a recomputed block registers none),
   per saved tensor offloaded (its move out and back, beyond the bytes), per saved tensor of
   a recomputed block (checkpoint's hooks, beyond the recompute itself), and per streamed
   chunk (its moves through the scheduler, beyond the bytes). With equal bytes, fewer and
   larger streamed chunks are faster; persistent chunks cost nothing per chunk. A chunk that
   steps in slices (NOTE [ Sliced steps ]) costs one more streamed chunk per slice past its
   first: each slice is its own staging, optimizer call and write-back.
8. Revisited chunks. A chunk whose parameters forward first uses in more than one run, other
   chunks' between (the LoRA adapters' one chunk, NOTE [ Chunk layout rules ] rule 1: used in
   every block between its base's chunks), is read more than once a pass when it streams, and
   evicts the chunks around it. Then the fetches follow the pool's least-recently-used
   eviction simulated over the runs (``Packing.fetches``): in forward with one slot over
   ``buffers`` (the adapter's module keeps its chunk pinned while its base layer fetches its
   own, a demand over the buffers), in backward with ``buffers`` from what forward left. The
   device peak does not count that slot: measured on the model below, the device peaked at one
   base slot and the adapters' gradient (1,351,680 bytes), what rule 1 gives; counting the
   pinned adapters' chunk too predicted 22% over it. Each fetch costs its bytes (host homes: a
   memory copy; NVMe: the link) and one streamed chunk's overhead (rule 7); the NVMe bytes read
   past once a pass are demand fetches, added whole to the stall. Measured on the 6-block LoRA GPT of
   ``bench/lora.py --size tiny`` (20 frozen chunks of 1 MiB, one buffer, the adapters' chunk
   streamed): forward fetched the adapters' chunk 6 times and each base chunk once, as
   simulated; backward the adapters' 12 times, as simulated, and base chunks 29 times where
   the simulation says 24 (prefetches behind evict a little more): 56.0 MB read a step, 51.3 MB
   simulated, 39 MB charged before. When no chunk is revisited, or the revisited ones persist,
   every chunk is read once a pass (backward refetches all but the ``buffers`` cached).
   Backward's simulation also prefetches as the pool does (the chunk before each one used, into
   a free slot or one behind it, keeping its old place in the eviction order). What it still
   misses (measured): a module that owns the adapters and wraps its base layer (the hand-written
   LoRA of the tests and of ``bench/lora.py``) runs its backward before the base layer's, not
   after as forward's order reversed says, so backward fetches the base's chunk once more per
   wrapped layer: the tiny bench above reads 50.1 MB a step, 44.8 MB simulated; at 200M (10%, one
   buffer) 2,226 MiB of chunks from NVMe, 1,926 MiB simulated. The profile records forward's
   order only.
9. Recomputed blocks and embeddings (``Packing.block_visits``, from NOTE [ Profile fields ] rule
   4's ``param_block``). A recomputed block runs its forward again inside backward: backward
   holds the block's last chunk while the recompute fetches the block's chunks in forward's
   order (prefetching nothing: NOTE [ Model-state rules ] rule 3), then walks them back. The
   simulation of rule 8 then runs per block, recomputes included, whenever a recomputed block
   uses a streamed chunk; its extra fetches are demand fetches, like rule 8's. A recompute's
   forward needs one module's span plus one slot beside what backward holds (at most the
   block's own chunks, the floor of NOTE [ Default placement rule ] rule 4); past ``buffers``
   the pool takes them as demands over the buffers, so the device peak counts them in backward
   (``recompute_bytes``): plans of every block recomputed through one buffer failed mid-step
   (StatesMemoryError) on the tests' LoRA Llama. Measured there (4 x 128, device and host 40% of
   the base, every block recomputed; the plan varies with the profile's timings): each link's
   bytes as predicted, to the byte (one run: 6,078,464 a step from NVMe, 3,432,448 from the
   host); charged once a pass, the NVMe link's were 12-20% under. What forward runs before the
   first block (embeddings: backward reads no weight, NOTE [ Model-state rules ] rule 3) is not
   fetched for backward: ``Packing.lookups``, the chunks only it uses, tied ones left out.
10. Bytes per link (``Estimate.links``, named as ``rt.stats()`` names them): chunk fetches from
   host homes ``host->device`` and from NVMe homes ``nvme->device`` (rules 8, 9), gradient
   write-backs ``device->host``, gradients stored on NVMe ``device->nvme``, the step's staging
   ``nvme->host`` and ``host->nvme``, and offloaded activations both ways. Byte counts do not
   depend on the machine's load, so they check the model where times cannot
   (``tests/test_planner_links.py``; ``bench/lora.py`` prints both).
11. A loop that steps its chunks in backward (``grads_stream``) waits there for the homes its
   early steps stage through the plan's ``staged_homes`` slots: the bubbles of that pipeline
   (NOTE [ Early-step staging ] in :mod:`~tiermem.planner.early_steps`) add to the stall, on
   top of the step I/O's own time (rule 5's ``step_io``), which they do not replace: the
   homes' bytes share backward's link. What they buy is the depth: the 210M HF GPT-2 of
   ``bench/hf_states.py`` at 10% device and host was predicted 0.17-0.30 s of bubbles with two
   slots (profiles of two runs) and none with three, and measured (waits for homes) 0.31-0.71 s a
   step with two and 0.12-0.31 s with three. A third profile predicted 0.02 s with two slots
   (0.6 s measured), and its plan kept them, until the walk took a read whose slot frees within
   its chunk's backward at its step, as the runtime does: 0.43 s with two slots, none with three.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tiermem.planner.activation_costs import (
    LOOKAHEAD,
    ActivationCost,
    activation_cost,
    activation_overhead_s,
    link_share,
    saved_counts,
)
from tiermem.planner.early_steps import staging_stall
from tiermem.planner.profile import Profile
from tiermem.planner.state_costs import Packing, StatesChoice, StatesCost, states_cost, states_overhead_s

__all__ = [
    "FRAGMENTATION_MARGIN",
    "LOOKAHEAD",
    "POLICIES",
    "TIERS",
    "ActivationCost",
    "Estimate",
    "Packing",
    "StatesChoice",
    "StatesCost",
    "activation_cost",
    "activation_overhead_s",
    "combine",
    "device_peak",
    "fastest_fitting",
    "link_share",
    "predict",
    "saved_counts",
    "states_cost",
    "states_overhead_s",
    "transient_peak",
]

FRAGMENTATION_MARGIN = 0.05
"""Rule 4: headroom on every tier's predicted peak."""
POLICIES = ("keep", "recompute", "host", "nvme")
TIERS = ("device", "host", "nvme")


@dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one plan."""

    step_s: float
    peak_bytes: dict[str, int]
    transient_bytes: int
    ram_bytes: int
    parts_s: dict[str, float]
    device_parts: dict[str, int]
    reserve_device_bytes: int
    #: the device peak without opportunistic prefetches: what must fit (rule 2)
    device_demand: int = 0
    #: bytes a step moves per link, ``"src->dst"`` as ``rt.stats()`` names them (rule 10)
    links: Mapping[str, int] = field(default_factory=dict)

    def needed(self) -> dict[str, int]:
        return {**self.peak_bytes, "device": self.device_demand or self.peak_bytes["device"]}

    def fits(self, capacities: Mapping[str, int], margin: float = FRAGMENTATION_MARGIN) -> bool:
        need = self.needed()
        return all(need[t] * (1 + margin) <= capacities[t] for t in TIERS) and (
            self.reserve_device_bytes <= capacities["device"]
        )

    def within(self, capacities: Mapping[str, int]) -> Estimate:
        """The same estimate with the device peak capped at its capacity: prefetches fill the
        device only up to it (rule 2)."""
        capped = min(self.peak_bytes["device"], max(capacities["device"], self.device_demand))
        peaks = {**self.peak_bytes, "device": capped}
        return dataclasses.replace(self, peak_bytes=peaks)

    def shortfall(self, capacities: Mapping[str, int], margin: float = FRAGMENTATION_MARGIN) -> dict[str, int]:
        """Bytes each tier lacks (0 where it fits), margin included."""
        need = self.needed()
        short = {t: max(0, int(need[t] * (1 + margin)) - capacities[t]) for t in TIERS}
        short["device"] = max(short["device"], self.reserve_device_bytes - capacities["device"])
        return short


def device_peak(states: StatesCost, acts: ActivationCost, *, prefetch: bool = True) -> int:
    """Rule 1: the largest device total over forward's end (no gradient yet) and backward's
    stages, where streamed gradients are in flight (with the prefetched blocks, or only what
    each stage needs)."""
    count = len(acts.stage_live)
    stages = acts.stage_live if prefetch else acts.stage_demand
    forward, head = (acts.forward_peak, acts.head_live) if prefetch else (acts.forward_demand, acts.head_demand)

    def grads_by(stage: int) -> int:
        return sum(nbytes for at, nbytes in states.grad_stages if at >= stage)

    moments = [head + grads_by(count), states.grad_total]
    moments += [live + grads_by(i) for i, live in enumerate(stages)]
    return states.static_device + max(forward, states.grad_in_flight + states.recompute_bytes + max(moments))


def transient_peak(profile: Profile) -> int:
    """Rule 3."""
    return max([profile.outside.transient_bytes, *(b.transient_bytes for b in profile.blocks)])


def combine(profile: Profile, states: StatesCost, acts: ActivationCost, bubbles_s: float = 0.0) -> Estimate:
    """Rule 5: the step time and peaks of states and activations together; ``bubbles_s``: rule
    11's waits of early steps for their staged homes."""
    compute = profile.compute_s
    memcpy_bw = profile.memcpy_bw or float("inf")
    read_bw = profile.links.get("nvme->device") or profile.links.get("nvme->host") or float("inf")
    write_bw = profile.links.get("host->nvme") or profile.links.get("device->nvme") or float("inf")
    nvme_moved = states.nvme_read_forward + states.nvme_read_backward + states.nvme_step_bytes + acts.nvme_bytes_moved
    copy_s = (states.memcpy_bytes + acts.memcpy_bytes) / memcpy_bw
    staging_s = nvme_moved / memcpy_bw if profile.cpu else 0.0
    # Chunk reads from NVMe hide behind the compute of the pass that needs them, except the
    # first chunk of each pass; the optimizer's staging hides behind the step of the chunk
    # before, unless the host stages one home at a time.
    forward = sum(b.forward_s for b in profile.blocks) + profile.outside.forward_s
    backward = compute - forward
    # Rule 8: the reads a revisited streamed chunk causes again are demand fetches, waited for.
    again_fwd, again_bwd = states.nvme_refetch
    chunk_stall = (
        max(0.0, (states.nvme_read_forward - again_fwd) / read_bw - forward)
        + max(0.0, (states.nvme_read_backward - again_bwd) / read_bw - backward)
        + (again_fwd + again_bwd) / read_bw
    )
    step_io = states.nvme_step_read / read_bw + (states.nvme_step_bytes - states.nvme_step_read) / write_bw
    step_stall = max(0.0, step_io - states.optimizer_s) if states.step_overlaps_io else step_io
    parts = {
        "compute": compute,
        "recompute": acts.recompute_s,
        "copies": copy_s + staging_s if profile.cpu else 0.0,
        "optimizer": states.optimizer_s,
        "io_stall": acts.stall_s + chunk_stall + step_stall + bubbles_s,
        "overhead": states_overhead_s(profile, states.streamed_chunks) + activation_overhead_s(profile, acts),
    }
    if not profile.cpu:  # rule 5: on CUDA, device<->host copies run on their own stream
        parts["io_stall"] += max(0.0, copy_s - compute)
    return Estimate(
        step_s=sum(parts.values()),
        peak_bytes={
            "device": device_peak(states, acts),
            "host": states.host_bytes + acts.host_bytes,
            "nvme": states.nvme_bytes + acts.nvme_bytes,
        },
        transient_bytes=transient_peak(profile),
        ram_bytes=acts.ram_bytes,
        parts_s=parts,
        device_parts={**states.device_parts, "activations": acts.device_peak},
        reserve_device_bytes=states.reserve_device_bytes,
        device_demand=device_peak(states, acts, prefetch=False),
        links={k: states.links.get(k, 0) + acts.links.get(k, 0) for k in {*states.links, *acts.links}},
    )


def predict(profile: Profile, choice: StatesChoice, policies: Sequence[str]) -> Estimate:
    """The full prediction for one plan (rules 1-6 and 11)."""
    states = states_cost(profile, choice, policies=policies)
    read_bw = profile.links.get("nvme->device") or 0.0
    busy = (states.nvme_read_forward / read_bw, states.nvme_read_backward / read_bw) if read_bw else (0.0, 0.0)
    return combine(profile, states, activation_cost(profile, policies, busy), staging_stall(profile, choice, policies))


def fastest_fitting(front: Sequence[tuple[int, float, int]], room: int) -> int | None:
    """Index into a Pareto front sorted by device bytes (ascending; time descending) of the
    fastest entry using at most ``room`` device bytes."""
    keys = [entry[0] for entry in front]
    index = bisect.bisect_right(keys, room) - 1
    return index if index >= 0 else None
