"""DeepSpeed's JIT-built ops and the build locks an interrupted build leaves behind.

torch builds an extension (DeepSpeed's async_io, cpu_adam, ...) under TORCH_EXTENSIONS_DIR
(default ~/.cache/torch_extensions) guarded by a `lock` file in the op's folder, taken with
O_CREAT|O_EXCL and held open by the building process until it removes it. A build that is killed
(Ctrl-C in a first `make demo`, a timeout) leaves the file, and every later load waits on it
forever without a word; the folder may also hold half-written objects, so removing the lock by
hand is not enough (the next load can fail on a .so that was never linked).

Note: telling a stale lock from a live one. The builder keeps the lock's descriptor open while it
builds, so a lock no process has open (/proc/<pid>/fd) is stale: its builder is gone. Where some
processes cannot be inspected (another user's), a lock none of the visible ones holds counts as
stale only past STALE_AFTER_S (a DeepSpeed op builds in about 5 minutes on 2 cores). A stale
lock goes with every file its build wrote (those newer than the lock), so the op is built again
from a clean state and what earlier complete builds left is kept.

The demo, the benchmarks that load DeepSpeed's ops and tests/conftest.py call
`clear_stale_build_locks`; `python -m offloadpp.integrations.deepspeed.op_locks` runs it
from a shell (scripts/demo.sh).

Note: building ahead of time. ZeRO-Infinity's NVMe path loads DeepSpeed's async_io (which loads
pin_memory first) and, for the offloaded optimizer, cpu_adam: about 510 CPU seconds of compiling
together the first time, 4.5-6 minutes on a quiet 2-core machine (docs/performance.md,
"DeepSpeed's ops"). `make setup` (scripts/bootstrap.sh) builds them once with `build_ops`, as
their first use would (the same builders, into the same TORCH_EXTENSIONS_DIR), so that no test
waits on a build; a later load finds them built (ninja has no work) in a few seconds.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

STALE_AFTER_S = 30 * 60


def extensions_root() -> str:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else torch's default."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return root if root else os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")


@dataclass(frozen=True)
class BuildLock:
    path: str
    op: str  # the op's folder name (async_io, cpu_adam, ...)
    holders: Optional[tuple[int, ...]]  # processes holding it open; None: cannot tell
    age_s: float

    @property
    def stale(self) -> bool:
        if self.holders is None:
            return self.age_s > STALE_AFTER_S
        return not self.holders


def _holders(path: str) -> Optional[tuple[int, ...]]:
    """The processes with `path` open, or None where a process could not be inspected and none
    of the others has it."""
    want = os.path.realpath(path)
    found, blind = [], False
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            continue  # exited meanwhile
        except OSError:
            blind = True
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) == want:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    if found:
        return tuple(found)
    return None if blind else ()


def build_locks(root: Optional[str] = None) -> list[BuildLock]:
    """The build locks under `root` (<root>/<op>/lock, or <root>/py311_cpu/<op>/lock)."""
    root = root or extensions_root()
    out = []
    for depth1 in _listdir(root):
        d1 = os.path.join(root, depth1)
        for d in (d1, *(os.path.join(d1, n) for n in _listdir(d1))):
            lock = os.path.join(d, "lock")
            try:
                mtime = os.stat(lock).st_mtime
            except OSError:
                continue
            out.append(BuildLock(lock, os.path.basename(d), _holders(lock), time.time() - mtime))
    return out


def _remove_newer(folder: str, since: float, keep: str) -> int:
    """Removes what the interrupted build wrote: every file of `folder` written after its lock
    was taken (half-written objects, a .so never fully linked, its build.ninja and ninja logs).
    What earlier, complete builds left stays; the next build redoes the rest."""
    n = 0
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if path != keep and os.path.isfile(path) and os.stat(path).st_mtime >= since - 1:
                os.unlink(path)
                n += 1
        except OSError:
            continue
    return n


def _listdir(d: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n)))
    except OSError:
        return []


def clear_stale_build_locks(
    root: Optional[str] = None, report: Callable[[str], None] = print
) -> list[BuildLock]:
    """Removes each stale build lock under `root` with its op's half-built folder, and says so;
    a live build is named (what a load would wait for). Returns the stale locks removed."""
    removed = []
    for lock in build_locks(root):
        folder = os.path.dirname(lock.path)
        if not lock.stale:
            who = (
                f"process {', '.join(map(str, lock.holders))}"
                if lock.holders
                else "a process not visible here"
            )
            report(f"offloadpp: DeepSpeed's {lock.op} op is being built by {who} (lock {lock.path}); "
                   "loading it waits for that build")  # fmt: skip
            continue
        try:
            since = os.stat(lock.path).st_mtime
            claimed = f"{lock.path}.stale.{os.getpid()}"
            os.rename(lock.path, claimed)  # one remover wins; a new build can take a new lock
        except FileNotFoundError:
            continue  # another process cleared it first
        except OSError as e:
            report(
                f"offloadpp: cannot remove the stale build lock {lock.path}: {e.strerror}; remove {folder}"
            )
            continue
        n = _remove_newer(folder, since, keep=claimed)
        os.unlink(claimed)
        report(f"offloadpp: removed a stale build lock of DeepSpeed's {lock.op} op ({lock.path}, {lock.age_s / 60:.0f} "
               f"min old: its build was interrupted) and the {n} files that build wrote; the op is built again on "
               "first use")  # fmt: skip
        removed.append(lock)
    return removed


# DeepSpeed's ops ZeRO-Infinity's NVMe path loads (op folder -> its builder in deepspeed.ops.op_builder)
ZERO_INFINITY_OPS = {
    "pin_memory": "PinMemoryBuilder",
    "cpu_adam": "CPUAdamBuilder",
    "async_io": "AsyncIOBuilder",
}


def build_ops(ops=tuple(ZERO_INFINITY_OPS), report: Callable[[str], None] = print) -> dict[str, float]:
    """Builds (or finds built) each of DeepSpeed's ops `ops` under extensions_root(), as their
    first use would, after clearing stale build locks; says each one's seconds and returns them.
    The compiler's output goes to the log only where a build fails (its error says why)."""
    import contextlib
    import io

    from deepspeed.ops import op_builder

    clear_stale_build_locks(report=report)
    took = {}
    for op in ops:
        t0 = time.perf_counter()
        said = io.StringIO()
        try:
            with contextlib.redirect_stdout(said):
                getattr(op_builder, ZERO_INFINITY_OPS[op])().load(verbose=False)
        except Exception:
            report(said.getvalue())
            raise
        took[op] = time.perf_counter() - t0
        report(f"offloadpp: DeepSpeed's {op} op ready in {extensions_root()} ({took[op]:.0f} s)")
    return took


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        build_ops(tuple(sys.argv[2:]) or tuple(ZERO_INFINITY_OPS))
    else:
        clear_stale_build_locks(sys.argv[1] if len(sys.argv) > 1 else None)
