"""Saved activations inside the device budget: the bytes a choice of per-unit policies needs on
the device, the choices the planner scores, and the smallest that can run.

Pure (no torch). The runtime's accounting (runtime/activations/) is what this counts:

  keep       the unit's saved bytes stay on the device from its forward to its backward.
  recompute  only its inputs (the previous unit's output) stay; at its backward it runs its
             forward again and holds everything it saved until that backward is done.
  host, ssd  its saved bytes leave the device as they are saved (forward waits for the copies
             when it must) and come back for its backward.
  recompute_host, recompute_ssd
             recompute, with the inputs (the activation checkpoint) swapped as host/ssd swap the
             saved bytes: nothing of the unit stays on the device between its forward and its
             backward; the checkpoint comes back ahead of the recompute (the paper's scheme).
  recompute_nested, recompute_nested_host, recompute_nested_ssd
             recompute (the checkpoint kept, or swapped as recompute_host/ssd's), holding at the
             unit's backward only its pieces' boundaries (the norms' arguments: for a block the
             residual stream twice) and one piece's saved bytes at a time, for a second forward of
             its pieces but the last (runtime/activations/nested.py, Note on nested).
  recompute_pieces, recompute_pieces_host, recompute_pieces_ssd
             each piece recomputed from its own checkpoint (kept, or swapped as recompute_host/ssd's):
             counted as partial with no kept outputs (its pieces' checkpoints: a block's two, the
             residual stream before each norm; one piece's saved bytes at a time in backward), for
             the compute of a whole recompute (see the Note on pieces).
  partial_last, partial_last_host, partial_last_ssd
             recompute_pieces*, but the last piece partial*'s (a block's MLP: its kept outputs,
             gate and up, kept or swapped with the checkpoints): counted as partial with kept
             outputs in its last piece only (`ActUnit.as_last`), for the compute of its other
             pieces (recompute_fraction: 1 - last_piece_share). See the Note on the last piece.
  partial, partial_host, partial_ssd
             selective recomputation: the outputs of the unit's matmuls and attention (`partial`
             bytes, from the model profile) stay with its inputs (partial) or are swapped with them
             (partial_host, partial_ssd); backward runs only the cheap operators again (norms,
             activation functions: no matmul FLOPs), then holds all it saved plus the kept outputs
             autograd does not save (`partial_extra`), until its backward is done.
  partial_host_tail
             partial_host, its last TAIL_PIECES pieces' checkpoints and kept outputs kept on the
             device (see the Note on the tail).
  grad_in_forward
             a fused causal-LM head only (runtime/activations/head.py, Note on gradients in
             forward): its loss's forward makes the gradients of h, W and b and holds them (grad_h
             in place of h, the fp32 grad_W in place of the logits) until its backward, which only
             scales them: all its backward FLOPs run in forward (`forward_moved`), none again.

Note: the need. Backward visits the units last to first, and releases a unit's activations once
its backward is done. At unit j's backward every earlier unit still holds what its policy keeps
(all of it, its inputs, or nothing) and unit j holds all it saved, fetched back or recomputed
(a recompute's inputs are counted until the recompute, then replaced by what it recomputed).
Unit j's forward holds what earlier units hold and, until its copies out are done, all it saves
or moves at once (a partial unit kept on the device: every piece's checkpoint and kept outputs,
which can pass what its backward holds piece by piece; swapped, one piece's at a time). So

    need = max over j of  sum_{i < j} held(i) + max(forward(j), backward(j))

where held(i) is saved(i) for keep, inputs(i) for recompute, inputs(i) + partial(i) for
partial, and 0 for the swapping policies (recompute_host/ssd and partial_host/ssd included); a
partial unit's backward holds saved(j) + partial_extra(j).

Prefetching further units is done only within the budget (the runtime's rule), so it does not
add to the need. Swapping everything gives the least need: the largest unit's saved bytes.

Note: the head's loss. A causal LM's head saves the final norm's output (the loss's input) and
the logits, tokens x vocabulary: at GPT-3 13B micro-batch 128 in 16-bit 12.3 GiB, most of a
4090's activation budget. With the runtime's fused head and loss (ActivationSettings.fused_loss,
runtime/activations/head.py) the logits are made chunk by chunk and their gradient is never
whole, so the head's backward holds what it saved (and a chunk's temporaries, see
LOSS_CHUNK_ELEMS). A head whose policy recomputes (recompute*) keeps (or swaps) its checkpoint
and the loss's input and computes the logits again chunk by chunk in backward (the head's
forward FLOPs again): it holds 2 x width a token from its forward to its backward, not width +
vocabulary. Under partial* the logits, its matmul's output, are kept (or swapped with the
checkpoint): it holds and moves what keep, host or ssd would (`_head`). The model's own loss
instead holds the logits' whole gradient beside them in backward (`grad`); the fused one, with
16-bit compute, the head's weight gradient summed in fp32 (`workspace`). The candidates are
made twice where a fused head is free to choose and its logits are a large share of the room
(act_candidates.HEAD_TWIN_SHARE): as below, and with the head recomputing, its checkpoint pinned (it is the
last unit of forward and the first of backward: its checkpoint would come straight back).

A fused head may also make its gradients in forward (grad_in_forward): it holds what keep holds
but the logits and h, and grad_h and the fp32 grad_W instead (`grads_held`), its forward h as
well; nothing moves, nothing runs again, and its backward's FLOPs are counted in its forward
(`forward_moved`). The twin of the candidates is made with it as with the recompute.

Note: the tail. A partial_host_tail unit (runtime/activations/policy.py) keeps the records of
its last TAIL_PIECES pieces on the device (for a block: the second norm's checkpoint and the
MLP's kept outputs, `ActUnit.tail`) and moves the others as partial_host does; a piece's records
are held back until the TAIL_PIECES-th piece after it opens, so its forward holds up to
TAIL_PIECES + 1 pieces' at once (`forward_bytes`), and what it holds from forward to backward is
its tail. Backward starts with the kept pieces and needs the swapped ones only after them (the
runtime fetches the last swapped piece first: backward.py `_fetch_floor`); the replay lets the
unit's backward start once the swapped bytes can be back by the time its kept pieces' backward is
done (simulate_act.py `_tail_credit`). Offered for the unit just before a fused head where the
room cannot keep it whole (act_candidates.py `_tails`): the head's forward follows it at once and
its backward comes first, so what it keeps is neither copied out nor fetched back. It does not
shorten forward where forward waits on the link: what the tail keeps is room the copies cannot
use, so forward still waits until the bytes produced before the head less the room are out.

Note: the release. A swapped partial piece's kept outputs that autograd does not save
(`partial_extra`: a Llama's q and k before the rotation; not o_proj's and down's outputs, which
reach no saved tensor and are not kept at all: runtime/activations/partial.py, Note on outputs
backward never reads) are read by its recompute only, and the runtime releases them once it ran (runtime/activations/saves.py
`_release_replayed`), where they were fetched back (RELEASES_REPLAYED: not those a partial unit
keeps on the device). The need still counts them (piece_peaks: at the recompute they are all
there); the replay lets the next unit's records come back beside the piece's backward without
them (simulate_act.py `_hold`), as the runtime's reserve does (backward.py, Note on the
reserve). Llama 7B b64 on random profile 29: the attention's backward holds 3.01 GiB, not 4.51,
and the next block's MLP records (3.19 GiB) come back during it in a 6.66 GiB room.

Note: the release within a piece. A swapped piecewise unit's piece (partial_host, partial_ssd and
recompute_pieces_host/ssd, not a tail) releases each of its saved tensors' storages once the
backward nodes that read them are done (runtime/activations/saves.py `_release_done`; a record
where it has device memory of its own: the replay splits pieces there on CUDA only), not at the
next piece: a Llama attention's rotated q/k, v, output and statistics once the attention's
backward ran, the MLP's gate and up once down's did (UnitProfile.piece_freed). Random profile 8,
Llama 7B b128 (9.21 GiB room): the attention held 6.02 GiB to its end, so the next block's MLP
records (7.38 GiB) came back only after it, in series with the compute (1.137x the time per
token of b64); holding 2 GiB from a third of its backward on, they come back during it (1.030x).
The need still counts each piece's peak (at its recompute), the replay the bytes it holds from
each release on (simulate_act.py `_marks`).

Note: the derived argument's source (REFETCH: partial_refetch_*, recompute_pieces_refetch_*,
partial_last_refetch_*, each as partial_*, recompute_pieces_*, partial_last_*). A swapped piece
whose argument is the previous piece's output (a block's attention and MLP take the norms'
outputs: runtime/activations/recompute.py, Note on derived checkpoints) has that argument made
again from the previous piece's checkpoint, which had to come back first. Under REFETCH's policies
the runtime then sends the checkpoint's device copy away again (its host buffer kept since the
copy up: no copy out; runtime/activations/saves.py `_evict_source`) and fetches it again within
the budget, for the previous piece's own recompute (the norm's backward reads its input). The
piece's recompute holds no checkpoint beside what it makes (`evicted`, piece_peaks): a GPT-3 13B
block's MLP at b64 holds 5.625 GiB, not 6.25 (random profile 29 bf16: no room for a second
weights buffer beside 6.25 GiB, each unit's weights fetched at its visit, 1.121x the time per
token of b32). The checkpoint is copied up twice (the replay's `_rest_up`: once more behind the
unit's other pieces). It is a policy of its own, chosen per unit, not what partial_host always
does: where the room holds the source, the second copy up only costs (session 11 sent it back at
every swapped piecewise unit: random profile 31, Llama 7B b128, 18.7 -> 25.8 s). The search
offers it only at rooms the least need with the sources held does not fit, and only to points
that fit some depth without it (act_candidates.py, Note on refetch; search.least_need).

Note: pieces. A recompute_pieces* unit (runtime/activations/manager.py, Note on pieces) runs
each child of its root as its own recompute segment from its own checkpoint: it is partial
without the operator log. So it is counted as the same unit seen as partial with no kept outputs
(`ActUnit.as_pieces`: each piece's inputs, nothing kept; `as_run` maps the policy to partial's
of the same tier), with one difference, its recompute's compute: the whole forward once
(recompute_fraction), between nested's (2 - last_piece_share) and partial's none. A unit without
pieces recomputes whole (recompute*'s accounting). Against nested it holds one more checkpoint a
block (kept, or moved: two swapped checkpoints a block) and runs one forward less than nested's
(1 - last_piece_share): the step that is nearly all compute at the micro-batch cliffs (issue 36,
docs/performance.md "Each piece from its own checkpoint").

Note: the last piece. A partial Llama block's attention piece keeps the q and k before the
rotation (its projections' outputs) and its recompute makes the rotated ones from them: at that
recompute it holds both, with its input, v, the output and the first norm's checkpoint (Llama 7B
b128: 8.02 GiB, where its pieces recomputed hold 7.38 at the MLP's). Random profile 0, Llama 7B
fp16 b128 (7.70 GiB room at k = 1): no block could be partial, every block recomputed piece by
piece (75.08 s, compute floor 73.59 s, 1.104x the time per token of b64). partial_last keeps the
MLP's gate and up (64% of the block's FLOPs, 5.38 of partial's 9.39 GiB kept there) and runs the
attention again from the norm's checkpoint: the attention's peak is pieces' (6.02 GiB), the MLP's
partial's (7.38), and half the blocks so (the others pieces) plan at 69.26 s (1.019x).

The choices the planner scores are made in act_candidates.py (ActPlanner).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Protocol, Sequence

from .act_policies import (  # noqa: F401 (re-exported: the names the accounting is read by)
    _AS_PARTIAL,
    _AS_WHOLE,
    AS_RUN,
    CHECKPOINT_SWAPS,
    GRAD_IN_FORWARD,
    LAST,
    LAST_SWAPS,
    NESTED,
    NESTED_SWAPS,
    PARTIAL,
    PIECES,
    PIECES_SWAPS,
    POLICIES,
    RECOMPUTE,
    REFETCH,
    RELEASES_REPLAYED,
    SWAPPING,
    TAIL,
    TAIL_PIECES,
    recomputes,
)


class Profiled(Protocol):
    """What act_units reads of a ModelProfile (model_profile.py, which imports plan.py, which
    describes a plan's activations with this module's accounting: so no import back)."""

    units: Sequence


# The fused causal-LM loss (runtime/activations/head.py) computes the logits, and in backward their
# gradient and its products with the head's weight and input, this many elements (rows x
# vocabulary) at a time: nothing of the size of the whole logits exists but the logits the head
# keeps for backward where its policy keeps them. A chunk's temporaries (its logits in fp32, their
# log-softmax and gradient: about 20 B an element, 320 MiB at most) are an operator's working
# memory, which the need counts for no operator (a block's MLP makes 4 x width a token).
LOSS_CHUNK_ELEMS = 1 << 24


def recompute_fraction(policy: str, unit: Optional[ActUnit] = None) -> float:
    """The share of the unit's forward FLOPs its recompute runs again: all of them; for nested
    the unit's and then each piece's but the last (its share: ActUnit.last_piece_share, 0 where
    not known); none for partial (only the cheap operators, which the FLOP count does not count
    either); recompute_pieces all of them, each piece once; partial_last all but its last
    piece's (all where that is not known, or the unit has no pieces: it recomputes whole)."""
    if policy in NESTED:
        return 2.0 - (unit.last_piece_share if unit is not None else 0.0)
    if policy in LAST:
        return 1.0 - (unit.last_piece_share if unit is not None and unit.pieces else 0.0)
    return 0.0 if policy in PARTIAL or not recomputes(policy) else 1.0


