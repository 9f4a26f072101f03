"""The placement plan of model states, and the simple default rule (pure: no I/O, no torch).

A plan says how big chunks are (a parameter larger than that, an outlier, has a chunk of its
own: NOTE [ Chunk layout rules ] rule 4), how many of the first chunks stay on the device, how many
non-persistent chunks the device buffer pool holds, and where each chunk's master parameters
and optimizer states live. ``rt.manage(..., plan=)`` takes a hand-written plan (a dict in
the shape of :meth:`Plan.as_dict`, a :class:`Plan`, or the path of a JSON file saved by
:meth:`Plan.save`); fields it leaves out follow the default rule. ``"auto"`` asks the planner
(:mod:`tiermem.planner`) when it has a profile, and follows the default rule otherwise. A plan
may carry a per-block activation policy (``block_policy``), which ``rt.offload_activations``
applies under policy ``auto``, and the planner's prediction, which travels with it.

# NOTE [ Default placement rule ]
1. Device bytes of a persistent chunk: its parameters, gradients and optimizer states
   (``(1 + 1 + sections) * nbytes``, 16 bytes a parameter for fp32 Adam); a frozen chunk
   (``requires_grad=False`` at ``rt.manage``: a LoRA base, a teacher) only its parameters.
   Streaming reserve: a parameter buffer per pool slot, ``buffers * chunk_size``, plus a
   gradient buffer for each of the ``buffers`` largest streamed trainable chunks (a frozen
   chunk is streamed for forward and backward only and never has gradients); a streamed
   chunk larger than the chunk size (an outlier's own, NOTE [ Chunk layout rules ] rule 4)
   takes a slot of its own bytes, and the reserve counts the ``buffers`` largest slots
   (``reserve_bytes``, ``streamed_reserve``).
2. Persistent chunks: the longest prefix, in execution order, whose device bytes fit in half
   the device's free capacity and leave the streaming reserve free beside them; every chunk
   when all of them fit in that half.
3. Homes of the other chunks, in order: the host while its free capacity still holds the
   chunk's home (master + states) and gradients, else NVMe. The host keeps room to stage
   ``staged_homes`` trainable NVMe homes during the step (``ChunkNeeds.staged_home_bytes``; a frozen
   chunk never steps, its NVMe home is read straight into its device buffer): two (one steps
   while the next is read), or, when two leave the plan short, one (each home is read only once
   the one before is written back: the step's NVMe I/O no longer overlaps it, but the host holds
   half the staging). A plan may stage three (``PLAN_DEPTHS``): the planner gives a loop that
   steps its chunks in backward a third slot where it predicts that pays (NOTE [ Early-step
   staging ] in ``tiermem/planner/early_steps.py``), never the default rule. Between steps
   nothing else uses that room, so a backward that steps nothing early stages the first homes
   of the coming step in it (NOTE [ Declared steps ] rule 10). An NVMe chunk's gradients wait
   until ``optimizer.step()``
   (``.grad`` stays readable and writable, TRAPS 4) where ``grad_home`` says: on the host
   when it holds all of them beside those homes, else on NVMe (``grad_home = "nvme"``: the
   host then holds ``staged_homes`` chunks' gradients at once, staged to step or to serve
   ``.grad``, NOTE [ Stored gradients ] in ``tiermem/states/stored_grads.py``), at the price
   of writing and reading them once more per step. When gradients stream (``grads_stream``: a declared
   loop that steps every backward without clipping and ``keep_gradients=False``), each NVMe
   chunk steps as its backward ends and frees its gradients (NOTE [ Declared steps ] rule
   6), so they never wait: the host only holds two chunks' gradients at once, the one
   stepping and the one on its way, and ``grad_home`` is ``"host"``; on the CPU device none
   (``grads_via_host`` False: each step reads its gradients in the chunk's device gradient
   buffer, NOTE [ Declared steps ] rule 8; the 210M HF GPT-2 of ``bench/hf_states.py`` peaked at
   230 MiB of host where two 32 MiB chunks' gradients were budgeted beside 228 MiB).
4. Buffers: the most chunks one module's own parameters span, plus the chunks holding
   parameters shared by several modules (tied weights stay pinned through backward), plus one
   slot to prefetch into; never more than the non-persistent chunks. When that reserve leaves
   the device short and buffers were not asked for, the prefetch slot goes before a refusal (a
   chunk is then fetched on demand as its module starts), unless a block whose activations may
   be recomputed (every block ``rt.manage`` applies a policy to but one a user keeps:
   NOTE [ Activation fallbacks ] rules 2 and 4) needs that slot: its forward runs again inside
   backward beside the chunk backward holds, so it needs one module's span plus one, at most
   the block's own span (``recompute_buffers``; measured: a 200M LoRA at device 10% packed in
   49 MiB chunks through one buffer fell back to recompute and failed its second step). A hand
   chunk size that leaves room for fewer is refused up front; of the automatic sizes, those
   that keep them win, and one that fits only below them is taken when none does (a block
   recomputes only when its saved bytes do not fit the device beside the buffers: a 6 x 256
   LoRA of small activations at device 10% trains on one buffer and never recomputes). Buffers
   a plan gives (a user's, the planner's) are taken as given. When no chunk size of at least
   the largest parameter fits, the sizes that give outliers chunks of their own are tried
   (NOTE [ Chunk layout rules ] rules 4 and 5). Every chunk size is tried with two staged homes, then
   with one (rule 3); of the sizes that fit, those that stage two win (their step overlaps its
   I/O), then the least waste. A refusal of the rule alone names the smallest free bytes per
   tier with which some chunk size fits (``choose.py``), outliers' own chunks included, and
   first the tiers whose free bytes are below those, with the raise each needs: the first size's
   own refusal may blame a tier that some other size does not need more of.
   Measured: a 4 x 256 GPT-2 and Llama (vocabulary 1,024, 52 MiB of fp32 AdamW state) at device
   25% and host 10% of it were refused with two staged homes (8 MiB of host for 1 MiB chunks,
   the largest parameter's size) and train with one (4 MiB).
5. A hand-written field overrides the rule; the whole plan is then checked against the free
   capacities and rejected with the numbers when it cannot fit.
6. Sliced steps: an NVMe chunk larger than the chunk size (an outlier's own) steps in slices of
   the chunk size when its optimizer is element-wise (``ChunkNeeds.sliceable``; NOTE [ Sliced
   steps ] in ``tiermem/states/chunk_step.py``). Rule 3's staging room then holds two slices' homes
   and gradients for it (``staged_home_bytes``, ``staged_grad_bytes``), not its whole home, and
   its gradients wait on NVMe (counted there). A chunk whose optimizer is not element-wise stages
   whole, and a refusal says so.
7. What the device must hold, for any placement: rule 1's streaming reserve at the fewest
   buffers, twice the largest chunks one module's forward and backward use at once (tied weights
   count their chunk for all of backward), an outlier's chunk its own bytes: at least the largest
   parameter and its gradient, which its module computes with and autograd accumulates whole.
   Below that nothing fits, and the refusal names the least device in bytes (``choose.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiermem.errors import PlanError, StatesMemoryError
from tiermem.layout.prediction import Prediction
from tiermem.units import ALIGNMENT, format_size, parse_size, round_up

STATE_HOMES = ("device", "host", "nvme")
STAGED_HOMES = 2
"""Rule 3: NVMe homes the host has room to stage at once (one steps, one is on its way), unless
the plan says one (``Plan.staged_homes``)."""
STAGING_DEPTHS = (STAGED_HOMES, 1)
"""Rule 3: the values ``staged_homes`` takes by the default rule, its preference first."""
PLAN_DEPTHS = (3, *STAGING_DEPTHS)
"""Rule 3: the values a plan may give ``staged_homes``: a third slot for a loop that steps its
chunks in backward, where the planner predicts it pays (NOTE [ Early-step staging ] in
``tiermem/planner/early_steps.py``)."""
BLOCK_POLICIES = ("keep", "recompute", "host", "nvme")
GRAD_HOMES = ("host", "nvme")
"""Rule 3: where the gradients of chunks with NVMe homes wait between backward and the step."""
PLAN_KEYS = (
    "chunk_size",
    "persistent_chunks",
    "buffers",
    "state_home",
    "grad_home",
    "staged_homes",
    "slice_bytes",
    "block_policy",
    "predicted",
)


@dataclass(frozen=True)
class ChunkNeeds:
    """What one chunk costs wherever it lives (rule 1)."""

    nbytes: int
    trainable: bool
    sections: int
    #: fp32 master bytes per working byte: 2 for bf16/fp16 working chunks (chunk layout rule 6)
    master_scale: int = 1
    #: rule 6: its optimizer's state is element-wise, so its step may run over slices
    sliceable: bool = True

    @property
    def device_bytes(self) -> int:
        if self.master_scale == 1:
            return self.nbytes * (1 + (1 if self.trainable else 0) + self.sections)
        master = self.nbytes * self.master_scale * (1 + self.sections)
        return self.nbytes * (1 + (1 if self.trainable else 0)) + master

    @property
    def home_bytes(self) -> int:
        working = self.nbytes if self.master_scale > 1 else 0
        return self.nbytes * self.master_scale * (1 + self.sections) + working

    @property
    def grad_bytes(self) -> int:
        return self.nbytes if self.trainable else 0

    def sliced(self, span: int) -> bool:
        """Rule 6: whether an NVMe home of this chunk steps in slices of ``span`` bytes (a frozen
        chunk never steps)."""
        return self.trainable and self.sliceable and self.nbytes > span

    def staged_home_bytes(self, chunk_size: int, span: int | None = None) -> int:
        """Rules 3 and 6: host bytes staging this chunk's NVMe home for its step takes at once:
        none for a frozen chunk, which never steps; the home of a slice of ``span`` bytes (the
        chunk size when None) when it steps in slices; else the whole home."""
        if not self.trainable:
            return 0
        if not self.sliced(chunk_size):
            return self.home_bytes
        return dataclasses.replace(self, nbytes=min(span or chunk_size, self.nbytes)).home_bytes

    def staged_grad_bytes(self, chunk_size: int, span: int | None = None) -> int:
        """Rule 6: host bytes its gradients take when staged for its step (a slice's, or all)."""
        return min(self.grad_bytes, span or chunk_size) if self.sliced(chunk_size) else self.grad_bytes


@dataclass(frozen=True)
class Budgets:
    """Free bytes per tier when the plan is made."""

    device: int
    host: int
    nvme: int


@dataclass(frozen=True)
class PlanRequest:
    """The fields of a hand-written plan; ``None`` means "follow the default rule".

    ``state_home`` may be one home for every non-persistent chunk ("host" or "nvme").
    ``block_policy`` and ``predicted`` are carried into the plan as they are. ``order``: the
    parameters' execution order a profile recorded, to pack in from the start (NOTE
    [ Model-state rules ] rule 2); None packs in registration order until the first forward."""

    chunk_size: int | None = None
    persistent_chunks: int | None = None
    buffers: int | None = None
    state_home: tuple[str, ...] | str | None = None
    block_policy: tuple[str, ...] | None = None
    predicted: Prediction = field(default_factory=Prediction)
    order: tuple[int, ...] | None = None
    grad_home: str | None = None
    staged_homes: int | None = None
    slice_bytes: int | None = None


@dataclass(frozen=True)
class Plan:
    """Every placement decision for one managed model (see ``as_dict`` for the shape)."""

    chunk_size: int
    persistent_chunks: int
    buffers: int
    state_home: tuple[str, ...]
    block_policy: tuple[str, ...] | None = None
    predicted: Prediction = field(default_factory=Prediction)
    #: rule 3: where NVMe chunks' gradients wait between backward and the step
    grad_home: str = "host"
    #: rule 3: NVMe homes (and stored gradients) the host stages at once for the step
    staged_homes: int = STAGED_HOMES
    #: rule 6: the bytes a sliced step's slices span (None: the chunk size)
    slice_bytes: int | None = None

    @property
    def chunks(self) -> int:
        return len(self.state_home)

    def as_dict(self) -> dict[str, Any]:
        return {
            "chunk_size": self.chunk_size,
            "persistent_chunks": self.persistent_chunks,
            "buffers": self.buffers,
            "state_home": list(self.state_home),
            "grad_home": self.grad_home,
            "staged_homes": self.staged_homes,
            "slice_bytes": self.slice_bytes,
            "block_policy": None if self.block_policy is None else list(self.block_policy),
            "predicted": self.predicted.as_dict(),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON; ``plan=path`` reads it back."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.as_dict(), f, indent=2)
            f.write("\n")


def parse_plan(spec: Plan | PlanRequest | Mapping[str, Any] | str | os.PathLike[str] | None) -> PlanRequest:
    """A :class:`PlanRequest` from what ``plan=`` accepts; every problem reported at once."""
    if spec is None or spec == "auto":
        return PlanRequest()
    if isinstance(spec, PlanRequest):
        return spec
    if isinstance(spec, Plan):
        return PlanRequest(
            chunk_size=spec.chunk_size,
            persistent_chunks=spec.persistent_chunks,
            buffers=spec.buffers,
            state_home=spec.state_home,
            block_policy=spec.block_policy,
            predicted=spec.predicted,
            grad_home=spec.grad_home,
            staged_homes=spec.staged_homes,
            slice_bytes=spec.slice_bytes,
        )
    if isinstance(spec, (str, os.PathLike)):
        try:
            with open(spec, encoding="utf-8") as f:
                spec = json.load(f)
        except (OSError, ValueError) as exc:
            raise PlanError(f"tiermem plan: cannot read plan file {os.fspath(spec)!r}: {exc}") from exc
    if not isinstance(spec, Mapping):
        raise PlanError(
            f"tiermem plan: plan= takes a dict, a Plan, a JSON file path or None, not {type(spec).__name__}"
        )
    problems = [f"{key!r}: unknown key (known: {', '.join(PLAN_KEYS)})" for key in spec if key not in PLAN_KEYS]
    values: dict[str, Any] = {}
    for key in ("chunk_size", "persistent_chunks", "buffers", "slice_bytes"):
        value = spec.get(key)
        if value is None or value == "auto":
            continue
        try:
            number = parse_size(value) if key in ("chunk_size", "slice_bytes") else value
            if isinstance(number, bool) or not isinstance(number, int):
                raise ValueError(f"must be an integer, got {value!r}")
            # buffers=0 is what a plan whose every chunk persists says (Plan.save round trip)
            positive = key in ("chunk_size", "slice_bytes")
            if number < (1 if positive else 0):
                raise ValueError(f"must be {'> 0' if positive else '>= 0'}, got {value!r}")
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
            continue
        values[key] = number
    homes = spec.get("state_home")
    if isinstance(homes, str) and homes != "auto":
        if homes not in ("host", "nvme"):
            problems.append(f"state_home: one home for every streamed chunk must be 'host' or 'nvme', got {homes!r}")
        else:
            values["state_home"] = homes
    elif homes is not None and homes != "auto":
        if not isinstance(homes, Sequence) or any(h not in STATE_HOMES for h in homes):
            problems.append(f"state_home: a list of {'|'.join(STATE_HOMES)} per chunk, got {homes!r}")
        else:
            values["state_home"] = tuple(homes)
    grad_home = spec.get("grad_home")
    if grad_home is not None and grad_home != "auto":
        if grad_home not in GRAD_HOMES:
            problems.append(f"grad_home: where NVMe chunks' gradients wait, 'host' or 'nvme', got {grad_home!r}")
        else:
            values["grad_home"] = grad_home
    staged = spec.get("staged_homes")
    if staged is not None and staged != "auto":
        if isinstance(staged, bool) or staged not in PLAN_DEPTHS:
            problems.append(
                "staged_homes: NVMe homes the host stages at once for the step, 3 (a loop that steps in backward: "
                f"a write-back in flight no longer holds up the next read), 2 (overlapped) or 1, got {staged!r}"
            )
        else:
            values["staged_homes"] = staged
    policies = spec.get("block_policy")
    if policies is not None:
        if isinstance(policies, str) or not isinstance(policies, Sequence) or set(policies) - set(BLOCK_POLICIES):
            names = "|".join(BLOCK_POLICIES)
            problems.append(f"block_policy: a list of {names}, one per activation block, got {policies!r}")
        else:
            values["block_policy"] = tuple(policies)
    try:
        values["predicted"] = Prediction.from_dict(spec.get("predicted"))
    except ValueError as exc:
        problems.append(f"predicted: {exc}")
    if problems:
        raise PlanError("tiermem plan: " + "; ".join(problems))
    return PlanRequest(**values)


def default_buffers(min_buffers: int, streamed: int) -> int:
    """Rule 4: the slots a module and the shared chunks pin, plus one to prefetch into."""
    return max(1, min(min_buffers + 1, streamed)) if streamed else 0


def oversized_chunks(needs: Sequence[ChunkNeeds], chunk_size: int) -> list[int]:
    """Rule 1: the bytes of the chunks in ``needs`` larger than ``chunk_size`` (outliers' own
    chunks, NOTE [ Chunk layout rules ] rule 4)."""
    return [n.nbytes for n in needs if n.nbytes > chunk_size]


def reserve_bytes(
    buffers: int, chunk_size: int, oversized: Sequence[int] = (), trainable: Sequence[int] | None = None
) -> int:
    """Rule 1: device bytes the buffer pool may use (parameters and gradients): ``buffers``
    slots, the largest streamed chunks' (``oversized``: the streamed chunks larger than
    ``chunk_size``, each a slot of its own bytes; every other slot ``chunk_size``), and the
    gradient buffers of the ``buffers`` largest of ``trainable`` (the streamed trainable
    chunks' bytes; None: every slot has a gradient buffer of its size)."""
    largest = sorted(oversized, reverse=True)[: max(buffers, 0)]
    params = sum(largest) + (buffers - len(largest)) * chunk_size
    if trainable is None:
        return 2 * params
    return params + sum(sorted(trainable, reverse=True)[: max(buffers, 0)])


def streamed_reserve(streamed: Sequence[ChunkNeeds], buffers: int, chunk_size: int) -> int:
    """Rule 1's reserve for the streamed chunks ``streamed``: ``buffers`` parameter slots, and
    gradient buffers for the trainable ones only."""
    slots = min(buffers, len(streamed))
    trainable = [n.nbytes for n in streamed if n.trainable]
    return reserve_bytes(slots, chunk_size, oversized_chunks(streamed, chunk_size), trainable)


def decide(
    needs: Sequence[ChunkNeeds],
    *,
    chunk_size: int,
    min_buffers: int,
    budgets: Budgets,
    request: PlanRequest,
    grads_stream: bool = False,
    recompute_buffers: int = 0,
    grads_via_host: bool = True,
) -> Plan:
    """Rules 2-5: the plan for chunks ``needs`` (in execution order) of ``chunk_size`` bytes;
    ``grads_stream``: rule 3's streaming gradients (``grads_via_host``: passing through the host,
    False on the CPU device); ``recompute_buffers``: rule 4's fewest buffers for a recomputed
    block (0: none is). The host stages the request's ``staged_homes``, else two NVMe homes, or
    one when two leave the plan short (rule 3); a refusal is the last depth's (the least it
    needs)."""
    depths = STAGING_DEPTHS if request.staged_homes is None else (request.staged_homes,)

    def at(depth: int) -> Plan:
        return _decide(
            needs, chunk_size, min_buffers, budgets, request, depth, recompute_buffers, grads_stream, grads_via_host
        )

    for depth in depths[:-1]:
        with contextlib.suppress(StatesMemoryError):
            return at(depth)
    return at(depths[-1])


def _decide(
    needs: Sequence[ChunkNeeds],
    chunk_size: int,
    min_buffers: int,
    budgets: Budgets,
    request: PlanRequest,
    staged: int,
    recompute_buffers: int,
    grads_stream: bool,
    via_host: bool,
) -> Plan:
    """:func:`decide` with ``staged`` NVMe homes staged at once."""
    total = len(needs)
    persistent = request.persistent_chunks
    if persistent is not None and persistent > total:
        raise PlanError(f"tiermem plan: persistent_chunks={persistent} but the model packs into {total} chunks")
    if request.buffers is None and _device_short(needs, chunk_size, min_buffers, budgets, None, persistent):
        # Rule 4: the prefetch slot goes before a refusal; then the persistent prefix is the
        # longest one beside that smaller reserve.
        fewer = default_buffers(min_buffers, total) - 1
        if fewer >= max(min_buffers, recompute_buffers, 1) and not _device_short(
            needs, chunk_size, min_buffers, budgets, fewer, persistent
        ):
            request = dataclasses.replace(request, buffers=fewer)
    if persistent is None:
        persistent = _default_persistent(needs, chunk_size, min_buffers, budgets, request.buffers)
    streamed = total - persistent
    buffers = request.buffers if request.buffers is not None else default_buffers(min_buffers, streamed)
    buffers = min(buffers, streamed) if streamed else 0
    if streamed and buffers < min_buffers and buffers < streamed:
        raise PlanError(
            f"tiermem plan: buffers={buffers} is too few: one module's parameters and the shared (tied) chunks "
            f"need {min_buffers} device buffers at once; give buffers >= {min_buffers}"
        )
    homes, grad_home = _homes_and_grad_home(
        needs, persistent, budgets, request, grads_stream, chunk_size, staged, via_host
    )
    recomputed = recompute_buffers > min_buffers and buffers <= recompute_buffers
    _check_fits(
        needs, persistent, buffers, chunk_size, homes, budgets, grads_stream, grad_home, staged, recomputed, via_host
    )
    passing = gradients_at_once(grads_stream, grad_home, staged, via_host)
    slices = _slice_bytes(needs, homes, chunk_size, budgets, passing, staged, request.slice_bytes)
    return Plan(
        chunk_size=chunk_size,
        persistent_chunks=persistent,
        buffers=buffers,
        state_home=homes,
        block_policy=request.block_policy,
        predicted=request.predicted,
        grad_home=grad_home,
        # a plan without NVMe homes stages none: it says the default
        staged_homes=staged if "nvme" in homes else STAGED_HOMES,
        slice_bytes=slices,
    )


def _slice_bytes(
    needs: Sequence[ChunkNeeds],
    homes: Sequence[str],
    chunk_size: int,
    budgets: Budgets,
    passing: int | None,
    staged: int,
    requested: int | None,
) -> int | None:
    """Rule 6: the bytes slices span: the requested size (checked), else the chunk size widened,
    a page at a time, while the host holds two slices beside the rest of the plan (fewer, larger
    slices: each costs a few copies and an optimizer call). None when no chunk steps in slices."""
    sliced = [n.nbytes for n, h in zip(needs, homes, strict=True) if h == "nvme" and n.sliced(chunk_size)]
    if not sliced:
        return None

    def fits(span: int) -> bool:
        return _host_bytes(needs, homes, passing, staged, chunk_size, span) <= budgets.host

    if requested is not None:
        span = round_up(max(requested, chunk_size), ALIGNMENT)
        if not fits(span):
            need = _host_bytes(needs, homes, passing, staged, chunk_size, span)
            raise StatesMemoryError(
                f"tiermem model states do not fit: slice_bytes={requested} stages two slices of "
                f"{format_size(span)} on the host, which needs {format_size(need)} but has "
                f"{format_size(budgets.host)} free; give a smaller slice_bytes (at least the chunk size, "
                f"{format_size(chunk_size)}) or leave it out"
            )
        return span
    low, high = chunk_size // ALIGNMENT, round_up(max(sliced), ALIGNMENT) // ALIGNMENT
    while low < high:  # the host need grows with the span
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * ALIGNMENT) else (low, mid - 1)
    return low * ALIGNMENT


def _homes_and_grad_home(
    needs: Sequence[ChunkNeeds],
    persistent: int,
    budgets: Budgets,
    request: PlanRequest,
    grads_stream: bool,
    chunk_size: int,
    staged: int,
    grads_via_host: bool = True,
) -> tuple[tuple[str, ...], str]:
    """Rule 3: the homes, and where the NVMe chunks' gradients wait (the host when it holds
    them all beside the homes it keeps, else NVMe; streamed gradients never wait)."""
    size = chunk_size
    if grads_stream:
        passing = gradients_at_once(True, "host", staged, grads_via_host)
        return _homes(needs, persistent, budgets, request.state_home, size, staged, passing), "host"
    if request.grad_home is not None:
        passing = gradients_at_once(False, request.grad_home, staged)
        homes = _homes(needs, persistent, budgets, request.state_home, size, staged, passing)
        return homes, request.grad_home if "nvme" in homes else "host"
    homes = _homes(needs, persistent, budgets, request.state_home, size, staged, None)
    if "nvme" in homes and _host_bytes(needs, homes, None, staged, size) > budgets.host:
        homes = _homes(needs, persistent, budgets, request.state_home, size, staged, staged)
        return homes, "nvme"
    return homes, "host"


def _device_short(
    needs: Sequence[ChunkNeeds],
    chunk_size: int,
    min_buffers: int,
    budgets: Budgets,
    buffers: int | None,
    persistent: int | None,
) -> bool:
    """Rule 4: whether ``persistent`` chunks (None: the default prefix) and ``buffers`` (None:
    the default) leave the device short."""
    if persistent is None:
        persistent = _default_persistent(needs, chunk_size, min_buffers, budgets, buffers)
    streamed = len(needs) - persistent
    slots = buffers if buffers is not None else default_buffers(min_buffers, streamed)
    reserve = streamed_reserve(needs[persistent:], slots, chunk_size)
    return sum(n.device_bytes for n in needs[:persistent]) + reserve > budgets.device


def _default_persistent(
    needs: Sequence[ChunkNeeds], chunk_size: int, min_buffers: int, budgets: Budgets, buffers: int | None
) -> int:
    half = budgets.device // 2
    if sum(n.device_bytes for n in needs) <= half:
        return len(needs)
    used = 0
    for count, need in enumerate(needs):
        streamed = len(needs) - count - 1
        slots = buffers if buffers is not None else default_buffers(min_buffers, streamed)
        reserve = streamed_reserve(needs[count + 1 :], slots, chunk_size)
        if used + need.device_bytes > half or used + need.device_bytes + reserve > budgets.device:
            return count
        used += need.device_bytes
    return len(needs)


def gradients_at_once(grads_stream: bool, grad_home: str, staged: int, via_host: bool = True) -> int | None:
    """Rule 3: NVMe chunks' gradients on the host at once: two streamed ones (none when they do
    not pass through the host, ``via_host`` False), ``staged`` stored on NVMe, or None when they
    all wait on the host."""
    if grads_stream:
        return STAGED_HOMES if via_host else 0
    return staged if grad_home == "nvme" else None


def nvme_grad_bytes(
    nvme_needs: Sequence[ChunkNeeds], passing: int | None, chunk_size: int, span: int | None = None
) -> int:
    """Rule 3: host bytes the NVMe chunks' gradients take at their peak: all of them when they
    wait on the host (``passing`` None), else ``passing`` chunks' at once. Rule 6: a chunk that
    steps in slices (of ``span`` bytes; None: the chunk size) keeps its gradients on NVMe and
    stages two slices' at a time."""
    sliced = STAGED_HOMES * max(
        (n.staged_grad_bytes(chunk_size, span) for n in nvme_needs if n.sliced(chunk_size)), default=0
    )
    whole = [n.grad_bytes for n in nvme_needs if not n.sliced(chunk_size)]
    if passing is not None:
        return max(passing * max(whole, default=0), sliced)
    return sum(whole) + sliced


def nvme_bytes(nvme_needs: Sequence[ChunkNeeds], grad_home: str, chunk_size: int) -> int:
    """Rules 3 and 6: NVMe bytes of the NVMe chunks: homes, and gradients that wait there."""
    waiting = [n for n in nvme_needs if grad_home == "nvme" or n.sliced(chunk_size)]
    return sum(n.home_bytes for n in nvme_needs) + sum(n.grad_bytes for n in waiting)


def staging_bytes(
    nvme_needs: Sequence[ChunkNeeds], chunk_size: int, span: int | None = None, staged: int = STAGED_HOMES
) -> int:
    """Rules 3 and 6: host room to stage ``staged`` trainable NVMe homes for the step, or two
    slices of ``span`` bytes (None: the chunk size) of those that step in slices."""
    whole = max((n.staged_home_bytes(chunk_size) for n in nvme_needs if not n.sliced(chunk_size)), default=0)
    sliced = max((n.staged_home_bytes(chunk_size, span) for n in nvme_needs if n.sliced(chunk_size)), default=0)
    return max(staged * whole, STAGED_HOMES * sliced)


def _homes(
    needs: Sequence[ChunkNeeds],
    persistent: int,
    budgets: Budgets,
    request: tuple[str, ...] | str | None,
    chunk_size: int,
    staged: int = STAGED_HOMES,
    passing: int | None = None,
) -> tuple[str, ...]:
    """Rule 3's homes; ``staged``: NVMe homes staged at once; ``passing``: NVMe chunks'
    gradients on the host at once (None: all of them wait there, :func:`nvme_grad_bytes`)."""
    total = len(needs)
    if isinstance(request, tuple):
        if len(request) != total:
            raise PlanError(f"tiermem plan: state_home lists {len(request)} chunks but the model packs into {total}")
        wrong = [i for i, home in enumerate(request) if (home == "device") != (i < persistent)]
        if wrong:
            raise PlanError(
                f"tiermem plan: state_home of chunk(s) {wrong} contradicts persistent_chunks={persistent}: the first "
                "persistent_chunks chunks keep their states on the device ('device') and the others on 'host' or "
                "'nvme' (persistent chunks with offloaded states come in a later step)"
            )
        return request
    streamed = list(range(persistent, total))
    if request is not None:
        return ("device",) * persistent + (request,) * len(streamed)
    # Rule 3: greedily on the host, then give back host homes (last first) until the host
    # also holds the NVMe chunks' gradients and two staged NVMe homes.
    homes = ["device"] * persistent
    host_free = budgets.host
    for i in streamed:
        need = needs[i]
        if need.home_bytes + need.grad_bytes <= host_free:
            homes.append("host")
            host_free -= need.home_bytes + need.grad_bytes
        else:
            homes.append("nvme")
            if passing is None:
                host_free -= need.grad_bytes

    def staging() -> int:
        nvme = [needs[i] for i in streamed if homes[i] == "nvme"]
        through = nvme_grad_bytes(nvme, passing, chunk_size) if passing is not None else 0
        return staging_bytes(nvme, chunk_size, staged=staged) + through

    for i in reversed(streamed):
        if host_free >= staging():
            break
        if homes[i] == "host":
            homes[i] = "nvme"
            host_free += needs[i].home_bytes + (needs[i].grad_bytes if passing is not None else 0)
    return tuple(homes)


def _check_fits(
    needs: Sequence[ChunkNeeds],
    persistent: int,
    buffers: int,
    chunk_size: int,
    homes: Sequence[str],
    budgets: Budgets,
    grads_stream: bool = False,
    grad_home: str = "host",
    staged: int = STAGED_HOMES,
    recomputed: bool = False,
    grads_via_host: bool = True,
) -> None:
    """Rule 5: refuse, with the numbers, a plan that does not fit the free bytes; ``recomputed``:
    its buffers are the fewest a recomputed block needs (rule 4), which the refusal says."""
    large = sorted(oversized_chunks(needs[persistent:], chunk_size), reverse=True)[:buffers]
    device = sum(n.device_bytes for n in needs[:persistent]) + streamed_reserve(needs[persistent:], buffers, chunk_size)
    host_homes = [n for n, h in zip(needs, homes, strict=True) if h == "host"]
    nvme_homes = [n for n, h in zip(needs, homes, strict=True) if h == "nvme"]
    passing = gradients_at_once(grads_stream, grad_home, staged, grads_via_host)
    host = _host_bytes(needs, homes, passing, staged, chunk_size)
    nvme = nvme_bytes(nvme_homes, grad_home, chunk_size)
    if grad_home == "nvme":
        waiting = f"{_count(staged, 'NVMe chunk', 'gradients')} staged"
    elif grads_stream:
        waiting = "two NVMe chunks' gradients passing through" if passing else "no NVMe chunk's gradients"
    else:
        waiting = "gradients of the NVMe chunks"
    problems = []
    if device > budgets.device:
        problems.append(
            f"the device needs {format_size(device)} ({persistent} persistent chunks with their gradients and "
            f"optimizer states, plus {buffers} streaming buffers of {format_size(chunk_size)}{_own_slots(large)} for "
            f"parameters, and gradient buffers for the trainable ones) but has {format_size(budgets.device)} free"
            + (
                f"; {buffers} buffers because a block whose activations may be recomputed runs its forward again "
                "inside backward beside the chunk backward holds (a block under activations='keep' is never "
                "recomputed)"
                if recomputed
                else ""
            )
        )
    if host > budgets.host:
        whole = [n.home_bytes for n in nvme_homes if n.trainable and n.nbytes > chunk_size and not n.sliceable]
        staging = _count(staged, "trainable NVMe home")
        if any(n.sliced(chunk_size) for n in nvme_homes):
            staging += " or two slices of those that step in slices"
        if whole:  # rule 6: a chunk too large to stage whole steps in slices only when its optimizer is element-wise
            staging += (
                f", whole for {len(whole)} chunk(s) larger than the chunk size (homes up to "
                f"{format_size(max(whole))}): their optimizer's state is not element-wise, so they step whole"
            )
        problems.append(
            f"the host needs {format_size(host)} (homes of {len(host_homes)} chunks with their gradients, {waiting} "
            f"and room to stage {staging}) but has {format_size(budgets.host)} free"
        )
    if nvme > budgets.nvme:
        problems.append(f"NVMe needs {format_size(nvme)} but has {format_size(budgets.nvme)} free")
    if problems:
        raise StatesMemoryError(
            "tiermem model states do not fit: "
            + "; ".join(problems)
            + ". Raise the tier capacities, give plan= a smaller chunk_size or fewer persistent_chunks/buffers, "
            "or move states to 'nvme'."
        )


def _host_bytes(
    needs: Sequence[ChunkNeeds],
    homes: Sequence[str],
    passing: int | None,
    staged: int,
    chunk_size: int,
    span: int | None = None,
) -> int:
    """Rule 3: host bytes of ``homes``: host homes with their gradients, the NVMe chunks'
    gradients (``passing`` at once when they only pass through, :func:`nvme_grad_bytes`) and
    room to stage ``staged`` trainable NVMe homes (rule 6: two slices of ``span`` bytes of those
    that step in slices)."""
    host_homes = [n for n, h in zip(needs, homes, strict=True) if h == "host"]
    nvme_homes = [n for n, h in zip(needs, homes, strict=True) if h == "nvme"]
    through = nvme_grad_bytes(nvme_homes, passing, chunk_size, span)
    staging = staging_bytes(nvme_homes, chunk_size, span, staged)
    return sum(n.home_bytes + n.grad_bytes for n in host_homes) + through + staging


def _count(number: int, noun: str, owned: str = "") -> str:
    """``number`` ``noun`` s in words, for a refusal: "one NVMe home", "two NVMe chunks' gradients"."""
    words = {1: "one", 2: "two"}.get(number, str(number))
    if not owned:
        return f"{words} {noun if number == 1 else noun + 's'}"
    possessive = f"{noun}'s" if number == 1 else f"{noun}s'"
    return f"{words} {possessive} {owned}"


def _own_slots(large: Sequence[int]) -> str:
    """Rule 1's slots sized to an outlier's own chunk, for a refusal."""
    if not large:
        return ""
    sizes = ", ".join(format_size(b) for b in large)
    return f" ({len(large)} of them sized to a parameter in a chunk of its own: {sizes})"


def normalize_chunk_size(size: int) -> int:
    return round_up(size, ALIGNMENT)
