"""Every file path named in a docstring or comment of offloadpp/ or in the docs exists: a docstring or a doc
that sends the reader to a file that was renamed or removed is worse than none.

A path is a word ending in a source or doc suffix (`runtime/jobs.py`, `docs/planner.md`,
`block.py`); it exists when some file of the repository ends with it (paths are named from the
repository root, from offloadpp/, or from the module's own folder). Output files a command writes
(`*.hardware.json` in a user's folder) are not named with a source suffix and are not checked.
"""

from __future__ import annotations

import ast
import re
import subprocess
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|sh|cpp|h))(?![\w/])")
# names that are not this repository's files: other projects' sources a docstring cites
# (DeepSpeed's, torch's, glibc's), checked by hand when they were written
ELSEWHERE = {
    "DESIGN.md",  # the team's design document, in its shared folder (README.md says so)
    "train.py",  # the user's own script in the examples
    "launch.py",  # DeepSpeed's launcher and runner
    "launcher/runner.py",
    "python_variable.cpp",  # torch's
    "libaio.h",  # the system's headers
    "liburing.h",
    "malloc.h",
    "stage3.py",  # DeepSpeed's ZeRO-3
    "transformer.h",  # GPT-2's list of blocks, an attribute path
}


def _files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.split()


def _texts() -> list[tuple[str, str]]:
    out = []
    for rel in _files():
        path = REPO / rel
        if rel.endswith(".md") and (rel.startswith("docs/") or "/" not in rel):
            out.append((rel, path.read_text()))
        elif rel.startswith("offloadpp/") and rel.endswith(".py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        out.append((f"{rel}:{getattr(node, 'lineno', 1)}", doc))
            with open(path, "rb") as f:
                for tok in tokenize.tokenize(f.readline):
                    if tok.type == tokenize.COMMENT:
                        out.append((f"{rel}:{tok.start[0]}", tok.string))
    return out


def test_every_path_a_docstring_or_doc_names_exists():
    files = _files()
    missing = []
    for where, text in _texts():
        for name in set(PATH.findall(text)):
            if name in ELSEWHERE or name.split("/")[-1] in ELSEWHERE:
                continue
            name = name.removeprefix("./")
            if not any(f == name or f.endswith("/" + name) for f in files):
                missing.append(f"{where}: {name}")
    assert not missing, "paths that do not exist:\n" + "\n".join(sorted(missing))
