"""Activation policies: what happens, per unit, to the tensors autograd saves in forward.

    keep       stay on the device until backward uses them.
    host       copied to pinned host memory during forward, copied back ahead of backward.
    ssd        copied to host, written to SSD (TensorStore), read back ahead of backward.
    recompute  not stored: the unit's forward runs again in backward (non-reentrant
               checkpointing at unit granularity); only the unit's inputs are held.
    recompute_host, recompute_ssd
               recompute, with the inputs (the activation checkpoint) swapped as host/ssd swap
               saved tensors, and fetched back ahead of the recompute.
    recompute_nested, recompute_nested_host, recompute_nested_ssd
               as recompute / recompute_host / recompute_ssd (only the unit's inputs are held or
               swapped), but backward runs the unit's forward again holding only its pieces'
               boundaries (the arguments of each child module that holds parameters: a
               transformer block's norms, attention, MLP), and then each piece's forward again
               when backward reaches it: the block's backward holds one piece's saved tensors at
               a time, for one more forward of the pieces (nested.py, Note on nested).
    recompute_pieces, recompute_pieces_host, recompute_pieces_ssd
               each piece (a child of the unit's root: a block's norms, attention, MLP) its own
               recompute segment with its own checkpoint (its arguments; an argument that is the
               previous piece's output is made again from that piece's: a block keeps or swaps
               two checkpoints, the residual stream before each norm), kept or swapped as
               recompute*'s; backward runs each piece's forward again from its own checkpoint
               when it reaches it: the compute of a whole recompute, one piece's saved tensors
               at a time (partial's pieces without its kept outputs: manager.py, Note on pieces).
    partial, partial_host, partial_ssd
               selective recomputation (Korthikanti et al. 2022): the outputs of the operators
               expensive to run again (matmuls, attention) and of random ones (dropout) are kept
               (partial) or swapped with the checkpoint (partial_host, partial_ssd); backward
               runs the unit's forward again from the checkpoint, handing those outputs back
               instead of running their operators, so only the cheap ones (norms, activation
               functions, reshapes) are recomputed (partial.py, Note on partial).
    partial_last, partial_last_host, partial_last_ssd
               recompute_pieces*, but the last piece (a transformer block's MLP) is partial*'s:
               its operator log keeps its matmuls' outputs (kept, or swapped with the
               checkpoints), the other pieces run whole again from their own checkpoints. Between
               the two in bytes and FLOPs: a Llama block keeps gate and up (the MLP's FLOPs, 64%
               of the block's) and recomputes its attention, whose partial piece would hold the q
               and k before the rotation beside the rotated ones at its recompute (the piece's
               peak at Llama 7B b128: 8.02 GiB, against 6.02 recomputed whole).
    partial_refetch_host, partial_refetch_ssd, recompute_pieces_refetch_host,
    recompute_pieces_refetch_ssd, partial_last_refetch_host, partial_last_refetch_ssd
               as partial_*, recompute_pieces_*, partial_last_* of their tier, but a piece's
               checkpoint that the next piece's argument is made from (a block's norms' inputs)
               leaves the device again once that argument is made, and comes back for its own
               piece: the next piece's recompute holds one checkpoint less, for one more copy up
               each (saves.py `_evict_source`; planner/activations.py, Note on the derived
               argument's source). Chosen by the planner where the room needs it (a GPT-3 13B
               block's MLP at b64: 5.6 GiB, not 6.25).
    partial_host_tail
               as partial_host, but the records of the unit's last TAIL_PIECES pieces (for a
               transformer block: the second norm's checkpoint and the MLP's kept outputs, which
               backward needs first) stay on the device: each piece's records are held back
               while it runs and the next one does, and are swapped out when the piece after
               that opens, so the unit's last pieces are never copied (Note on the tail, in
               planner/activations.py, which prices it).
    grad_in_forward
               the fused head's unit only (head.py, Note on gradients in forward): its loss's
               forward makes the gradients of h, W and b chunk by chunk, holds them (grad_h in
               the compute dtype, grad_W in fp32) instead of the logits, and its backward scales
               them by the incoming gradient: no logits held nor computed again. Kept on the
               device (not swapped); what the unit saves besides (its norm's) is kept.
    auto       decided per unit by the planner (planner/decide.py): in the plan where it had a
               model profile, else from what the first step measures (the manager's Note on
               auto: measured_activations).

The settings (policy, per-unit overrides, budget) are planner.ActivationSettings, defined once
with the rest of a run's settings; the plan carries each unit's resolved policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional


class ActPolicy(str, Enum):
    KEEP = "keep"
    HOST = "host"
    SSD = "ssd"
    RECOMPUTE = "recompute"
    RECOMPUTE_HOST = "recompute_host"
    RECOMPUTE_SSD = "recompute_ssd"
    RECOMPUTE_NESTED = "recompute_nested"
    RECOMPUTE_NESTED_HOST = "recompute_nested_host"
    RECOMPUTE_NESTED_SSD = "recompute_nested_ssd"
    RECOMPUTE_PIECES = "recompute_pieces"
    RECOMPUTE_PIECES_HOST = "recompute_pieces_host"
    RECOMPUTE_PIECES_SSD = "recompute_pieces_ssd"
    PARTIAL = "partial"
    PARTIAL_HOST = "partial_host"
    PARTIAL_SSD = "partial_ssd"
    GRAD_IN_FORWARD = "grad_in_forward"
    PARTIAL_HOST_TAIL = "partial_host_tail"
    PARTIAL_LAST = "partial_last"
    PARTIAL_LAST_HOST = "partial_last_host"
    PARTIAL_LAST_SSD = "partial_last_ssd"
    PARTIAL_REFETCH_HOST = "partial_refetch_host"
    PARTIAL_REFETCH_SSD = "partial_refetch_ssd"
    RECOMPUTE_PIECES_REFETCH_HOST = "recompute_pieces_refetch_host"
    RECOMPUTE_PIECES_REFETCH_SSD = "recompute_pieces_refetch_ssd"
    PARTIAL_LAST_REFETCH_HOST = "partial_last_refetch_host"
    PARTIAL_LAST_REFETCH_SSD = "partial_last_refetch_ssd"
    AUTO = "auto"

    @property
    def swaps(self) -> bool:
        return self is ActPolicy.HOST or self is ActPolicy.SSD

    @property
    def recomputes(self) -> bool:
        """Runs the unit's forward again in backward (wholly, or the cheap operators: partial)."""
        return self in _RECOMPUTING

    @property
    def partial(self) -> bool:
        return self in _PARTIAL

    @property
    def refetch(self) -> bool:
        """A derived argument's source leaves the device once the argument is made, and is fetched
        again for its own piece (saves.py `_evict_source`)."""
        return self in _REFETCH

    @property
    def piecewise(self) -> bool:
        """Runs each child of the unit's root as its own segment, recomputed from its own
        checkpoint (partial*, recompute_pieces*: manager.py, Note on pieces)."""
        return self in _PIECEWISE

    @property
    def recompute_pieces(self) -> bool:
        """Each piece recomputed whole from its own checkpoint (no operator log)."""
        return self in _PIECES

    @property
    def partial_last(self) -> bool:
        """Its last piece keeps its expensive operators' outputs, the others recompute whole."""
        return self in _LAST

    @property
    def tail(self) -> bool:
        """Keeps its last TAIL_PIECES pieces' records on the device, swaps the others."""
        return self is ActPolicy.PARTIAL_HOST_TAIL

    @property
    def nested(self) -> bool:
        """Recomputes the unit from its one checkpoint, then piece by piece (nested.py)."""
        return self in _NESTED

    @property
    def checkpoint(self) -> Optional[ActPolicy]:
        """Where a recomputing unit's inputs (and a partial unit's kept outputs) go (HOST, SSD),
        None where they stay."""
        return _CHECKPOINT.get(self)


