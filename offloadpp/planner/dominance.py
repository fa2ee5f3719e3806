"""Which candidates no other one beats on every measure (the robust pick's, robust_pick.py)."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def undominated(cands: Sequence[T], times: Callable[[T], tuple[float, ...]]) -> list[T]:
    """The candidates, in order, that no other one is at least as fast as on every estimate of
    `times` (candidate -> its estimates, e.g. on the measured and on a slow SSD) and faster on one.

    Note: why the robust pick asks. Among means within TIE_FRAC the pick goes to the plan moving
    fewer SSD bytes, the bytes standing for a step that holds up on a slower SSD; a plan another
    beats on both SSDs has shown its bytes buy nothing. On docs/paper's data-sheet profile, GPT-3
    13B b128, the pick took a plan at 73.193 s nominal and 73.353 s on the slow SSD over the
    best's 72.550 s on both, for 0.5% fewer SSD bytes: 0.991x b64's model TFLOPS (issue 36's
    data-sheet bar), 0.9994x with the best."""
    ts = [times(c) for c in cands]

    def beats(a: tuple, b: tuple) -> bool:
        return a != b and all(x <= y for x, y in zip(a, b))

    return [c for c, t in zip(cands, ts) if not any(beats(o, t) for o in ts)]
