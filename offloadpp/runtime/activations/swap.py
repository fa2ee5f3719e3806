"""Moving saved storages device -> pinned host -> SSD and back, and accounting the bytes.

Note: who does what. The thread running forward or backward (autograd runs CUDA backward nodes
on its device thread, one at a time with the caller) owns every SavedStorage and changes its
state; one worker thread runs the swap-out jobs in FIFO order: on the CPU acting as the device
the copy itself (a memmove that releases the GIL), elsewhere the wait for the device-to-host copy
issued on a side stream (the accelerator's `copies`); for ssd the job then submits the TensorStore put. The owner notices
finished jobs and I/O at every hook (`pump`), or waits for them when the budget or backward
needs it, and only then changes states and accounts.

Note: the CPU as the device. Device and host memory are then the same RAM and only the
accounting tells them apart: a swap-out is a copy into an aligned host buffer (the device bytes
are released when it is done), a swap-in of a host copy hands that buffer to backward as device
memory without a copy, and an SSD read lands directly in the buffer backward will use.

Note: accounting. A SavedStorage counts its bytes on the device while its bytes there are held
by the manager (DEVICE, MOVING_OUT, MOVING_IN, READY) or are on their way there (READING: the
budget check that started the read counted them; without it a GPU's swap-ins of several reads
finished at once went past the budget, which the stand-in accelerator showed), and on the host
while it holds a host buffer that is not serving as device memory. `peak_device_bytes` is what
the activation budget bounds.

Note: staging. A read bound for the device counts there from its start, so where the device
room holds one unit's records at a time (a large micro-batch's partial units) each unit's SSD
read would run between two units' backward, and backward would wait for all of it. `stage`
starts the read into a host buffer without device room (STAGING, counted on the host only); the
bytes then wait in host memory (HOST) until a fetch within the budget copies them up, or a fetch
while still staging makes the read bound for the device (READING). Only where the device has
memory of its own: on the CPU device host memory is the device's, and the budget is all there is.
The backward side stages the units a prefetch tries next as backward reaches a unit
(backward.py), and the replay does the same (planner/simulate_act.py, _stage_after).
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch
from torch.autograd.profiler import record_function
from torch.multiprocessing.reductions import StorageWeakRef

from offloadpp.io import ALIGNMENT, aligned_empty, crc32c

from ..accel import Accelerator
from ..memory import BufferPool
from .records import ActivationError, RecState, SavedStorage

_DEVICE_STATES = (RecState.DEVICE, RecState.MOVING_OUT, RecState.MOVING_IN, RecState.READY)
_HOST_STATES = (
    RecState.MOVING_OUT, RecState.HOST, RecState.WRITING, RecState.READING, RecState.STAGING, RecState.MOVING_IN,
)  # fmt: skip
UNLIMITED = 1 << 62
_instances = itertools.count()


def _align(n: int) -> int:
    return max(ALIGNMENT, -(-n // ALIGNMENT) * ALIGNMENT)


class _HostMover:
    """The CPU as the device (`copies` False): a device storage's bytes are copied to the host
    buffer by the worker; the host buffer itself serves as device memory coming back."""

    copies = False

    def out(self, worker, storage: torch.UntypedStorage, host: torch.Tensor, nbytes: int, then):
        src, dst = storage.data_ptr(), host.data_ptr()

        def job():
            ctypes.memmove(dst, src, nbytes)  # `storage` and `host` stay alive: the record holds them
            return then() if then is not None else None

        return worker.submit(job), None

    def into_device(self, host: torch.Tensor, nbytes: int):
        return host.untyped_storage(), host.storage_offset(), None  # the buffer is device memory

    def use(self, waitable) -> None:
        pass


class _CopyMover:
    """Device memory of its own (`copies`): copies on two side streams, ordered by events."""

    copies = True

    def __init__(self, accel: Accelerator):
        self.accel = accel
        self.d2h = accel.new_stream()
        self.h2d = accel.new_stream()

    def out(self, worker, storage: torch.UntypedStorage, host: torch.Tensor, nbytes: int, then):
        a = self.accel
        src = torch.empty(0, dtype=torch.uint8, device=a.torch_device).set_(storage)
        a.wait_stream(
            self.d2h, a.compute_stream(), site="act.out_after_compute"
        )  # the bytes were produced there
        a.copy(host[:nbytes], src, self.d2h)
        ev = a.record(self.d2h)

        def job():
            a.synchronize(ev, site="act.out_done")
            return then() if then is not None else None

        return worker.submit(job), a.after(ev, site="act.out_host_reuse")

    def into_device(self, host: torch.Tensor, nbytes: int):
        a = self.accel
        dev = a.empty(nbytes, torch.uint8)  # allocated on compute
        a.wait_stream(self.h2d, a.compute_stream(), site="act.in_after_compute")
        a.copy(dev, host[:nbytes], self.h2d)
        ev = a.record(self.h2d)
        a.record_use(dev, self.h2d, site="act.in_keep")
        return dev.untyped_storage(), 0, a.after(ev, site="act.in_host_reuse")

    def use(self, waitable) -> None:
        self.accel.wait_event(self.accel.compute_stream(), waitable.event, site="act.in_use")


class Swapper:
    """Owns the movement of SavedStorages, the host buffers, the SSD keys and the accounting."""

    def __init__(self, accel: Accelerator, store, *, key_prefix: str, host_budget_bytes: Optional[int]):
        self.device = accel.torch_device
        self.store = store
        self.mover = _CopyMover(accel) if accel.copies else _HostMover()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="offloadpp-act")
        self.pool = BufferPool(
            "activations", host_budget_bytes or UNLIMITED, lambda n, dt: aligned_empty(n, dt),
            poison=accel.poisons_host_reuse,
        )  # fmt: skip
        self.key_prefix = f"{key_prefix}{next(_instances)}"  # managers sharing a store never share keys
        self.moving_out: deque[SavedStorage] = deque()  # swap-out jobs, in submission order
        self.writing: list[SavedStorage] = []  # puts in flight
        self.incoming: list[SavedStorage] = []  # reads and host -> device copies in flight
        self._free_keys: dict[int, list[str]] = {}  # padded size -> keys whose files may be overwritten
        self._nkeys = 0
        # Unchanged storages still alive after their step: their SSD copy is reused, not rewritten.
        self._cache: dict[StorageWeakRef, tuple[int, int, str, int]] = {}  # -> (version, nbytes, key, crc)
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_device_bytes = 0
        self.peak_host_bytes = 0
        self.d2h_bytes = self.h2d_bytes = self.ssd_write_bytes = self.ssd_read_bytes = 0
        self.swap_out_wait_s = self.swap_in_wait_s = 0.0
        self.cache_hits = 0

    # ---- accounting ----------------------------------------------------------------------
    def _set(self, rec: SavedStorage, state: RecState) -> None:
        rec.state = state
        # A read from SSD is bound for the device: its bytes count there from its start (the
        # budget check that started it counted them), and with copies on the host as well,
        # where it lands first; on the CPU device it lands in the buffer backward will use.
        reading = state is RecState.READING
        dev = rec.nbytes if state in _DEVICE_STATES or reading else 0
        host = (
            rec.nbytes
            if rec.host is not None
            and (
                state in _HOST_STATES or state is RecState.READY and self.mover.copies
            )  # (a source's kept copy)
            and not (reading and not self.mover.copies)
            else 0
        )
        self.add_device(dev - rec.held_device)
        self.host_bytes += host - rec.held_host
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        rec.held_device, rec.held_host = dev, host

    def add_device(self, n: int) -> None:
        self.device_bytes += n
        if self.device_bytes > self.peak_device_bytes:
            self.peak_device_bytes = self.device_bytes

    def hold(self, rec: SavedStorage) -> None:
        """A new record enters the accounts in its current state."""
        self._set(rec, rec.state)

    # ---- swap-out --------------------------------------------------------------------------
    def swap_out(self, rec: SavedStorage) -> None:
        """Starts moving a DEVICE record of policy HOST or SSD out (forward, at pack time)."""
        rec.host = self.pool.get(_align(rec.nbytes), torch.uint8)
        then: Optional[Callable] = None
        if rec.policy.value == "ssd":
            self._reuse_or_take_key(rec)
            key, host, nbytes, verify, store = rec.key, rec.host, rec.nbytes, rec.verify, self.store
            crc_always = self.mover.copies  # the host CPU is idle there; on the CPU device: at release

            def then():  # on the worker, once the bytes are in `host`
                crc = None
                if verify is not None or crc_always:
                    crc = crc32c(host.data_ptr(), nbytes)
                    if crc == verify:
                        return None, crc  # unchanged since the copy under `key` was written
                return store.put(key, host), crc

        rec.job, rec.event = self.mover.out(self.worker, rec.storage, rec.host, rec.nbytes, then)
        self.d2h_bytes += rec.nbytes
        self._set(rec, RecState.MOVING_OUT)
        self.moving_out.append(rec)

    def _reuse_or_take_key(self, rec: SavedStorage) -> None:
        """The key of the storage's SSD copy from an earlier step, if it is still alive and the
        same size (its write is skipped if the bytes prove unchanged: same version and CRC)."""
        hit = self._cache.pop(rec.weak, None)
        if hit is not None:
            version, nbytes, key, crc = hit
            if nbytes == rec.nbytes:
                rec.key = key
                rec.verify = crc if version == rec.version else None
                return
            self._free_key(key)
        rec.key = self._take_key(rec.nbytes)

    def _finish_out(self, rec: SavedStorage, block: bool) -> bool:
        if not block and not rec.job.done():
            return False
        t0 = time.perf_counter()
        try:
            put = rec.job.result()
        except BaseException as e:
            raise ActivationError(f"unit {rec.owner!r}: swapping out {rec.nbytes} bytes failed: {e}") from e
        finally:
            self.swap_out_wait_s += time.perf_counter() - t0
        rec.job, rec.event, rec.storage = None, None, None  # the device bytes are free
        if put is None:
            self._set(rec, RecState.HOST)
        else:
            rec.put, rec.crc = put
            if rec.put is None:  # unchanged: the SSD copy is current, nothing was written
                self.cache_hits += 1
                self.pool.put(rec.host)
                rec.host = None
                self._set(rec, RecState.ON_SSD)
            else:
                self.ssd_write_bytes += rec.nbytes
                self._set(rec, RecState.WRITING)
                self.writing.append(rec)
        if rec.want_in:
            self.fetch(rec)
        return True

    def _finish_write(self, rec: SavedStorage, block: bool) -> bool:
        if rec.put is None or (not block and not rec.put.done()):
            return rec.put is None
        try:
            rec.put.wait()
        except OSError as e:
            raise ActivationError(
                f"unit {rec.owner!r}: writing {rec.nbytes} bytes of activations to SSD failed: {e}"
            ) from e
        rec.put = None
        if rec.state is RecState.WRITING:
            self.pool.put(rec.host)
            rec.host = None
            self._set(rec, RecState.ON_SSD)
        return True

    def make_room(self, nbytes: int, budget: Optional[int]) -> None:
        """Forward: waits for the oldest swap-outs until `nbytes` more fit the device budget."""
        if budget is None:
            return
        while self.device_bytes + nbytes > budget and self.moving_out:
            rec = self.moving_out.popleft()
            if rec.state is RecState.MOVING_OUT:
                with record_function("offloadpp::act_swap_out_wait"):
                    self._finish_out(rec, block=True)

    # ---- swap-in ---------------------------------------------------------------------------
    def fetch(self, rec: SavedStorage) -> None:
        """Starts bringing a record back to the device (backward, ahead of need)."""
        s = rec.state
        if s is RecState.MOVING_OUT:
            # (a derived argument's source is not kept on the device: its copy out is wanted, see evict)
            if not rec.source and rec.job.cancel():  # never started: keep the device bytes, skip the copy
                self.pool.put(rec.host, after=[rec.event] if rec.event is not None else [])
                rec.host, rec.job, rec.event = None, None, None
                if rec.key is not None:
                    self._free_key(rec.key)
                    rec.key = None
                self.d2h_bytes -= rec.nbytes
                self._set(rec, RecState.READY)
            else:
                rec.want_in = True  # continued when its job is done
            return
        if s is RecState.HOST or s is RecState.WRITING:
            rec.want_in = False
            self._into_device(rec)
        elif s is RecState.STAGING:  # (now bound for the device: it counts there from now)
            self._set(rec, RecState.READING)
        elif s is RecState.ON_SSD:
            rec.host = self.pool.get(_align(rec.nbytes), torch.uint8)
            rec.get = self.store.get(rec.key, out=rec.host)
            self.ssd_read_bytes += rec.nbytes
            self._set(rec, RecState.READING)
            self.incoming.append(rec)

    def stage(self, rec: SavedStorage) -> None:
        """Starts reading an ON_SSD record into host memory ahead of the device room (see the
        Note on staging); nothing for any other record, or where host memory is the device's."""
        if rec.state is not RecState.ON_SSD or not self.mover.copies:
            return
        rec.host = self.pool.get(_align(rec.nbytes), torch.uint8)
        rec.get = self.store.get(rec.key, out=rec.host)
        self.ssd_read_bytes += rec.nbytes
        self._set(rec, RecState.STAGING)
        self.incoming.append(rec)

    def _into_device(self, rec: SavedStorage) -> None:
        rec.storage, rec.base, ev = self.mover.into_device(rec.host, rec.nbytes)
        self.h2d_bytes += rec.nbytes
        if ev is None:  # the CPU device: the host buffer serves as device memory
            self._set(rec, RecState.READY)
        else:
            rec.event = ev
            self._set(rec, RecState.MOVING_IN)
            if rec not in self.incoming:
                self.incoming.append(rec)

    def _advance_in(self, rec: SavedStorage, block: bool) -> None:
        if rec.state is RecState.STAGING and (block or rec.get.done()):
            self._read_done(rec)
            self._set(rec, RecState.HOST)  # (waits there for a fetch within the budget)
            return
        if rec.state is RecState.READING and (block or rec.get.done()):
            self._read_done(rec)
            self._into_device(rec)
        if rec.state is RecState.MOVING_IN and (block or rec.event.done()):
            self.mover.use(rec.event)  # the compute stream waits for the copy, the host does not
            # The buffer is reusable once the copy (and an SSD write still reading it) is done; a
            # derived argument's source keeps it until it was evicted once (see evict).
            if not rec.source or rec.evicted:
                self.pool.put(rec.host, after=[w for w in (rec.event, rec.put) if w is not None])
                rec.host = None
            rec.event = None
            self._set(rec, RecState.READY)

    def _read_done(self, rec: SavedStorage) -> None:
        try:
            rec.get.wait()
        except OSError as e:
            raise ActivationError(
                f"unit {rec.owner!r}: reading {rec.nbytes} bytes of activations from SSD failed: {e}"
            ) from e
        rec.get = None

    def wait_ready(self, rec: SavedStorage) -> None:
        """Backward needs the record now."""
        if rec.state is RecState.READY or rec.state is RecState.DEVICE:
            return
        t0 = time.perf_counter()
        with record_function("offloadpp::act_swap_in_wait"):
            if rec.state is RecState.MOVING_OUT:
                self._finish_out(rec, block=True)
            if rec.state in (RecState.HOST, RecState.WRITING, RecState.ON_SSD, RecState.STAGING):
                self.fetch(rec)
            self._advance_in(rec, block=True)
        self.swap_in_wait_s += time.perf_counter() - t0
        if rec in self.incoming:
            self.incoming.remove(rec)
        if rec.state is not RecState.READY:
            raise ActivationError(
                f"unit {rec.owner!r}: a saved storage could not be brought back ({rec.state.value})"
            )

    def evict(self, rec: SavedStorage) -> bool:
        """A READY record that is a derived argument's source (rec.source: its host copy kept since
        it came back) leaves the device again, once, without a copy: HOST, fetched again like any
        host record (manager saves.py `_evict_source`). False where it cannot: on the device
        since its forward (never moved: no host copy), or evicted once already."""
        if rec.state is not RecState.READY or rec.host is None or rec.evicted:
            return False
        rec.storage, rec.base, rec.evicted = None, 0, True
        self._set(rec, RecState.HOST)
        return True

    # ---- progress --------------------------------------------------------------------------
    def pump(self) -> None:
        """Non-blocking: advances every move whose I/O or copy has finished."""
        while self.moving_out:
            rec = self.moving_out[0]
            if rec.state is RecState.MOVING_OUT and not self._finish_out(rec, block=False):
                break
            self.moving_out.popleft()
        if self.writing:
            self.writing = [r for r in self.writing if not self._finish_write(r, block=False)]
        if self.incoming:
            for rec in list(self.incoming):
                self._advance_in(rec, block=False)
            self.incoming = [
                r
                for r in self.incoming
                if r.state in (RecState.READING, RecState.STAGING, RecState.MOVING_IN)
            ]

    # ---- release ---------------------------------------------------------------------------
    def release(self, rec: SavedStorage) -> None:
        """Backward is done with the record: its buffers go back, its key to reuse or the cache."""
        if rec.state is RecState.RELEASED:
            return
        if rec.state is RecState.MOVING_OUT:
            self._finish_out(rec, block=True)
        crc_source = None  # where the bytes can be read on the host, for the CRC of a kept key
        if rec.key is not None and rec.crc is None and not rec.weak.expired():
            if rec.host is not None and rec.state in (RecState.HOST, RecState.WRITING, RecState.READY):
                crc_source = rec.host.data_ptr()
            elif rec.storage is not None and not self.mover.copies:
                crc_source = rec.storage.data_ptr() + rec.base
        after = [w for w in (rec.put, rec.get, rec.event) if w is not None]
        if rec.host is not None:
            self.pool.put(rec.host, after=after)
        rec.host, rec.storage, rec.job, rec.get, rec.event = None, None, None, None, None
        if rec in self.incoming:
            self.incoming.remove(rec)
        if rec.key is not None:
            # The key holds (or, with its put in flight, will hold) the bytes: while the storage
            # lives, a later step saving it again finds the key, and skips the write if the bytes
            # prove unchanged (same version and CRC-32C: writes torch does not track, through
            # .data or numpy, change no version); otherwise a later record overwrites the file.
            if not rec.weak.expired() and (rec.crc is not None or crc_source is not None):
                crc = rec.crc if rec.crc is not None else crc32c(crc_source, rec.nbytes)
                self._cache[rec.weak] = (rec.version, rec.nbytes, rec.key, crc)
            else:
                self._free_key(rec.key)
            rec.key = None
        if rec in self.writing:
            self.writing.remove(rec)
        rec.put = None
        self._set(rec, RecState.RELEASED)

    def sweep_cache(self) -> None:
        """Drops cached SSD copies of storages that no longer exist (end of a step)."""
        for weak in [w for w in self._cache if w.expired()]:
            self._free_key(self._cache.pop(weak)[2])

    def _take_key(self, nbytes: int) -> str:
        size = _align(nbytes)
        free = self._free_keys.get(size)
        if free:
            return free.pop()
        self._nkeys += 1
        return f"{self.key_prefix}.{size}.{self._nkeys}"

    def _free_key(self, key: str) -> None:
        self._free_keys.setdefault(int(key.split(".")[-2]), []).append(key)

    def close(self) -> None:
        self.worker.shutdown(wait=True)
        for rec in list(self.moving_out) + self.writing:
            if rec.put is not None:
                try:
                    rec.put.wait()
                except OSError:
                    pass
        self.moving_out.clear()
        self.writing.clear()
        self.pool.clear()
