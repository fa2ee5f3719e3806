"""IOFuture: one asynchronous put or get of the tensor store."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence


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
