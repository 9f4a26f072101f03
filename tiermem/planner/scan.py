"""The search's scan and pick (NOTE [ Plan search ] rules 1-3, in
:mod:`tiermem.planner.search`): every states choice at some capacities with the fastest
activation front entry it can take (a separable estimate), then the fastest candidates
predicted again in full. Memoised in a :class:`Space`, which the raises of rules 4 and 5
(:mod:`tiermem.planner.no_fit`) scan again at other capacities. Pure."""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tiermem.layout.placement import GRAD_HOMES, STAGED_HOMES, STAGING_DEPTHS
from tiermem.planner.candidates import ActivationCandidate, activation_candidates, packings, pareto
from tiermem.planner.costmodel import (
    TIERS,
    Estimate,
    Packing,
    StatesChoice,
    StatesCost,
    predict,
    states_cost,
    states_overhead_s,
)
from tiermem.planner.profile import Profile

FINALISTS = 24
"""Rule 3."""
MAX_EXACT = 2000
"""Rule 3: full predictions at most (each costs O(blocks + chunks))."""


@dataclass(frozen=True)
class Row:
    """One states choice the scan evaluated at some capacities (rule 4 reads them back)."""

    key: tuple[int, int, int, int]  # packing index, persistent, buffers, host_end
    choice: StatesChoice
    states: StatesCost
    time: float
    #: device bytes left for activations at forward's end under the separable bound; -1: the
    #: gradients do not fit
    room: float
    fits_reserve: bool
    #: of ``room``, what backward leaves beside the streamed gradients in flight (NOTE [ Cost model ] rule 1)
    backward_room: float = -1.0


@dataclass
class Scan:
    """The rows of one scan at ``caps`` (rules 1 and 2), and the closest miss when none fits."""

    caps: Mapping[str, int]
    rows: list[Row]
    #: (separable time, tie, row, front index): one per row whose fastest room-fitting entry
    #: (walking down to the first whose host and NVMe bytes fit) exists
    feasible: list[tuple[float, int, Row, int]]
    closest: tuple[float, StatesChoice, ActivationCandidate] | None