def checkpoint_tier(policy: str) -> str:
    """Where a recomputing unit's checkpoint is between its forward and its backward: "kept",
    "host" or "ssd"."""
    return CHECKPOINT_SWAPS.get(policy, "kept")


@dataclass(frozen=True)
class ActUnit:
    name: str
    saved: int  # bytes its forward saves for backward (one micro-batch)
    inputs: int  # bytes a recompute holds from forward to backward: its input
    flops: int  # forward FLOPs
    can_recompute: bool  # False where backward reads none of the unit's weights (embeddings)
    partial: int = 0  # bytes a partial unit keeps: its matmuls' and attention's outputs (0: not offered)
    partial_extra: int = 0  # of those, the bytes autograd does not save (held on top in backward)
    # a partial unit's pieces (the children of its root), forward order: (saved, inputs, partial,
    # partial_extra) each; () where it is one piece
    pieces: tuple[tuple[int, int, int, int], ...] = ()
    # per piece, the storages of its kept outputs in save order (UnitProfile.piece_kept; () not known)
    piece_kept: tuple[tuple[int, ...], ...] = ()
    piece_kept_at: tuple[tuple[float, ...], ...] = ()  # (when each is saved: UnitProfile.piece_kept_at)
    # per piece, what its backward is done with before it ends (UnitProfile.piece_freed; see the
    # Note on the release within a piece)
    piece_freed: tuple[tuple[tuple[float, int], ...], ...] = ()
    # a causal LM's head (see the Note on the head's loss): of `saved`, the logits a recompute
    # computes again chunk by chunk, and the loss's input, kept beside the checkpoint; the
    # logits' gradient its backward holds whole (the model's own loss, not fused); 0 elsewhere
    logits: int = 0
    loss_input: int = 0
    grad: int = 0
    workspace: int = 0  # the fused loss's backward beyond the gradients the buffers count
    weight_grad: int = 0  # its fp32 weight gradient, which grad_in_forward holds from its forward
    # a vertical window's unit (planner/vertical.py): every size above is this many micro-batches'
    # (the workspace one buffer's), which its visits run one at a time (see window_bytes)
    micro_batches: int = 1
    # of flops, the share in its last piece, which a nested recompute runs once (0: not known)
    last_piece_share: float = 0.0

    @functools.cached_property
    def as_pieces(self) -> ActUnit:
        """The unit as recompute_pieces counts it (see the Note on pieces): partial with no kept
        outputs, each piece's checkpoint its only record."""
        n = len(self.pieces)
        return replace(self, partial=0, partial_extra=0, pieces=tuple((p[0], p[1], 0, 0) for p in self.pieces),
                       piece_kept=((),) * n if self.piece_kept else (),
                       piece_kept_at=((),) * n if self.piece_kept_at else ())  # fmt: skip

    @functools.cached_property
    def as_last(self) -> ActUnit:
        """The unit as partial_last counts it (see the Note on the last piece): partial with kept
        outputs in its last piece only."""
        n = len(self.pieces)
        if not n:
            return self
        last = self.pieces[-1]
        return replace(self, partial=last[2], partial_extra=last[3],
                       pieces=tuple((p[0], p[1], 0, 0) for p in self.pieces[:-1]) + (last,),
                       piece_kept=((),) * (n - 1) + self.piece_kept[-1:] if self.piece_kept else (),
                       piece_kept_at=((),) * (n - 1) + self.piece_kept_at[-1:] if self.piece_kept_at else ())  # fmt: skip

    @property
    def partial_inputs(self) -> int:
        """A partial unit's checkpoints: every piece's inputs."""
        return sum(p[1] for p in self.pieces) if self.pieces else self.inputs

    @property
    def checkpoint(self) -> int:
        """What a recomputing unit holds or moves between its forward and its backward: its
        inputs, and a fused head's loss input."""
        return self.inputs + self.loss_input

    @property
    def grads_held(self) -> int:
        """What a grad_in_forward head holds from its forward to its backward: what it saves but
        the logits (its norm's; grad_h in place of h, the same bytes) and the fp32 weight
        gradient (one for each micro-batch of a vertical window)."""
        return self.saved - self.logits + self.weight_grad

    @property
    def tail(self) -> int:
        """What a partial_host_tail unit keeps on the device from its forward to its backward: its
        last TAIL_PIECES pieces' checkpoints and kept outputs (all of them where it has no more)."""
        if not self.pieces:
            return self.partial_inputs + self.partial
        return sum(p[1] + p[2] for p in self.pieces[-TAIL_PIECES:])

    def moved(self, policy: str) -> int:
        """Bytes that leave the device between its forward and its backward (swapping policies)."""
        if policy in AS_RUN:
            u, policy = as_run(self, policy)
            return u.moved(policy)
        policy = _head(self, policy)
        if policy == TAIL:
            return self.partial_inputs + self.partial - self.tail
        if policy in PARTIAL:
            return self.partial_inputs + self.partial
        return self.checkpoint if recomputes(policy) else self.saved

    def recomputed(self) -> int:
        """What a (whole) recompute holds once it ran: all the unit saved, its inputs among them,
        but a fused head's logits, which come one chunk at a time."""
        return max(self.saved - self.logits, self.checkpoint)

    def nested(self) -> int:
        """What a nested recompute holds at most once it ran (runtime/activations/nested.py,
        Note on nested): its pieces' held arguments (each piece's `inputs`: a block's norms take
        the residual stream, the attention and the MLP the norms' outputs, made again from the
        norms' arguments, 0) and the largest piece's saved bytes beyond its held argument; a unit
        without pieces recomputes whole."""
        if not self.pieces:
            return self.recomputed()
        held = sum(p[1] for p in self.pieces)
        return max(held + max(p[0] - p[1] for p in self.pieces), self.checkpoint)


