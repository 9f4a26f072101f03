"""Access to chunk homes: staging an NVMe home on the host to write it, reading a home's bytes,
and staging one slice of a home for a sliced step (NOTE [ Sliced steps ] in ``chunk_step.py``).

:class:`Homes` owns the cached copy of the last NVMe home read for export (one chunk at a time,
valid for one :meth:`ChunkStore.version <tiermem.states.store.ChunkStore.version>`) and the host
buffers of staged slices (:class:`HomeSlice`). It may touch chunk homes through their handles only
(``move_to``, ``wait``, ``tensor``, ``copy_out``, ``fill_from``: NOTE [ Managed object rules ]),
never a chunk's device storage or gradients. Before it stages, reads or writes a chunk's home it
calls ``fence`` with the chunk, so a step of that chunk still in flight finishes first (NOTE
[ Step threads ] rule 4).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from tiermem.errors import TierCapacityError
from tiermem.registry import Handle, KnownBytes, ObjectState, Priority, Transfer
from tiermem.states.chunks import Chunk
from tiermem.states.errors import StatesMemoryError
from tiermem.states.step_thread import StepThread
from tiermem.states.store import ChunkStore
from tiermem.units import format_size


def wait_every(transfers: list[Transfer]) -> None:
    """Wait for each of ``transfers`` (the others still touch their buffers when one fails), then
    raise the first one's error."""
    error: BaseException | None = None
    for transfer in transfers:
        try:
            transfer.wait()
        except BaseException as exc:  # noqa: BLE001 - raised once every transfer ended
            error = error or exc
    if error is not None:
        raise error


@dataclasses.dataclass(eq=False)
class HomeSlice:
    """Bytes ``[lo, hi)`` of a chunk's parameter space staged on the host for a sliced step: the
    range of every section of its NVMe home (master, optimizer states, and the working copy under
    mixed precision), laid out as the home of a chunk of ``hi - lo`` bytes would be, then room for
    the range's gradients when they are copied in (NOTE [ Sliced steps ] rule 2)."""

    lo: int
    hi: int
    #: fp32 master bytes per working byte (NOTE [ Chunk layout rules ] rule 6)
    scale: int
    #: sections of the home before the working copy: the master and each optimizer state
    sections: int
    #: the home ends with a working copy (mixed precision)
    working: bool
    #: the host buffer, registered on the host tier
    handle: Handle
    #: copies into (reads) or out of (write-backs) the buffer still in flight
    transfers: list[Transfer] = dataclasses.field(default_factory=list)

    @property
    def span(self) -> int:
        return self.hi - self.lo

    @property
    def home_bytes(self) -> int:
        """Bytes of the slice's home (its gradients' room follows)."""
        return self.sections * self.span * self.scale + (self.span if self.working else 0)

    def section_base(self, k: int) -> int:
        """Where optimizer-state section ``k`` starts in :meth:`home` (after the master)."""
        return (k + 1) * self.span * self.scale

    @property
    def working_base(self) -> int:
        return self.sections * self.span * self.scale

    def ranges(self, chunk: Chunk) -> list[tuple[int, int, int]]:
        """(offset in ``chunk``'s home, offset here, bytes) of every section's range."""
        size, span, scale = chunk.nbytes * self.scale, self.span, self.scale
        out = [(k * size + self.lo * scale, k * span * scale, span * scale) for k in range(self.sections)]
        if self.working:
            out.append((chunk.working_base + self.lo, self.working_base, span))
        return out

    def home(self) -> torch.Tensor:
        return self.handle.tensor("host")[: self.home_bytes]

    def grads(self) -> torch.Tensor:
        """The room for the range's gradients (filled by :class:`~tiermem.states.gradients.Gradients`)."""
        return self.handle.tensor("host")[self.home_bytes : self.home_bytes + self.span]


