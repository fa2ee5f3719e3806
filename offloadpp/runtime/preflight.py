"""Checks before training starts: the nvme paths exist and are writable, and they have room for
the plan's state.

Every error names what is missing and how much, before a single step runs.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Sequence

from offloadpp.planner import Plan, fmt_bytes
from offloadpp.planner.ssd_room import ssd_need


class PreflightError(RuntimeError):
    """The machine cannot run the plan as asked; the message says what is missing."""


def check_nvme_paths(paths: Sequence[str], probe: bool = True) -> None:
    """Each path exists, is a directory and (probe) takes a write."""
    for p in paths:
        if not os.path.exists(p):
            raise PreflightError(f"nvme path {p!r} does not exist (create it, or mount the SSD there)")
        if not os.path.isdir(p):
            raise PreflightError(f"nvme path {p!r} is not a directory")
        if not probe:
            continue
        test_file = os.path.join(p, f".offloadpp-write-test-{uuid.uuid4().hex[:8]}")
        try:
            with open(test_file, "wb") as f:
                f.write(b"x")
        except OSError as e:
            raise PreflightError(
                f"nvme path {p!r} is not writable: {e.strerror or e} (errno {e.errno})"
            ) from None
        finally:
            try:
                os.unlink(test_file)
            except OSError:
                pass


def check_free_space(paths: Sequence[str], plan: Plan, existing_bytes: int = 0) -> None:
    """What the run writes to SSD at its peak (offloadpp/planner/ssd_room.py), spread
    evenly over the paths, must fit the free space of each filesystem (paths on one filesystem
    share its free space); the error says where each byte of the need comes from."""
    need_all = ssd_need(plan, len(paths))
    if need_all.total_bytes == 0:
        return
    by_fs: dict[int, list[str]] = {}
    for p in paths:
        by_fs.setdefault(os.stat(p).st_dev, []).append(p)
    for group in by_fs.values():
        share = len(group) / len(paths)
        need = need_all.total_bytes * share - existing_bytes * share
        free = shutil.disk_usage(group[0]).free
        if free < need:
            one = len(group) == 1
            raise PreflightError(
                f"not enough free space for the training state: {', '.join(repr(g) for g in group)} "
                f"{'has' if one else 'share'} {fmt_bytes(free)} free and need{'s' if one else ''} {fmt_bytes(need)} "
                f"({fmt_bytes(need - free)} more). The need"
                + (f" ({len(group)} of {len(paths)} swap directories' share)" if share < 1 else "")
                + f": {need_all.describe(share)}. Free that much there, give the run more or other nvme paths, "
                "or a larger host budget (what stays in memory is not written to SSD)"
            )
