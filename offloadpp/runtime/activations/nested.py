"""A nested unit's pieces, run again one at a time inside its recompute (recompute.py Segment).

Note: nested (recompute_nested*). A block's whole recompute holds everything the block saves at
once (a GPT-2 block: 16-18 x width values a token); where that does not fit the device, partial
moves 12x the checkpoint's bytes. Nested keeps the one checkpoint and pays a forward instead. Its
pieces are the root's direct children that hold parameters (a block's norms, attention, MLP).
The first unpack runs the root's forward again (phase A) under a pack hook that keeps what the
root's own operators save and, inside a piece, keeps nothing: each piece's call is logged as a
Piece (its arguments, detached with requires_grad as they were: the boundaries; its RNG
state; the range of saved-tensor indices it fills), and its saved tensors are measured while the
piece runs and dropped when it ends. An unpack whose index lies in a piece's range runs that
piece's forward again (phase B), from its arguments and RNG state, collecting its saved tensors
into the range; the piece's arguments are then dropped. Backward of the block thus holds the
boundaries and one piece's saved tensors, in the order autograd runs the pieces (last to first).
A piece whose argument is the previous piece's output (a block's attention and MLP take the
norms' outputs) holds no boundary for it: its recompute makes it again by running the previous
piece without grad from that piece's own arguments and RNG state (the same operators on the same
bytes), as partial derives its checkpoints; a block then holds two boundaries, not four.
The last piece (the forward marks where its call began, `last_piece_start`) is the one backward
needs first: phase A keeps what it saves instead of running it again (a GPT-2 block's MLP, about
two thirds of its FLOPs), so the price is the forward of the other pieces, not of the whole unit.
Why not torch.utils.checkpoint nested inside the recompute: the graph backward runs is the
forward's, whose saved tensors are this segment's RecomputeRefs by index; a checkpoint opened in
the recompute would own the graph the recompute builds, which is thrown away. This is torch's
non-reentrant scheme (a recompute filling saved-tensor slots by index, RNG state forked and
restored) applied once more, one level down, to the slots of one piece. DeepSpeed's
activation checkpointing (reentrant, runtime/activation_checkpointing) has no nesting. The
accounting counts, from phase A, the boundaries and the largest piece's saved bytes (what the
block's backward holds at most), so backward's prefetch of the next units leaves that room.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .states import SegState, rng_states

# `seg` below is the recompute.py Segment the pieces belong to (not imported: it imports this)


class Piece:
    """One call of a nested unit's piece in the recompute (see the Note on nested): its
    arguments (detached, requires_grad as they were), RNG state, and saved-tensor range."""

    __slots__ = (
        "module",
        "args",
        "kwargs",
        "rng_cpu",
        "rng_dev",
        "start",
        "end",
        "nbytes",
        "taken",
        "state",
        "kept",
        "output",
        "version",
    )

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict, seg: Any, start: int):
        self.module = module
        prev = seg.pieces[-1] if seg.pieces else None

        def arg(x):
            if prev is not None and prev.derives(x):  # (see the Note on nested: derived arguments)
                return FromPrev(prev, x.requires_grad)
            return boundary(x)

        self.args, self.kwargs = tree_map(arg, (args, kwargs))
        self.rng_cpu, self.rng_dev = rng_states(seg.device)
        self.start = start
        self.end = -1
        self.nbytes = 0  # what its saved tensors take (measured in phase A)
        self.taken = 0
        self.state = SegState.SAVED
        # the unit's last piece, which backward needs first: its saved tensors are kept from the
        # unit's recompute instead of being made again (see the Note on nested)
        self.kept = start == seg.last_piece_start
        self.output: Optional[weakref.ref] = None  # its output tensor, while the next piece may take it
        self.version = -1

    def derives(self, x: Any) -> bool:
        """x is this piece's output, unchanged since, and its arguments are still held: the next
        piece's argument x can be made again from them instead of being held."""
        return (
            isinstance(x, torch.Tensor)
            and self.args is not None
            and self.output is not None
            and self.output() is x
            and x._version == self.version
        )


class FromPrev:
    """A nested piece's argument that is the previous piece's output: made again from that
    piece's arguments when needed (see the Note on nested)."""

    __slots__ = ("piece", "requires_grad")

    def __init__(self, piece: Piece, requires_grad: bool):
        self.piece = piece
        self.requires_grad = requires_grad


def boundary(x):
    if not isinstance(x, torch.Tensor):
        return x
    return x.detach().requires_grad_(x.requires_grad) if x.requires_grad else x.detach()


@contextlib.contextmanager
def piece_hooks(module, seg: Any, inside: list, in_piece: list, collected: list, measure: Callable):
    """Phase A's hooks on one piece module (see the Note on nested): a call not inside another
    piece is logged as a Piece; what it saves is measured when it ends, and dropped."""

    def pre(mod, args, kwargs):
        if inside:  # (a piece called inside another is part of it)
            inside.append(inside[-1])
            return None
        p = Piece(mod, args, kwargs, seg, len(collected))
        seg.pieces.append(p)
        inside.append(p)
        return None

    def post(mod, args, kwargs, output):
        p = inside.pop()
        if inside:
            return None
        p.end = len(collected)
        leaves = [t for t in tree_leaves((p.args, p.kwargs)) if isinstance(t, torch.Tensor)]
        p.nbytes = measure(in_piece, exclude=leaves)
        in_piece.clear()
        if isinstance(output, torch.Tensor):  # (the next piece may take it: Piece.derives)
            p.output, p.version = weakref.ref(output), output._version
        if p.end == p.start:  # saved nothing: never recomputed
            p.args = p.kwargs = None
            p.state = SegState.DONE
        elif p.kept:  # its saved tensors are collected already
            p.state = SegState.RECOMPUTED
        return None

    handles = (
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, with_kwargs=True),
    )
    try:
        yield
    finally:
        for h in handles:
            h.remove()
