"""What the saved-tensor hooks hand autograd instead of a tensor, and the objects behind them.

A SavedStorage is one storage autograd saved in forward (possibly through several views): it is
moved as one piece, once, and has an explicit state (RecState). A SavedRef is one saved view of
it (dtype, size, stride, byte offset), rebuilt on unpack from wherever the bytes are then. A
ParamView is a saved view of a parameter, rebuilt from the parameter's *current* data (the
runtime rebinds parameter storage between forward and backward). ParamIndex tells which saved
tensors lie inside a parameter or a module buffer (they are never swapped).

Note: dedup. Views of one storage saved at one version are one SavedStorage: the manager finds
it through a StorageWeakRef (hashable by the storage's identity; holding it keeps that identity
from being reused by another storage while the index lives). A storage saved again after an
in-place change (a new version) is a new SavedStorage: autograd itself would refuse the older
save at backward, but the newer one is valid and must not see the older bytes.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Iterable, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from .policy import ActPolicy

if TYPE_CHECKING:
    from concurrent.futures import Future


class ActivationError(RuntimeError):
    """Saved activations cannot be produced as asked; the message names the unit."""


class RecState(enum.Enum):
    DEVICE = "device"  # on the device, held by the record (kept, or waiting for its swap-out job)
    MOVING_OUT = "moving_out"  # device -> host copy in flight (and, for ssd, the put's submission)
    HOST = "host"  # in a host buffer only
    WRITING = "writing"  # host buffer -> SSD in flight; the host buffer is still valid
    ON_SSD = "on_ssd"  # on SSD only
    READING = "reading"  # SSD -> host buffer in flight (on the CPU device, that buffer is device memory)
    STAGING = "staging"  # SSD -> host buffer in flight ahead of the device room (swap.py, Note on staging)
    MOVING_IN = "moving_in"  # host -> device copy in flight (CUDA)
    READY = "ready"  # on the device again, for backward
    RELEASED = "released"


class SavedStorage:
    """One saved storage: its bytes, where they are, and the I/O still in flight on them."""

    __slots__ = (
        "owner", "unit", "policy", "nbytes", "state", "weak", "version", "storage", "base", "host", "key",
        "job", "put", "get", "event", "want_in", "verify", "crc", "refs", "unpacked", "held_device", "held_host",
        "source", "evicted",
    )  # fmt: skip

    def __init__(
        self, unit, policy: ActPolicy, storage: torch.UntypedStorage, weak: StorageWeakRef, version: int
    ):
        self.unit = unit  # the UnitActivations that saved it first
        self.owner: str = unit.name
        self.policy = policy  # KEEP, HOST or SSD
        self.nbytes = storage.nbytes()
        self.state = RecState.DEVICE
        self.weak = weak
        self.version = version
        self.storage: Optional[torch.UntypedStorage] = storage  # where unpack reads, when on the device
        self.base = 0  # byte offset of the saved storage's byte 0 inside `storage`
        self.host: Optional[torch.Tensor] = None  # aligned uint8 host buffer
        self.key: Optional[str] = None  # TensorStore key (ssd)
        self.job: Optional[Future] = None  # the swap-out job on the worker
        self.put = None  # IOFuture of the write
        self.get = None  # IOFuture of the read
        self.event = None  # CUDA event of the copy in flight (either direction)
        self.want_in = False  # backward asked for it while it was moving out
        self.verify: Optional[int] = None  # CRC-32C of the SSD copy under `key` from an earlier step
        self.crc: Optional[int] = None  # CRC-32C of the bytes, when computed
        self.refs = 0  # SavedRefs handed to autograd
        self.unpacked = 0  # of which backward has unpacked
        self.held_device = 0  # bytes this record counts in the device / host accounts
        self.held_host = 0
        # a swapped checkpoint the next piece's argument is derived from: its host copy is kept
        # when it comes back, and it leaves the device again once the argument is made (evicted),
        # until its own piece's recompute (saves.py `_evict_source`)
        self.source = False
        self.evicted = False

    def __repr__(self) -> str:
        return f"SavedStorage({self.owner!r}, {self.policy.value}, {self.nbytes} B, {self.state.value})"

    @property
    def consumed(self) -> bool:
        return self.unpacked >= self.refs


class SavedRef:
    """One saved tensor: a view (dtype, size, stride, byte offset) of a SavedStorage."""

    __slots__ = ("rec", "dtype", "size", "stride", "byte_offset")

    def __init__(self, rec: SavedStorage, t: torch.Tensor):
        self.rec = rec
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.byte_offset = t.storage_offset() * t.element_size()

    def view(self) -> torch.Tensor:
        rec = self.rec
        if rec.storage is None:
            raise ActivationError(
                f"unit {rec.owner!r}: a saved tensor was unpacked while its storage is not on the device ({rec.state.value})"
            )
        off = rec.base + self.byte_offset
        out = torch.empty(0, dtype=self.dtype, device=rec.storage.device)
        return out.set_(rec.storage, off // self.dtype.itemsize, self.size, self.stride)


class ParamView:
    """A saved view of a parameter, by position: unpack reads the parameter's data *then*."""

    __slots__ = ("param", "offset", "size", "stride")

    def __init__(self, param: nn.Parameter, offset: int, t: torch.Tensor):
        self.param = param
        self.offset = offset  # elements from the parameter's first element
        self.size = t.size()
        self.stride = t.stride()

    def unpack(self) -> torch.Tensor:
        cur = self.param.data
        return torch.as_strided(cur, self.size, self.stride, cur.storage_offset() + self.offset)