def as_run(u: ActUnit, policy: str) -> tuple[ActUnit, str]:
    """(unit, policy) as the accounting counts them: a recompute_pieces unit as partial with no
    kept outputs (a partial_last unit: kept outputs in its last piece only), or as recompute where
    it has no pieces (see the Notes on pieces and on the last piece); else as given."""
    if policy not in AS_RUN:
        return u, policy
    if not u.pieces:
        return u, as_whole(policy)
    return (u.as_pieces if policy in PIECES else u.as_last), _AS_PARTIAL[policy]


def as_whole(policy: str) -> str:
    """The policy a recompute_pieces or partial_last unit with no pieces runs as (as_run): the
    whole recompute of its tier."""
    return _AS_WHOLE[policy]


def _pieces_as_run(f):
    """f(unit, policy, ...) with a recompute_pieces or partial_last policy counted as it runs (as_run)."""

    @functools.wraps(f)
    def counted(u: ActUnit, policy: str, *args):
        if policy in AS_RUN:
            u, policy = as_run(u, policy)
        return f(u, policy, *args)

    return counted


def _head(u: ActUnit, policy: str) -> str:
    """A fused head's partial policy as it runs: the logits are its matmul's output, which partial
    keeps (with the checkpoint's policy), so it holds and moves what keep / host / ssd would."""
    return CHECKPOINT_SWAPS.get(policy, "keep") if u.logits and policy in PARTIAL else policy