class Space:
    """The candidates of rules 1 and 2, which do not depend on the capacities, with the states
    costs and full predictions computed so far: rule 4 scans again at raised capacities and
    reuses them."""

    def __init__(
        self,
        profile: Profile,
        *,
        chunk_sizes: Sequence[int] | None,
        margin: float,
        block_policy: str | Sequence[str] | None,
        grads_stream: bool,
        grad_homes: Sequence[str] = GRAD_HOMES,
        staged_homes: Sequence[int] = STAGING_DEPTHS,
    ) -> None:
        self.profile = profile
        self.margin = margin
        self.front = pareto(activation_candidates(profile, block_policy))
        self.front_keys = [(a.device, a.time, i) for i, a in enumerate(self.front)]
        self.front_devices = [a.device for a in self.front]
        # Rule 2: a row takes the fastest entry within its room whose host and NVMe bytes fit.
        by_time = sorted(range(len(self.front)), key=lambda i: (self.front[i].time, self.front[i].device))
        self._by_time = np.array(by_time, dtype=np.int64)
        self._by_time_bytes = np.array(
            [(self.front[i].device, self.front[i].host, self.front[i].nvme, self.front[i].backward) for i in by_time],
            dtype=np.float64,
        ).reshape(-1, 4)
        self.packings = packings(profile, chunk_sizes, grads_stream, grad_homes, staged_homes)
        self._memcpy_bw = profile.memcpy_bw or math.inf
        self._read_bw = profile.links.get("nvme->device") or math.inf
        self._compute_s = profile.compute_s
        self._states: dict[tuple[int, int, int, int], tuple[StatesChoice, StatesCost, float]] = {}
        self._exact: dict[tuple[tuple[int, int, int, int], int], Estimate] = {}
        self._pareto: list[tuple[tuple[int, int], ...]] | None = None
        self._host_steps: dict[int, tuple[list[int], list[int]]] = {}
        self._choices: dict[int, list[tuple[tuple[int, int, int, int], StatesChoice, StatesCost, float]]] = {}

    def states(self, key: tuple[int, int, int, int]) -> tuple[StatesChoice, StatesCost, float]:
        """A states choice, its cost and its separable time (memoised)."""
        hit = self._states.get(key)
        if hit is None:
            k, persistent, buffers, host_end = key
            profile = self.profile
            choice = StatesChoice(self.packings[k], persistent, buffers, host_end)
            states = states_cost(profile, choice, timeline=False)
            memcpy_bw = self._memcpy_bw
            nvme_reads = states.nvme_read_forward + states.nvme_read_backward
            time = (
                states.optimizer_s
                + states.memcpy_bytes / memcpy_bw
                + (nvme_reads + states.nvme_step_bytes) * (1 / memcpy_bw if profile.cpu else 0.0)
                + max(0.0, nvme_reads / self._read_bw - self._compute_s)
                + states_overhead_s(profile, states.streamed_chunks)
            )
            hit = self._states[key] = (choice, states, time)
        return hit

    def exact(self, row: Row, index: int) -> Estimate:
        """Rule 3's full prediction of a row with front entry ``index`` (memoised)."""
        estimate = self._exact.get((row.key, index))
        if estimate is None:
            estimate = predict(self.profile, row.choice, self.front[index].policies)
            self._exact[(row.key, index)] = estimate
        return estimate

    def choices(self, host_usable: int) -> list[tuple[tuple[int, int, int, int], StatesChoice, StatesCost, float]]:
        """Rule 1 at a host budget: every states choice (its key, cost and separable time);
        memoised, since only the host budget moves host_end."""
        hit = self._choices.get(host_usable)
        if hit is None:
            hit = []
            for k, packing in enumerate(self.packings):
                n = packing.chunks
                for persistent in range(n + 1):
                    streamed = n - persistent
                    low = min(packing.min_buffers, streamed)
                    options = {low, min(packing.min_buffers + 1, streamed), streamed} if streamed else {0}
                    host_end = packing.host_end(persistent, host_usable) if streamed else n
                    if host_end == n and packing.staged_homes != STAGED_HOMES:
                        continue  # no NVMe home to stage: the same choice as with the default staging
                    for buffers in sorted(options):
                        key = (k, persistent, buffers, host_end)
                        hit.append((key, *self.states(key)))
            self._choices[host_usable] = hit
        return hit

    def scan(self, caps: Mapping[str, int]) -> Scan:
        """Rules 1 and 2 at ``caps``: every states choice, and the front entry each can take."""
        usable = {t: caps[t] / (1 + self.margin) for t in TIERS}
        front = self.front
        rows: list[Row] = []
        feasible: list[tuple[float, int, Row, int]] = []
        closest: tuple[float, StatesChoice, ActivationCandidate] | None = None
        for key, choice, states, states_time in self.choices(int(usable["host"])):
            # The separable bound (NOTE [ Cost model ] rule 1): no gradient exists at forward's
            # end; in backward the streamed ones in flight coexist with the activations' stages.
            room = usable["device"] - states.static_device
            backward_room = room - states.grad_in_flight
            room = room if states.grad_total <= backward_room else -1
            fits_reserve = states.reserve_device_bytes <= caps["device"]
            row = Row(key, choice, states, states_time, room, fits_reserve, backward_room)
            rows.append(row)
            index = self._fastest_fitting(room, usable, states, backward_room) if fits_reserve else -1
            if index >= 0:
                feasible.append((states_time + front[index].time, len(feasible), row, index))
            else:
                least = front[0]
                backward = states.grad_in_flight + max(least.backward, states.grad_total)
                device = states.static_device + max(least.device, backward)
                over = overshoot(
                    device,
                    states.host_bytes + least.host,
                    states.nvme_bytes + least.nvme,
                    usable,
                )
                over = max(over, states.reserve_device_bytes / max(caps["device"], 1))
                if closest is None or over < closest[0]:
                    closest = (over, choice, least)
        return Scan(caps, rows, feasible, closest)

    def _fastest_fitting(
        self, room: float, usable: Mapping[str, float], states: StatesCost, backward_room: float
    ) -> int:
        """The front index of the fastest entry within ``room`` (its backward within
        ``backward_room``) whose host and NVMe bytes fit beside ``states``'; -1 when none does."""
        if not len(self._by_time):
            return -1
        limits = np.array(
            [int(room), usable["host"] - states.host_bytes, usable["nvme"] - states.nvme_bytes, int(backward_room)],
            dtype=np.float64,
        )
        fitting = np.all(self._by_time_bytes <= limits, axis=1)
        first = int(np.argmax(fitting))
        return int(self._by_time[first]) if fitting[first] else -1

    def pick(
        self, scan: Scan, caps: Mapping[str, int], enough: int = FINALISTS
    ) -> tuple[tuple[float, int, Row, int, Estimate] | None, list[tuple[Row, int, Estimate]]]:
        """Rule 3: the fastest of the first ``enough`` feasible candidates that fit in full, and
        the candidates that did not fit before it stopped."""
        best: tuple[float, int, Row, int, Estimate] | None = None
        failed: list[tuple[Row, int, Estimate]] = []
        fitting = 0
        for _, _, row, index in heapq.nsmallest(MAX_EXACT, scan.feasible):
            estimate = self.exact(row, index)
            if not estimate.fits(caps, self.margin):
                failed.append((row, index, estimate))
                continue
            key = (estimate.step_s, estimate.peak_bytes["device"])
            if best is None or key < (best[0], best[1]):
                best = (estimate.step_s, estimate.peak_bytes["device"], row, index, estimate)
            fitting += 1
            if fitting >= enough:
                break
        return best, failed

    def fits(self, caps: Mapping[str, int]) -> tuple[bool, Scan, list[tuple[Row, int, Estimate]]]:
        """Whether ``search`` at ``caps`` returns a plan (the same scan and pick, stopping at
        the first fit)."""
        scan = self.scan(caps)
        best, failed = self.pick(scan, caps, enough=1)
        return best is not None, scan, failed

    def least_host_end(self, packing: Packing, persistent: int, nvme_room: float, host: int) -> int | None:
        """The least host_end at which the streamed chunks' NVMe homes fit ``nvme_room`` and the
        host capacity that makes the scan take it holds ``host`` more bytes (None: none)."""
        if nvme_room < 0:
            return None
        n = packing.chunks
        if persistent == n:
            return n
        homes = packing._home
        end = bisect.bisect_left(homes, homes[n] - nvme_room, persistent, n + 1)
        steps = self._host_steps.get(id(packing))
        if steps is None:
            # host_bytes(p, h + 1) - host_bytes(p, h) does not depend on p, and its suffix maxima
            bytes_at = [packing.host_bytes(0, h) for h in range(n + 1)]
            increments = [bytes_at[h + 1] - bytes_at[h] for h in range(n)]
            suffix = [0] * (n + 1)
            for h in range(n - 1, -1, -1):
                suffix[h] = max(suffix[h + 1], increments[h])
            steps = self._host_steps[id(packing)] = (increments, suffix)
        increments, suffix = steps
        if suffix[end] <= host:
            return n
        while increments[end] <= host:
            end += 1
        return end

    def front_pareto(self) -> list[tuple[tuple[int, int], ...]]:
        """Per front prefix ``0..i``: the (NVMe bytes, host bytes) pairs no other entry of the
        prefix beats on both."""
        if self._pareto is None:
            result: list[tuple[tuple[int, int], ...]] = []
            current: list[tuple[int, int]] = []
            for act in self.front:
                point = (act.nvme, act.host)
                if not any(n <= point[0] and h <= point[1] for n, h in current):
                    current = [(n, h) for n, h in current if not (point[0] <= n and point[1] <= h)] + [point]
                result.append(tuple(current))
            self._pareto = result
        return self._pareto


def overshoot(device: float, host: float, nvme: float, usable: Mapping[str, float]) -> float:
    return max(device / max(usable["device"], 1), host / max(usable["host"], 1), nvme / max(usable["nvme"], 1))