class ParamIndex:
    """Parameters and buffers of some modules by the address range of their data.

    Rebuilt whenever the set of modules changes or the runtime may have rebound weights (each
    unit's forward entry): a lookup compares storage identity first, then the range, so a
    placeholder (an expanded scalar) never claims bytes it does not own.
    """

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int, int, torch.Tensor, bool]] = []

    def rebuild(self, modules: Iterable[nn.Module]) -> None:
        seen: set[int] = set()
        ranges = []
        for m in modules:
            for t, is_param in [(p, True) for p in m.parameters()] + [(b, False) for b in m.buffers()]:
                if id(t) in seen or t.numel() == 0 or t.layout is not torch.strided:
                    continue
                seen.add(id(t))
                d = t.data if is_param else t
                try:
                    sptr = d.untyped_storage().data_ptr()
                    extent = d.untyped_storage().nbytes() - d.storage_offset() * d.element_size()
                except (RuntimeError, NotImplementedError):  # meta or exotic storage
                    continue
                start = d.data_ptr()
                ranges.append((sptr, start, start + min(d.numel() * d.element_size(), extent), t, is_param))
        self._ranges = ranges

    def match(self, t: torch.Tensor):
        """ParamView for a view of a parameter, the tensor itself for a view of a buffer (the
        module holds that memory anyway), None for anything else."""
        if not self._ranges:
            return None
        sptr = t.untyped_storage().data_ptr()
        ptr = t.data_ptr()
        for s, start, end, owner, is_param in self._ranges:
            if s == sptr and start <= ptr < end:
                if not is_param or t.dtype != owner.dtype:
                    return t
                return ParamView(owner, (ptr - start) // t.element_size(), t)
        return None


def swappable(t: torch.Tensor, device: torch.device) -> bool:
    """A plain strided tensor with bytes on the compute device (anything else is kept as is)."""
    return (
        (type(t) is torch.Tensor or type(t) is nn.Parameter)
        and t.layout is torch.strided
        and t.device == device
        and t.numel() > 0
        and not t.is_meta
    )


def storage_key(t: torch.Tensor) -> tuple[torch.UntypedStorage, StorageWeakRef]:
    st = t.untyped_storage()
    return st, StorageWeakRef(st)