@_pieces_as_run
def held_bytes(u: ActUnit, policy: str) -> int:
    """Device bytes the unit holds from its forward to its backward."""
    policy = _head(u, policy)
    if policy == "partial":
        return u.partial_inputs + u.partial
    if policy == GRAD_IN_FORWARD:
        return u.grads_held
    if policy == TAIL:
        return u.tail
    return u.saved if policy == "keep" else u.checkpoint if policy in ("recompute", "recompute_nested") else 0


@_pieces_as_run
def backward_bytes(u: ActUnit, policy: str) -> int:
    """Device bytes the unit holds during its backward: all it saved (a recompute's inputs are
    counted until the recompute, then what it recomputed, as the runtime counts them: the
    first operator of a block saves its input, so the checkpoint is among them; a partial
    unit's kept outputs that autograd does not save are held on top, until the unit's end).

    A partial unit with pieces holds one piece's at a time: at piece k's recompute, all piece k
    saved and its kept outputs autograd does not save, what the pieces before it keep (partial:
    on the device all along) or, swapped, the previous piece's records (fetched once piece k
    recomputed); the pieces after it were released."""
    policy = _head(u, policy)
    if policy in PARTIAL and u.pieces:
        return max(piece_peaks(u, policy))
    if policy in PARTIAL:
        return max(u.saved, u.inputs) + u.partial_extra + u.grad + u.workspace
    if policy in NESTED:
        return u.nested() + u.grad + u.workspace
    if policy == GRAD_IN_FORWARD:  # (it scales what it holds: no workspace beyond it)
        return u.grads_held
    return (u.recomputed() if recomputes(policy) else u.saved) + u.grad + u.workspace


