"""Engines closed at the interpreter's exit if their owner did not close them.

Note: exit. An engine still open when the interpreter exits (a KeyboardInterrupt or any error
that ended the script: its traceback keeps the engine, the model and the interrupted step's
autograd graph alive) would be torn down by the collector, in the arbitrary order of
finalization: torch then aborts the process ("terminate called after throwing an instance of
'c10::Error' ... python_variable.cpp", rc -6) instead of exiting with the Python error. Every
open engine is therefore closed at exit, before that, so hooks are removed and I/O finished
while torch is still whole.

Closing may still need the engine's worker threads: the last step's deferred updates (with
clipping, runtime/pending.py) run on the optimizer's ThreadPoolExecutor. The interpreter stops
every ThreadPoolExecutor in `threading._shutdown`, before any `atexit` callback runs: a close
from `atexit` found its worker refusing jobs ("cannot schedule new futures after shutdown") and
the last step's updates were never applied. The hook is therefore registered where
concurrent.futures registers its own, `threading._register_atexit`, whose callbacks run
last-registered first: registered after concurrent.futures was imported (the engine's pools come
from it), ours runs while the pools still take work, and before weakref.finalize's exit hook.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours (see above)
import logging
import threading
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
        _exit_hook.append(_register(_close_at_exit))


def _register(fn):
    """Before the interpreter stops thread pools where Python allows it (3.9+), else at atexit."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return atexit.register(fn)
    try:
        register(fn)
    except RuntimeError:  # the interpreter is already shutting down: atexit still runs after
        atexit.register(fn)
    return fn


def closed(engine) -> None:
    _open_engines.discard(engine)
