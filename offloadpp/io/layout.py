"""Where a TensorStore's tensors lie on disk: the swap files' names (one per key and part,
`*.oswp`), how a large tensor is striped over several directories, and removing the swap files
a run leaves (stale at the next start, and at close unless kept)."""

from __future__ import annotations

import hashlib
import os
import re
from typing import Optional, Sequence, Union

from .buffers import align_up
from .errors import EIO, swap_error

SUFFIX = ".oswp"


def _stripe(
    nbytes: int, n: int, start: int, block: int, weights: Optional[list]
) -> list[tuple[int, int, int]]:
    """(directory, offset, size) of each part of a striped tensor: equal block-aligned parts
    from directory `start` on, or with `weights` parts in proportion to them (block-aligned, the
    last taking the rest)."""
    if weights is None:
        chunk = align_up(-(-nbytes // n), block)
        return [
            ((start + i) % n, off, min(chunk, nbytes - off)) for i, off in enumerate(range(0, nbytes, chunk))
        ]
    order = [(start + i) % n for i in range(n)]
    total = sum(weights)
    out, off = [], 0
    for j, d in enumerate(order):
        size = (
            nbytes - off
            if j == n - 1
            else min(nbytes - off, align_up(int(nbytes * weights[d] / total), block))
        )
        if size > 0:
            out.append((d, off, size))
            off += size
    return out


def _file_stem(key: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", key)[:80]
    return f"{safe}.{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def remove_swap_files(dirs: Sequence[Union[str, os.PathLike]]) -> tuple[int, int]:
    """Removes the swap files in `dirs` (this store's kind only: *.oswp); returns (files, bytes).

    A run starts from the model or a checkpoint, never from swap files an earlier run left
    behind (of this model or another one): those are stale, and left alone they would only
    hold disk space the next run needs."""
    count = total = 0
    for d in dirs:
        d = os.fspath(d)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        for name in names:
            if not name.endswith(SUFFIX):
                continue
            path = os.path.join(d, name)
            try:
                size = os.stat(path).st_size
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise swap_error(e.errno or EIO, "removing a stale swap file", path) from None
            count += 1
            total += size
    return count, total