@_pieces_as_run
def piece_peaks(u: ActUnit, policy: str) -> list[int]:
    """A partial unit's device bytes at each piece's recompute, forward order (backward_bytes);
    a swapped one's piece whose argument is derived holds the previous piece's records without
    its checkpoint (see the Note on the derived argument's source)."""
    out, before, prev = [], 0, 0
    for (saved, inputs, part, extra), gone in zip(u.pieces, evicted(u, policy)):
        out.append((before if policy == "partial" else prev - gone) + saved + extra)
        prev = inputs + part
        before += prev
    # (backward runs the pieces last to first: piece k's "before" are those earlier in forward)
    return out


@_pieces_as_run
def evicted(u: ActUnit, policy: str) -> tuple[int, ...]:
    """Per piece, forward order: the previous piece's checkpoint bytes its recompute sends back
    to host memory once its derived argument is made (see the Note on the derived argument's
    source), fetched again for that piece's own recompute; 0 where none."""
    if policy not in REFETCH or not u.pieces:
        return (0,) * len(u.pieces)
    return tuple(
        u.pieces[k - 1][1] if k and inputs == 0 else 0 for k, (_, inputs, _, _) in enumerate(u.pieces)
    )


@_pieces_as_run
def window_bytes(u: ActUnit, policy: str, one: int) -> int:
    """What a unit of a vertical window holds at once at a visit that holds `one` bytes for the
    micro-batches it runs (forward_bytes', backward_bytes' count of its scaled sizes): it runs
    them one at a time, so the visit holds what the others keep (held_bytes of G - 1 of them)
    and one micro-batch's `one`; the fused loss's workspace is one buffer whatever G."""
    g = u.micro_batches
    if g == 1:
        return one
    held = held_bytes(u, policy)
    return held - held // g + (one - u.workspace) // g + u.workspace