_NESTED = frozenset(
    (ActPolicy.RECOMPUTE_NESTED, ActPolicy.RECOMPUTE_NESTED_HOST, ActPolicy.RECOMPUTE_NESTED_SSD)
)
# each *_refetch_* policy runs as the policy its name has without "_refetch" but for the source
# (ActPolicy.refetch), and is in each group below that one is in (_and_refetching)
_REFETCH_OF = {p: ActPolicy(p.value.replace("_refetch", "")) for p in ActPolicy if "_refetch_" in p.value}
_REFETCH = frozenset(_REFETCH_OF)


def _and_refetching(*policies: ActPolicy) -> frozenset:
    """`policies` and the refetching policies of those among them."""
    return frozenset(policies) | {p for p, of in _REFETCH_OF.items() if of in policies}


_PIECES = _and_refetching(
    ActPolicy.RECOMPUTE_PIECES, ActPolicy.RECOMPUTE_PIECES_HOST, ActPolicy.RECOMPUTE_PIECES_SSD
)
_LAST = _and_refetching(ActPolicy.PARTIAL_LAST, ActPolicy.PARTIAL_LAST_HOST, ActPolicy.PARTIAL_LAST_SSD)
_PARTIAL = _and_refetching(
    ActPolicy.PARTIAL, ActPolicy.PARTIAL_HOST, ActPolicy.PARTIAL_SSD, ActPolicy.PARTIAL_HOST_TAIL
)
_PIECEWISE = _PIECES | _LAST | _PARTIAL
_RECOMPUTING = (
    _NESTED
    | _PIECES
    | _LAST
    | _PARTIAL
    | frozenset((ActPolicy.RECOMPUTE, ActPolicy.RECOMPUTE_HOST, ActPolicy.RECOMPUTE_SSD))
)
_CHECKPOINT = {
    ActPolicy.RECOMPUTE_HOST: ActPolicy.HOST,
    ActPolicy.RECOMPUTE_SSD: ActPolicy.SSD,
    ActPolicy.RECOMPUTE_NESTED_HOST: ActPolicy.HOST,
    ActPolicy.RECOMPUTE_NESTED_SSD: ActPolicy.SSD,
    ActPolicy.RECOMPUTE_PIECES_HOST: ActPolicy.HOST,
    ActPolicy.RECOMPUTE_PIECES_SSD: ActPolicy.SSD,
    ActPolicy.PARTIAL_HOST: ActPolicy.HOST,
    ActPolicy.PARTIAL_HOST_TAIL: ActPolicy.HOST,
    ActPolicy.PARTIAL_SSD: ActPolicy.SSD,
    ActPolicy.PARTIAL_LAST_HOST: ActPolicy.HOST,
    ActPolicy.PARTIAL_LAST_SSD: ActPolicy.SSD,
}
_CHECKPOINT.update({p: _CHECKPOINT[of] for p, of in _REFETCH_OF.items()})


@dataclass(frozen=True)
class UnitActProfile:
    """What the first step measures of an auto unit, for the planner to decide its policy
    (planner/decide.py measured_activations): its saved activation bytes and forward FLOPs."""

    name: str
    bytes: int
    flops: float
