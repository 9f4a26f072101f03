"""The chunk objects that hold a model's parameter bytes, laid out by
:mod:`tiermem.layout.chunks` (NOTE [ Chunk layout rules ] is there).
"""

from __future__ import annotations

import contextlib

import torch

from tiermem.layout.chunks import ChunkLayout
from tiermem.registry import Handle, Transfer
from tiermem.states.access import GuardedParameter


class Chunk:
    """One chunk at run time: its own device storage and the handles of its other copies.

    ``data`` is the chunk's device storage (TRAPS 2: one storage per chunk, never shared,
    released with ``untyped_storage().resize_(0)`` and refilled in place). ``dev`` accounts
    it in the device tier while it holds bytes. ``home`` is the registry object holding
    the master parameters followed by the optimizer-state sections (offloaded chunks), or
    only the state sections (device-homed chunks). ``grad`` is the gradient chunk.
    """

    def __init__(
        self,
        layout: ChunkLayout,
        *,
        persistent: bool,
        home: str,
        sections: int,
        device: torch.device,
        master_scale: int = 1,
    ):
        self.layout = layout
        #: fp32 master bytes per working byte (rule 6): 1 without mixed precision
        self.master_scale = master_scale
        self.index = layout.index
        self.nbytes = layout.nbytes
        self.persistent = persistent
        #: "device" | "host" | "nvme": where the master parameters and states live.
        self.home_tier = home
        #: optimizer-state tensors per parameter stored in ``home`` (0: frozen or not optimized)
        self.sections = sections
        # Full size at first: views can only be made over bytes that exist. The manager makes
        # the parameters' views, then empties a streamed chunk's storage (TRAPS 2).
        self.data = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.dev: Handle | None = None
        self.fetching: Transfer | None = None
        self.home: Handle | None = None
        self.grad: Handle | None = None
        #: "host" | "nvme": where an offloaded chunk's gradients wait for the step (NOTE
        #: [ Stored gradients ] rule 1; the store sets it from the plan)
        self.grad_home = "host"
        #: the bytes of the slices its step runs over (NOTE [ Sliced steps ] in ``chunk_step.py``),
        #: or None: it steps whole (the store sets it from the plan)
        self.slice_span: int | None = None
        #: the bytes its gradient buffer's block holds on the device, where that is more than its
        #: own (NOTE [ Spare tier blocks ] rule 6 in ``tiers/memory.py``; the store sets it)
        self.grad_room = 0
        #: modules running forward with it, plus uses pinned through backward (``pins``)
        self._pins = 0
        #: its parameters while guarded (NOTE [ Parameter access ] rule 2 in ``access.py``)
        self._guarded: tuple[torch.Tensor, ...] = ()
        self.last_use = 0
        #: the device copy holds bytes newer than the master (load_state_dict)
        self.dirty = False
        #: copies still reading the device storage outside any move (a shadow's working bytes:
        #: NOTE [ Speculative steps ] rule 3 in ``speculation.py``); emptying it waits for them
        self.readers: list[Transfer] = []
        #: its backward began in the current backward pass
        self.entered = False
        #: trainable parameters used since the last backward whose gradient has not arrived
        self.pending: set[int] = set()

    def storage_tensor(self) -> torch.Tensor:
        """Every byte of the device storage as one uint8 tensor (what the device tier accounts:
        a streamed chunk's storage may hold more than ``nbytes``, NOTE [ Spare chunk storage ])."""
        return torch.empty(0, dtype=torch.uint8, device=self.data.device).set_(self.data.untyped_storage())

    def empty_storage(self, *, keep: bool = False) -> torch.UntypedStorage | None:
        """``resize_(0)`` the device storage (TRAPS 2) once nothing reads it any more: its home
        may be being staged with its bytes copied from here (registry rule 6; NOTE [ Declared
        steps ] rule 7), and freed memory must never be read (TRAPS 24), nor reused. With
        ``keep``, the bytes move to a new storage object, returned (NOTE [ Spare chunk
        storage ] in ``pool.py``), and this storage is left empty the same way."""
        if self.home is not None:
            self.home.wait_known_copy()
        readers, self.readers = self.readers, []
        for transfer in readers:
            with contextlib.suppress(Exception):  # its owner waits for it too, and sees its error
                transfer.wait()
        storage = self.data.untyped_storage()
        if keep and storage.nbytes():
            spare = torch.UntypedStorage(0, device=storage.device)
            spare._swap_data_ptr_(storage)
            return spare
        storage.resize_(0)
        return None

    @property
    def pins(self) -> int:
        """Uses holding the chunk resident now: modules running forward with it, uses pinned
        through backward, an op on a guarded parameter (NOTE [ Parameter access ] rule 2)."""
        return self._pins

    @pins.setter
    def pins(self, count: int) -> None:
        if self._guarded and (count > 0) != (self._pins > 0):
            _set_class(self._guarded, torch.nn.Parameter if count > 0 else GuardedParameter)
        self._pins = count

    def guard(self, params: list[torch.Tensor]) -> None:
        """Guard ``params`` (this chunk's) whenever nothing pins it (NOTE [ Parameter access ] rule 2)."""
        self._guarded = tuple(params)
        if self._pins == 0:
            _set_class(self._guarded, GuardedParameter)

    def unguard(self) -> None:
        """Its parameters are plain ``nn.Parameter`` again, for good."""
        if self._guarded:
            _set_class(self._guarded, torch.nn.Parameter)
        self._guarded = ()

    @property
    def trainable(self) -> bool:
        return self.layout.trainable

    @property
    def offloaded(self) -> bool:
        return self.home_tier != "device"

    @property
    def resident(self) -> bool:
        return self.dev is not None

    @property
    def has_master(self) -> bool:
        """The home holds the master parameters (offloaded, or fp32 masters of working chunks)."""
        return self.offloaded or self.master_scale > 1

    def section_base(self, k: int) -> int:
        """Where optimizer-state section ``k`` starts in ``home`` (after the master, if it has one)."""
        return (k + (1 if self.has_master else 0)) * self.nbytes * self.master_scale

    @property
    def working_base(self) -> int:
        """Where the device fetches the working parameters from in an offloaded home (rule 6)."""
        if self.master_scale == 1:
            return 0
        return (self.sections + 1) * self.nbytes * self.master_scale

    @property
    def home_bytes(self) -> int:
        return Chunk.home_size(self.nbytes, self.sections, self.master_scale, self.offloaded)

    @staticmethod
    def home_size(nbytes: int, sections: int, master_scale: int, offloaded: bool) -> int:
        """The bytes of the home of a chunk of ``nbytes`` with ``sections`` optimizer-state
        sections (:attr:`home_bytes`, known before the chunk is made)."""
        has_master = offloaded or master_scale > 1
        working = nbytes if offloaded and master_scale > 1 else 0
        return nbytes * master_scale * (sections + (1 if has_master else 0)) + working

    def __repr__(self) -> str:
        kind = "trainable" if self.trainable else "frozen"
        where = "persistent" if self.persistent else ("resident" if self.resident else "released")
        params = len(self.layout.slots)
        return f"Chunk#{self.index}({kind}, {params} params, {self.nbytes} bytes, {where}, home {self.home_tier})"


def _set_class(params: tuple[torch.Tensor, ...], cls: type) -> None:
    for p in params:
        p.__class__ = cls