@_pieces_as_run
def forward_bytes(u: ActUnit, policy: str) -> int:
    """Device bytes the unit's forward holds at once until its copies out are done: all it saves
    (keep, host, ssd), or what a recomputing unit holds or moves (its inputs; a partial unit's
    checkpoints and kept outputs: a swapped one's piece by piece, each piece's waiting for the
    earlier ones' copies), as the replay counts them (simulate_act.py forward_parts)."""
    policy = _head(u, policy)
    if policy == TAIL:  # (a piece's records leave when the TAIL_PIECES-th after it opens)
        moved = [p[1] + p[2] for p in u.pieces] or [u.tail]
        return max(sum(moved[k : k + TAIL_PIECES + 1]) for k in range(len(moved)))
    if policy in PARTIAL and policy in CHECKPOINT_SWAPS and u.pieces:
        return max(p[1] + p[2] for p in u.pieces)
    if policy in PARTIAL:
        return u.moved(policy)
    if policy == GRAD_IN_FORWARD:  # (h, its input, lives through the forward beside grad_h)
        return u.grads_held + u.loss_input
    return u.checkpoint if recomputes(policy) else u.saved


@_pieces_as_run
def peak_bytes_at(u: ActUnit, policy: str) -> int:
    """The unit's own share of the need at its visits: its forward's or its backward's, the
    larger (a partial unit's checkpoints and kept outputs all together can pass what its
    backward holds piece by piece); a vertical window's unit one micro-batch at a time
    (window_bytes)."""
    return window_bytes(u, policy, max(forward_bytes(u, policy), backward_bytes(u, policy)))


