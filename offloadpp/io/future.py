"""IOFuture: one asynchronous put or get of the tensor store."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

import offloadpp._C as _C

from .errors import EBADMSG, swap_error
from .format import HEADER_BYTES


class IOFuture:
    """The pending result of TensorStore.put / TensorStore.get.

    wait() blocks (GIL released) until every byte has completed, runs the finishing step (header
    validation, tail and bounce copies for a get) once, and returns the payload byte count or
    raises SwapIOError. result() is wait() returning the tensor (get) or the byte count (put).
    done() never blocks. Any thread may wait; the first one to finish the future does the work.
    """

    def __init__(
        self,
        kind: str,
        key: str,
        nbytes: int,
        handles: Sequence[Any],
        finish: Optional[Callable[[], None]],
        release: Callable[[], None],
        value: Any,
        on_retire: Callable[[IOFuture], None],
    ):
        self.kind = kind
        self.key = key
        self.nbytes = nbytes
        self._handles = list(handles)
        self._finish = finish
        self._release = release
        self._value = value
        self._on_retire = on_retire
        self._lock = threading.Lock()
        self._settled = False
        self._error: Optional[BaseException] = None
        self.keepalive: Any = None  # the tensor whose memory the I/O uses, held until settled

    def __repr__(self) -> str:
        state = "settled" if self._settled else ("done" if self.done() else "pending")
        return f"<IOFuture {self.kind} {self.key!r} {self.nbytes} bytes {state}>"

    def done(self) -> bool:
        return self._settled or all(h.done() for h in self._handles)

    def failed(self) -> bool:
        """Non-blocking: True if done and an I/O error occurred (validation runs only in wait)."""
        return self._error is not None or any(h.failed() for h in self._handles)

    def wait(self, timeout: Optional[float] = None) -> int:
        if not self._settled:
            self._wait_handles(timeout)
            self._settle()
        if self._error is not None:
            raise self._error
        return self.nbytes

    def result(self, timeout: Optional[float] = None) -> Any:
        self.wait(timeout)
        return self._value

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        try:
            self.wait(timeout)
        except TimeoutError:
            raise
        except BaseException as e:  # noqa: BLE001 - returned, not swallowed
            return e
        return None

    # -- internals -------------------------------------------------------------------------

    def _wait_handles(self, timeout: Optional[float]) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for h in self._handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                h.wait(left)
            except TimeoutError:
                raise
            except OSError:
                pass  # recorded by _settle, after every handle has completed

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            try:
                for h in self._handles:  # all complete: these return or raise at once
                    h.wait()
                if self._finish is not None:
                    self._finish()
            except BaseException as e:  # noqa: BLE001 - kept and re-raised by every wait()
                self._error = e
            finally:
                self._release()
                self._settled = True
                self._finish = None
                self.keepalive = None
        self._on_retire(self)

    def _wait_quiet(self) -> None:
        """Waits without raising (ordering only: the owner of the future sees its error)."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001
            pass


class DeferredCheck:
    """A get's payload CRC-32C left to the first user of the bytes (docs/io.md, "Checksums in
    the Adam pass"): TensorStore.get(..., defer_check=True) returns a future carrying one.

    The store records each part's place and header CRC (`parts`) as the read completes. The
    fused Adam claims the check, takes the CRC of the bytes as it reads them, and settles it
    before anything computed from them is written or handed on; anyone else who uses the buffer
    first verifies it with a pass of its own (verify). A mismatch raises SwapIOError (EBADMSG),
    then and at every later claim or verify: the bytes never pass as good."""

    PENDING, CLAIMED, VERIFIED, FAILED = range(4)

    def __init__(self, key: str):
        self.key = key
        self.parts: list[tuple[str, int, int, int]] = []  # (path, byte offset, bytes, header CRC)
        self._cond = threading.Condition()
        self._state = self.PENDING
        self._error: Optional[BaseException] = None

    @property
    def state(self) -> int:
        return self._state

    def expected(self) -> int:
        """The CRC-32C the whole payload must have: the parts' header CRCs joined in order."""
        crc, first = 0, True
        for _, _, nbytes, part_crc in sorted(self.parts, key=lambda p: p[1]):
            crc = part_crc if first else _C.crc32c_combine(crc, part_crc, nbytes)
            first = False
        return crc

    def nothing_left(self) -> None:
        """The store checked what there was to check (a part stored without a checksum)."""
        with self._cond:
            self._state = self.VERIFIED
            self._cond.notify_all()

    def claim(self) -> bool:
        """True: the caller now owes settle() or fail(). False: verified already (or by another)."""
        with self._cond:
            while self._state == self.CLAIMED:
                self._cond.wait()
            if self._state == self.FAILED:
                raise self._error
            if self._state == self.VERIFIED:
                return False
            self._state = self.CLAIMED
            return True

    def settle(self, crc: int) -> None:
        """The claimant's CRC of the payload as read: raises on a mismatch."""
        with self._cond:
            if crc != self.expected():
                self._error = self._mismatch("found by the Adam pass")
            self._done()

    def fail(self, error: BaseException) -> None:
        """The claimant failed before it could tell: the bytes are not good."""
        with self._cond:
            if self._state == self.CLAIMED:
                self._error = error
                self._done()

    def verify(self, ptr: int) -> None:
        """A user other than the claimant: the CRC of the payload at `ptr` by a pass of its own,
        unless settled already (a claimed check is waited for)."""
        with self._cond:
            while self._state == self.CLAIMED:
                self._cond.wait()
            if self._state == self.PENDING:
                for path, offset, nbytes, part_crc in self.parts:
                    if _C.crc32c(ptr + offset, nbytes) != part_crc:
                        self._error = self._mismatch("", path)
                        break
                self._done()
            if self._state == self.FAILED:
                raise self._error

    def _done(self) -> None:
        self._state = self.FAILED if self._error is not None else self.VERIFIED
        self._cond.notify_all()
        if self._error is not None:
            raise self._error

    def _mismatch(self, how: str, path: Optional[str] = None):
        if path is None:
            paths = [p for p, _, _, _ in self.parts]
            path = paths[0] if len(paths) == 1 else ", ".join(paths)
        why = "payload checksum mismatch" + (f", {how}" if how else "")
        return swap_error(EBADMSG, f"reading key {self.key!r} ({why})", path, HEADER_BYTES)
