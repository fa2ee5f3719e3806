"""A step's SSD bytes by kind: weights, gradients, optimizer state, activations; read and
written. One definition for the runtime, which counts at its I/O calls by the kind tag of the
array each call moves (TensorStore.tagged), and the cost model, which counts its replay's
requests by their keys (cost.replay): DESIGN.md, "Bytes per step".

Note: which array is which kind. A unit's arrays (Plan.homes: master, weights, exp_avg,
exp_avg_sq, grads) map to kinds by ARRAY_KINDS, with one exception: where the compute copy is
the fp32 master itself (fp32 compute, Plan.separate_weights False), the master's bytes are the
weights' (it is what forward and backward fetch); with 16-bit compute the master is optimizer
state next to the moments, and the 16-bit compute copy is the weights.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from .plan import fmt_bytes

KINDS = ("weights", "gradients", "optimizer_state", "activations")
ARRAY_KINDS = {
    "weights": "weights",
    "frozen": "weights",  # a unit's frozen segment: read with its weights, never written
    "master": "optimizer_state",
    "exp_avg": "optimizer_state",
    "exp_avg_sq": "optimizer_state",
    "grads": "gradients",
    "grad_shard": "gradients",  # over several ranks: this rank's reduced shard (runtime/dp/sharded.py)
}
ACTIVATION_PREFIX = "act."  # the replay's activation keys (simulate_act.py)

# (kind, bytes read, bytes written), one per kind in KINDS' order: what a report carries.
ByKind = tuple[tuple[str, int, int], ...]


def array_kind(array: str, separate_weights: bool) -> str:
    """The kind of a unit's array (see the module Note)."""
    if array == "master" and not separate_weights:
        return "weights"
    try:
        return ARRAY_KINDS[array]
    except KeyError:
        raise ValueError(f"array {array!r}: not one of {sorted(ARRAY_KINDS)}") from None


def key_kind(key: str, separate_weights: bool) -> str:
    """The kind of a replay key: `act.<unit>`, or `<unit>.<array>`."""
    if key.startswith(ACTIVATION_PREFIX):
        return "activations"
    return array_kind(key.rsplit(".", 1)[-1], separate_weights)


def tally(counts: Iterable[tuple[str, bool, int]]) -> ByKind:
    """(kind, write?, bytes) counts -> ByKind, every kind present (0 where none moved)."""
    read = dict.fromkeys(KINDS, 0)
    written = dict.fromkeys(KINDS, 0)
    for kind, write, nbytes in counts:
        if kind not in read:
            raise ValueError(f"kind {kind!r}: not one of {KINDS}")
        (written if write else read)[kind] += nbytes
    return tuple((k, read[k], written[k]) for k in KINDS)


def by_key_kinds(by_key_dir: Mapping[tuple[str, bool], int], separate_weights: bool) -> ByKind:
    """The replay's bytes per (key, write?) -> ByKind."""
    return tally((key_kind(k, separate_weights), w, n) for (k, w), n in by_key_dir.items())


def describe(by_kind: ByKind) -> str:
    """`weights r 1.2 GiB w 0 B, gradients r ... ` for a report line."""
    return ", ".join(f"{k} r {fmt_bytes(r)} w {fmt_bytes(w)}" for k, r, w in by_kind)


def table(measured: ByKind, predicted: ByKind = ()) -> str:
    """A Markdown table of a step's SSD bytes by kind, the cost model's beside where given."""
    pred = {k: (r, w) for k, r, w in predicted}
    # decided before "total" goes into pred: a table without a cost model's figure has 3 columns
    with_pred = bool(pred)
    head = "| SSD bytes per step | read | written |" + (" cost model read | written |" if with_pred else "")
    lines = [head, "|---" * (3 + 2 * with_pred) + "|"]
    rows = list(measured) + [("total", sum(r for _, r, _ in measured), sum(w for _, _, w in measured))]
    pred["total"] = (sum(r for r, _ in pred.values()), sum(w for _, w in pred.values()))
    for k, r, w in rows:
        line = f"| {k} | {fmt_bytes(r)} | {fmt_bytes(w)} |"
        if with_pred:
            pr, pw = pred.get(k, (0, 0))
            line += f" {fmt_bytes(pr)} | {fmt_bytes(pw)} |"
        lines.append(line)
    return "\n".join(lines)


def median(reports: Iterable[ByKind]) -> ByKind:
    """Per kind and direction, the median over several steps' ByKind."""
    import statistics

    rows = [dict((k, (r, w)) for k, r, w in b) for b in reports if b]
    if not rows:
        return ()
    return tuple(
        (k, int(statistics.median(x[k][0] for x in rows)), int(statistics.median(x[k][1] for x in rows)))
        for k in KINDS
    )
