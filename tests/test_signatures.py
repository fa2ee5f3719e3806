"""No function or constructor in offloadpp/ takes more than MAX_PARAMS parameters (`self`/`cls`
not counted, `*args` and `**kwargs` counted once each): past that a caller passes objects whole
(a Schedule, a Plan, an AdamHyper) rather than their fields one by one.

The exceptions are drop-in mirrors of a public signature someone else defined, which must take
what the original takes: `initialize` (deepspeed.initialize) and `CPUAdam` (DeepSpeedCPUAdam).
Constructors generated from fields (dataclasses, pydantic models) are data, not signatures, and
are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "offloadpp"
MAX_PARAMS = 8

MIRRORS = {
    "integrations/deepspeed/initialize.py:initialize",  # deepspeed.initialize
    "optim/cpu_adam.py:CPUAdam.__init__",  # deepspeed.ops.adam.DeepSpeedCPUAdam
}


def _count(args: ast.arguments) -> int:
    names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


def _walk(node, prefix: str):
    """(qualified name, line, parameter count) of every def under `node`, methods and nested ones."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            yield from _walk(child, f"{prefix}{child.name}.")
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{child.name}", child.lineno, _count(child.args)
            yield from _walk(child, f"{prefix}{child.name}.")
        else:
            yield from _walk(child, prefix)


def _signatures():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, line, n in _walk(ast.parse(path.read_text()), ""):
            yield f"{rel}:{name}", line, n


def test_no_signature_takes_more_than_eight_parameters():
    wide = [
        f"{name} (line {line}): {n}"
        for name, line, n in _signatures()
        if n > MAX_PARAMS and name not in MIRRORS
    ]
    assert not wide, "pass objects whole:\n" + "\n".join(wide)


def test_the_mirrors_listed_exist_and_are_wide():
    wide = {name for name, _, n in _signatures() if n > MAX_PARAMS}
    assert MIRRORS <= wide, "no longer wide (drop it from the list): " + str((MIRRORS) - wide)