@_pieces_as_run
def split_bytes(u: ActUnit, policy: str) -> dict[str, int]:
    """Where the unit's activation bytes are between its forward and its backward: kept on the
    device, swapped to host, swapped to SSD (through host), recomputed; a recomputing unit's
    checkpoint (its inputs) counts where it is kept."""
    out = {"kept": 0, "host": 0, "ssd": 0, "recomputed": 0}
    policy = _head(u, policy)
    if policy in PARTIAL:  # the kept outputs autograd saves anyway are not recomputed
        out["recomputed"] = max(0, u.saved - (u.partial - u.partial_extra))
        out[checkpoint_tier(policy)] = u.moved(policy)
        if policy == TAIL:  # (its last pieces' stay)
            out["kept"] = u.tail
    elif recomputes(policy):
        out["recomputed"] = u.saved
        out[checkpoint_tier(policy)] = u.checkpoint
    elif policy == GRAD_IN_FORWARD:
        out["kept"] = u.grads_held
    else:
        out[{"keep": "kept", "host": "host", "ssd": "ssd"}[policy]] = u.saved
    return out


def sized_split(sizes: Sequence[int], policy: str) -> dict[str, int]:
    """split_bytes of a unit a plan knows by its activation_sizes (act_fill.with_activation_sizes:
    saved, checkpoint, kept by partial, of it not saved, tail, its pieces' checkpoints), with no
    pieces: a partial_host_tail unit keeps its tail; a partial_last one moves its first
    checkpoint and its tail (the second norm's checkpoint and the MLP's kept outputs), the rest
    runs again; a recompute_pieces one moves every piece's checkpoint (a block's two), where
    split_bytes of the piece-less unit would count one (`offloadpp plan` printed one, and the SSD
    room counted one: ssd_room.py)."""
    saved, ckpt, partial, extra, tail, ckpts = sizes  # (Plan pads an older plan file's)
    sp = split_bytes(ActUnit("", saved, ckpt, 0, True, partial, extra), policy)
    if policy == TAIL:  # (the unit here has no pieces: its tail from the sizes)
        return {**sp, "kept": tail, "host": sp["host"] + sp["kept"] - tail}
    if policy in LAST and tail:
        return {**sp, checkpoint_tier(policy): ckpt + tail, "recomputed": saved - (tail - ckpt)}
    if policy in PIECES and ckpts:
        return {**sp, checkpoint_tier(policy): ckpts}
    return sp


