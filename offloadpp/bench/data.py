"""Offline training text: the docstrings of Python's standard library, or a file the user names.

Tokenisation is byte-level (ids 0..255 inside GPT-2's vocabulary): it needs no download, is the
same on every machine, and is enough to show a falling loss on real text.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from typing import Iterator


def stdlib_docstrings(max_bytes: int = 8 << 20) -> str:
    """Concatenated docstrings of the standard library's modules, classes and functions."""
    root = sysconfig.get_paths()["stdlib"]
    parts: list[str] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Tests and vendored packages are mostly code, not prose.
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, OSError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        parts.append(doc)
                        total += len(doc) + 2
                        if total >= max_bytes:
                            return "\n\n".join(parts)
    if not parts:
        raise RuntimeError(f"no docstrings found under {root}: is the standard library source installed?")
    return "\n\n".join(parts)


def load_text(path: str | None) -> str:
    if path is None:
        return stdlib_docstrings()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training text file {path!r} does not exist")
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if len(text) < 1024:
        raise ValueError(f"training text file {path!r} has {len(text)} characters; need at least 1024")
    return text


def byte_batches(text: str, micro_batch: int, seq_len: int, seed: int = 0) -> Iterator:
    """Endless (input_ids, labels) batches of byte tokens, in an order fixed by `seed`."""
    import torch

    data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)
    n = data.numel() - seq_len - 1
    if n <= 0:
        raise ValueError(f"text of {data.numel()} bytes is shorter than one sequence of {seq_len + 1}")
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, n, (micro_batch,), generator=gen)
        ids = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
        yield ids, ids.clone()
