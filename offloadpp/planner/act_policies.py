"""The activation policies' names, as the planner groups them (planner/activations.py counts
what each holds and moves; runtime/activations/policy.py runs them). Pure (no torch): sets of
names, split out of activations.py, which re-exports them.
"""

from __future__ import annotations

from .spec import ACTIVATION_POLICIES

POLICIES = tuple(p for p in ACTIVATION_POLICIES if p != "auto")  # (the settings' names, auto resolved)
GRAD_IN_FORWARD = "grad_in_forward"  # (a fused head's only: see the Note on the head's loss)
# the swapped piecewise policies with each derived argument's source sent back to host memory once
# the argument is made (see the Note on the derived argument's source): the policy each is of that.
# Each counts as that policy in every group below (_and_refetching), but where REFETCH is asked
REFETCH = {
    "partial_refetch_host": "partial_host",
    "partial_refetch_ssd": "partial_ssd",
    "recompute_pieces_refetch_host": "recompute_pieces_host",
    "recompute_pieces_refetch_ssd": "recompute_pieces_ssd",
    "partial_last_refetch_host": "partial_last_host",
    "partial_last_refetch_ssd": "partial_last_ssd",
}
REFETCHING = {of: p for p, of in REFETCH.items()}  # (partial_ssd -> partial_refetch_ssd, ...)


def _and_refetching(names) -> frozenset:
    """`names` and the REFETCH policies of those among them."""
    return frozenset(names) | {p for p, of in REFETCH.items() if of in names}


# nothing of the unit stays on the device between its forward and its backward
SWAPPING = _and_refetching(("host", "ssd", "recompute_host", "recompute_ssd", "partial_host", "partial_ssd",
                            "recompute_nested_host", "recompute_nested_ssd", "recompute_pieces_host",
                            "recompute_pieces_ssd", "partial_last_host", "partial_last_ssd"))  # fmt: skip
CHECKPOINT_SWAPS = {
    "recompute_host": "host",
    "recompute_ssd": "ssd",
    "partial_host": "host",
    "partial_ssd": "ssd",
    "partial_host_tail": "host",  # (but its last pieces' bytes: kept, see the Note on the tail)
    "recompute_nested_host": "host",
    "recompute_nested_ssd": "ssd",
    "recompute_pieces_host": "host",
    "recompute_pieces_ssd": "ssd",
    "partial_last_host": "host",
    "partial_last_ssd": "ssd",
}
CHECKPOINT_SWAPS.update({p: CHECKPOINT_SWAPS[of] for p, of in REFETCH.items()})
RECOMPUTE = frozenset(("recompute", "recompute_host", "recompute_ssd"))
PARTIAL = _and_refetching(("partial", "partial_host", "partial_ssd", "partial_host_tail"))
TAIL = "partial_host_tail"  # (see the Note on the tail)
# a piece's kept outputs autograd does not save (`partial_extra`) are released once its recompute
# ran, where they were fetched back (see the Note on the release)
RELEASES_REPLAYED = _and_refetching(("partial_host", "partial_ssd"))
TAIL_PIECES = 2  # the pieces a partial_host_tail unit keeps: a block's second norm and its MLP
NESTED = frozenset(("recompute_nested", "recompute_nested_host", "recompute_nested_ssd"))
NESTED_SWAPS = frozenset(("recompute_nested_host", "recompute_nested_ssd"))
PIECES_SWAPS = _and_refetching(("recompute_pieces_host", "recompute_pieces_ssd"))
PIECES = frozenset(("recompute_pieces",)) | PIECES_SWAPS
# (see the Note on the last piece)
LAST_SWAPS = _and_refetching(("partial_last_host", "partial_last_ssd"))
LAST = frozenset(("partial_last",)) | LAST_SWAPS
# a recompute_pieces policy as it is counted (see the Note on pieces): partial's of its tier, or
# recompute's where the unit has no pieces (a REFETCH policy: partial's REFETCH policy of its tier,
# or recompute's)
_AS_PARTIAL = {"recompute_pieces": "partial", "recompute_pieces_host": "partial_host",
               "recompute_pieces_ssd": "partial_ssd", "partial_last": "partial", "partial_last_host": "partial_host",
               "partial_last_ssd": "partial_ssd"}  # fmt: skip
_AS_WHOLE = {"recompute_pieces": "recompute", "recompute_pieces_host": "recompute_host",
             "recompute_pieces_ssd": "recompute_ssd", "partial_last": "recompute",
             "partial_last_host": "recompute_host", "partial_last_ssd": "recompute_ssd"}  # fmt: skip
_AS_PARTIAL.update({p: REFETCHING[_AS_PARTIAL[of]] for p, of in REFETCH.items() if of in _AS_PARTIAL})
_AS_WHOLE.update({p: _AS_WHOLE[of] for p, of in REFETCH.items() if of in _AS_WHOLE})
AS_RUN = PIECES | LAST  # (the policies counted as another: as_run)


def recomputes(policy: str) -> bool:
    """Runs the unit's forward again in backward (wholly, or its cheap operators: partial)."""
    return policy in RECOMPUTE or policy in PARTIAL or policy in NESTED or policy in PIECES or policy in LAST


__all__ = ["AS_RUN", "CHECKPOINT_SWAPS", "GRAD_IN_FORWARD", "LAST", "LAST_SWAPS", "NESTED", "NESTED_SWAPS", "PARTIAL", "PIECES", "PIECES_SWAPS", "POLICIES", "RECOMPUTE", "REFETCH", "REFETCHING", "RELEASES_REPLAYED", "SWAPPING", "TAIL", "TAIL_PIECES", "recomputes"]  # fmt: skip