def forward_moved(fwd: Mapping[str, float], bwd: Mapping[str, float], policies: Mapping[str, str]):
    """(forward_s, backward_s) per unit with a grad_in_forward head's backward time counted in
    its forward, where it runs (its backward only scales what forward made); the dicts given
    when no unit makes its gradients in forward (they are shared: never written)."""
    moved = [n for n, p in policies.items() if p == GRAD_IN_FORWARD and n in bwd]
    if not moved:
        return fwd, bwd
    fwd, bwd = dict(fwd), dict(bwd)
    for n in moved:
        fwd[n], bwd[n] = fwd[n] + bwd[n], 0.0
    return fwd, bwd


def _per_unit(f):
    """f(unit, policy), remembered: the search asks the same units' sizes under each choice it
    makes, hundreds of thousands of times a plan (ActUnit is frozen; keyed by identity, the unit
    held in the entry so its id is not reused while it is there)."""
    memo: dict = {}

    def remembered(u: ActUnit, policy: str) -> int:
        e = memo.get((id(u), policy))
        if e is not None and e[0] is u:
            return e[1]
        n = f(u, policy)
        if len(memo) >= 1 << 16:
            memo.clear()
        memo[(id(u), policy)] = (u, n)
        return n

    return functools.wraps(f)(remembered)


peak_bytes_at = _per_unit(peak_bytes_at)
backward_bytes = _per_unit(backward_bytes)
evicted = _per_unit(evicted)  # (the replay asks it at each fetch)


def act_units(model: Profiled) -> tuple[ActUnit, ...]:
    """The model's units as the activation accounting sees them, in forward order (a vertical
    window's profile: each unit's micro-batches, ModelProfile.window)."""
    out, prev = [], 0
    g = getattr(model, "window", 1)
    for u in model.units:
        loss = ({"logits": u.logits_bytes, "loss_input": u.loss_input_bytes, "workspace": u.loss_workspace_bytes,
                 "weight_grad": u.loss_weight_grad_bytes * g}
                if u.fused_loss else {"grad": u.logits_bytes})  # fmt: skip
        out.append(ActUnit(u.name, u.activation_bytes, prev, u.forward_flops, u.backward_needs_weights,
                           u.partial_bytes, u.partial_extra_bytes, u.pieces, piece_kept=u.piece_kept, **loss,
                           piece_kept_at=u.piece_kept_at, piece_freed=u.piece_freed, micro_batches=g,
                           last_piece_share=u.last_piece_share))  # fmt: skip
        prev = u.output_bytes
    return tuple(out)


def need_bytes(units: Sequence[ActUnit], policies: Mapping[str, str]) -> int:
    """Device bytes the saved activations need at their peak under `policies` (unit -> policy;
    units not named keep). See the module Note."""
    held = peak = 0
    for u in units:
        p = policies.get(u.name, "keep")
        peak = max(peak, held + peak_bytes_at(u, p))
        held += held_bytes(u, p)
    return peak


__all__ = ["AS_RUN", "ActUnit", "CHECKPOINT_SWAPS", "GRAD_IN_FORWARD", "LAST", "LAST_SWAPS", "LOSS_CHUNK_ELEMS", "NESTED", "PARTIAL", "PIECES",
           "PIECES_SWAPS", "POLICIES", "RECOMPUTE", "REFETCH", "RELEASES_REPLAYED", "SWAPPING", "TAIL", "TAIL_PIECES", "act_units", "as_run", "as_whole",
           "backward_bytes", "checkpoint_tier", "evicted", "forward_bytes", "forward_moved", "held_bytes", "need_bytes", "peak_bytes_at", "piece_peaks",
           "recompute_fraction", "recomputes", "sized_split", "split_bytes"]  # fmt: skip