class Homes:
    """Reads and writes of the homes of ``store``'s chunks."""

    def __init__(self, store: ChunkStore, steps: StepThread) -> None:
        self.store = store
        #: where chunk steps compute: a home is touched only once its chunk's step has finished
        self.steps = steps
        self._read_cache: tuple[int, tuple[int, int], torch.Tensor] | None = None

    def fence(self, chunk: Chunk) -> None:
        """NOTE [ Step threads ] rule 4: ``chunk``'s step in flight, if any, finishes first."""
        self.steps.wait_for(chunk.index)

    def forget(self) -> None:
        """Drop the cached home read (its chunk changed, or the chunks were rebuilt)."""
        self._read_cache = None

    def wait_moves(self, skip: Chunk | None = None) -> None:
        """Wait until no home but ``skip``'s is moving: write-backs of NVMe homes free the
        host bytes they were staged in when they land."""
        for other in self.store.chunks:
            if other.home is not None and other is not skip and other.home.state is ObjectState.MOVING:
                other.home.wait()

    def wait_write_back(self, skip: Chunk | None = None) -> bool:
        """Wait for the first home (in chunk order) on its way back to NVMe but ``skip``'s; False
        when none is: waiting frees nothing then."""
        for other in self.store.chunks:
            home = other.home
            if other is skip or home is None or home.state is not ObjectState.MOVING:
                continue
            if home.obj.target_tier == "nvme":  # a read frees nothing
                home.wait()
                return True
        return False

    def stage(self, chunk: Chunk, known: KnownBytes | None = None) -> None:
        """Bring an NVMe home to the host for writing (DEMAND) and wait for it; ``known``: what
        memory holds of it already (NOTE [ Managed object rules ] rule 6). With no room, the
        write-backs in flight land first, one at a time until it fits."""
        self.fence(chunk)
        handle = chunk.home
        assert handle is not None
        # Earlier homes' write-backs free host memory when they land (the plan has room for its
        # staged_homes: NOTE [ Default placement rule ] rule 3). One at a time: the read starts as
        # soon as one landed frees enough, not after the last one queued (the plain loop's step
        # phase waited for two or three write-backs before every third read).
        while True:
            try:
                handle.move_to("host", Priority.DEMAND, known)
                break
            except TierCapacityError:
                if self.wait_write_back(skip=chunk):
                    continue
            try:  # none in flight: the last may have landed since the refusal
                handle.move_to("host", Priority.DEMAND, known)
                break
            except TierCapacityError as exc:
                what = f"staging chunk {chunk.index}'s NVMe home on the host"
                raise StatesMemoryError.tier_full(exc, what) from exc
        handle.wait()

    def copy_to_host(self, chunk: Chunk, priority: Priority, *, from_device: bool) -> tuple[Handle, list[Transfer]]:
        """A new host object filled from ``chunk``'s NVMe home, which stays where it rests
        (NOTE [ Speculative steps ] rule 3): the object and its fills, still in flight. With
        ``from_device`` the working bytes come from the chunk's device copy (the caller vouches it
        holds them as fetched, as NOTE [ Managed object rules ] rule 6 asks), the rest from NVMe.
        :class:`TierCapacityError` when the host has no room for it now."""
        handle = chunk.home
        assert handle is not None
        handle.wait()  # read from the home where it rests, never from a move's source
        copy = self.store.registry.make(
            "host", chunk.home_bytes, kind="chunk", label="chunk home", room=self.store.staged_home_room
        )
        fills: list[Transfer] = []
        try:
            if from_device and chunk.dev is not None:
                lo, hi = chunk.working_base, chunk.working_base + chunk.nbytes
                fills.append(copy.fill_from(chunk.dev, nbytes=chunk.nbytes, offset=lo, priority=priority))
                chunk.readers.append(fills[-1])  # the device storage stays until this copy ended
                ranges = [(0, lo), (hi, chunk.home_bytes)]
            else:
                ranges = [(0, chunk.home_bytes)]
            for start, end in ranges:
                if end > start:
                    fills.append(
                        copy.fill_from(handle, nbytes=end - start, source_offset=start, offset=start, priority=priority)
                    )
        except BaseException:
            with contextlib.suppress(Exception):  # the error above is the one to report
                wait_every(fills)
            copy.free()
            raise
        return copy, fills

    def send_back(self, chunk: Chunk, after: Future[None] | None = None) -> None:
        """Write a staged NVMe home back (WRITEBACK); ``after``: once the step computing in it
        ended (NOTE [ Step threads ] rule 7)."""
        assert chunk.home is not None
        chunk.home.move_to("nvme", Priority.WRITEBACK, after=after)
        self._read_cache = None

    @contextlib.contextmanager
    def on_host(self, chunk: Chunk, known: KnownBytes | None = None) -> Iterator[torch.Tensor]:
        """An NVMe home staged on the host for writing (:meth:`stage`), and written back after."""
        self.stage(chunk, known)
        assert chunk.home is not None
        try:
            yield chunk.home.tensor("host")
        finally:
            self.send_back(chunk)

    @contextlib.contextmanager
    def writable(self, chunk: Chunk) -> Iterator[torch.Tensor]:
        """A chunk's home bytes to write in place (an NVMe home staged, then written back)."""
        assert chunk.home is not None
        self.fence(chunk)
        if chunk.home_tier == "nvme":
            with self.on_host(chunk) as data:
                yield data
        else:
            chunk.home.wait()
            yield chunk.home.tensor(chunk.home.tier)

    def readable(self, chunk: Chunk) -> torch.Tensor:
        """A chunk's home bytes to read: in place in memory, or read from NVMe (cached per version)."""
        self.fence(chunk)
        handle = chunk.home
        assert handle is not None
        handle.wait()
        if handle.tier != "nvme":
            return handle.tensor(handle.tier)
        cache = self._read_cache
        if cache is not None and cache[0] == chunk.index and cache[1] == self.store.version():
            return cache[2]
        data = handle.copy_out()
        self._read_cache = (chunk.index, self.store.version(), data)
        return data

    # -- NOTE [ Sliced steps ] in chunk_step.py: one slice of an NVMe home at a time ---------------
    def stage_slice(self, chunk: Chunk, lo: int, hi: int, *, grad_room: bool) -> HomeSlice:
        """Start reading bytes ``[lo, hi)`` of every section of ``chunk``'s NVMe home into a new
        host buffer (DEMAND; :meth:`wait_slice` waits), with room for the range's gradients when
        ``grad_room``. Without host room, write-backs in flight land first (rule 2). No fence: the
        caller finished any step of the chunk but its own earlier slices, which touch other bytes
        (rule 2), and one of them computes while the next is read."""
        home = chunk.home
        assert home is not None
        home.wait()  # ranges are read from the home where it rests, never from a move's source
        sections = chunk.sections + 1
        working = chunk.master_scale > 1
        span = hi - lo
        nbytes = sections * span * chunk.master_scale + (span if working else 0) + (span if grad_room else 0)
        handle = self._make_slice(chunk, nbytes)
        piece = HomeSlice(lo, hi, chunk.master_scale, sections, working, handle)
        try:
            for source, offset, count in piece.ranges(chunk):
                piece.transfers.append(handle.fill_from(home, nbytes=count, source_offset=source, offset=offset))
        except BaseException:
            self.free_slice(piece, quiet=True)
            raise
        return piece

    def _make_slice(self, chunk: Chunk, nbytes: int) -> Handle:
        registry = self.store.registry
        try:
            return registry.make("host", nbytes, kind="chunk")  # a kept block (NOTE [ Spare tier blocks ])
        except TierCapacityError:
            self.wait_moves()
            try:
                return registry.make("host", nbytes, kind="chunk")
            except TierCapacityError as exc:
                what = f"chunk {chunk.index}'s NVMe home, read or written {format_size(nbytes)} at a time"
                raise StatesMemoryError.tier_full(exc, what) from exc

    @staticmethod
    def wait_slice(piece: HomeSlice) -> None:
        """Wait until no copy touches ``piece`` any more; then raise the first one's error."""
        transfers, piece.transfers = piece.transfers, []
        wait_every(transfers)

    def write_slice(self, chunk: Chunk, piece: HomeSlice) -> None:
        """Start writing ``piece``'s home ranges back into ``chunk``'s NVMe home (WRITEBACK)."""
        assert chunk.home is not None
        self._read_cache = None
        for target, offset, count in piece.ranges(chunk):
            piece.transfers.append(
                chunk.home.fill_from(
                    piece.handle, nbytes=count, source_offset=offset, offset=target, priority=Priority.WRITEBACK
                )
            )

    def free_slice(self, piece: HomeSlice, *, quiet: bool = False) -> None:
        """Free ``piece``'s buffer once no copy touches it; ``quiet``: after an error, which is the
        one to report (the copies' own are dropped)."""
        try:
            self.wait_slice(piece)
        except Exception:
            if not quiet:
                raise
        finally:
            piece.handle.free()

    def write_range(self, chunk: Chunk, offset: int, data: torch.Tensor, span: int | None = None) -> None:
        """Write ``data`` (bytes in CPU memory) into ``chunk``'s NVMe home at ``offset``, through a
        host buffer of at most ``span`` bytes (None: the chunk's slice span) at a time (NOTE
        [ Sliced steps ] rule 4: a home the plan gives no room to stage whole, written from a state
        import or a checkpoint load)."""
        self.fence(chunk)
        home = chunk.home
        step = span or chunk.slice_span
        assert home is not None and step is not None
        home.wait()
        self._read_cache = None
        flat = data.reshape(-1).view(torch.uint8)
        handle = self._make_slice(chunk, min(step, flat.numel()))
        try:
            buffer = handle.tensor("host")
            for start in range(0, flat.numel(), step):
                count = min(step, flat.numel() - start)
                buffer[:count].copy_(flat[start : start + count])
                home.fill_from(handle, nbytes=count, offset=offset + start, priority=Priority.DEMAND).wait()
        finally:
            handle.free()
