"""Engines closed at the interpreter's exit if their owner did not close them.

Note: exit. An engine still open when the interpreter exits (a KeyboardInterrupt or any error
that ended the script: its traceback keeps the engine, the model and the interrupted step's
autograd graph alive) would be torn down by the collector, in the arbitrary order of
finalization: torch then aborts the process ("terminate called after throwing an instance of
'c10::Error' ... python_variable.cpp", rc -6) instead of exiting with the Python error. Every
open engine is therefore closed at exit, before that (atexit runs callbacks last-registered
first: registered after the first engine's weakref.finalize, this runs before finalize's own
exit hook), so hooks are removed and I/O finished while torch is still whole.
"""

from __future__ import annotations

import atexit
import logging
import weakref

log = logging.getLogger("offloadpp.runtime")

_open_engines: weakref.WeakSet = weakref.WeakSet()
_exit_hook: list = []


def _close_at_exit() -> None:
    for engine in list(_open_engines):
        try:
            engine.close()
        except BaseException as e:  # noqa: BLE001 - exiting anyway: say it, close the others
            log.warning("offloadpp: closing an engine at exit: %s", e)


def close_at_exit(engine) -> None:
    """Called by an engine once it holds something to release (after its weakref.finalize)."""
    _open_engines.add(engine)
    if not _exit_hook:
        _exit_hook.append(atexit.register(_close_at_exit))


def closed(engine) -> None:
    _open_engines.discard(engine)
