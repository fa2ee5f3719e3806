"""ModelProfile: per unit, parameter count, saved-activation bytes, FLOPs and (when measured) time.

Pure (no torch). Filled either by one profiling iteration of the real model
(offloadpp/profiling/model.py: hooks per unit, saved_tensors_hooks, FlopCounterMode) or
analytically from a Hugging Face config (`analytic_profile`, for GPT-2 and Llama-style models,
no weights needed). Unit names and sizes are the runtime's (runtime/partition.py), so a plan made
from a profile runs on the model it was made for.

Note: measured times. A measured profile also carries each unit's forward and backward seconds
on the device it ran on (the forward visit spans from the unit's first module to the next unit's,
the loss included in the last; the backward visit from the gradient reaching the unit's outputs
to it reaching the previous unit's). The cost model uses them on that device kind and falls back
to FLOPs / the hardware's FLOP/s elsewhere: GEMM FLOP/s alone miss the attention, norm and
element-wise time that small models spend most of a CPU step in.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping, Optional

from .plan import DTYPE_BYTES, UnitSpec


class ModelProfileError(ValueError):
    """A model profile that cannot be used; the message names the field and the value."""


@dataclass(frozen=True)
class UnitProfile:
    name: str
    numel: int  # parameters owned (unpadded), as UnitSpec
    forward_flops: int
    backward_flops: int
    activation_bytes: (
        int  # tensors the unit's forward saves for backward (parameters excluded), one micro-batch
    )
    output_bytes: int = 0  # the unit's output (what a recomputing unit needs kept to run again)
    borrows: tuple[str, ...] = ()
    backward_needs_weights: bool = True
    # partial (selective recompute): the bytes of the outputs of its matmuls and attention, which a
    # partial unit keeps or swaps, and of those the bytes autograd does not save anyway (held on
    # top of what its backward recomputes); 0: not known, partial not offered
    partial_bytes: int = 0
    partial_extra_bytes: int = 0
    # a partial unit runs each child of its root as a piece (runtime/activations/manager.py, Note
    # on pieces): per piece in forward order (saved, inputs, partial, partial_extra) bytes
    pieces: tuple[tuple[int, int, int, int], ...] = ()
    # per piece, the storages of its kept outputs (its `partial` bytes) in the order its forward
    # saves them: each is a record of its own, whose copy out frees its bytes when it ends
    # (runtime/activations/swap.py); () where not known: a piece's kept outputs count as one
    piece_kept: tuple[tuple[int, ...], ...] = ()
    # and for each of those storages the share of its piece's forward FLOPs run when it is saved
    # (the end of the matmul or attention that makes it); () where not known
    piece_kept_at: tuple[tuple[float, ...], ...] = ()
    # per piece, the bytes of its saved tensors that its backward is done with before it ends, as
    # (share of the piece's backward FLOPs run when the node that last reads them is done, bytes),
    # in backward order: a swapped piece's backward releases them then (runtime/activations/
    # saves.py `_release_done`; planner/activations.py, Note on the release within a piece); ()
    # where not known: held until the piece's backward ends
    piece_freed: tuple[tuple[tuple[float, int], ...], ...] = ()
    # of forward_flops, the share in the root's last child (a block's MLP), which a nested recompute
    # runs once (runtime/activations/nested.py, Note on nested); 0: not known (it runs twice)
    last_piece_share: float = 0.0
    forward_s: Optional[float] = None  # measured, one micro-batch (see the module note)
    backward_s: Optional[float] = None
    frozen_numel: int = 0  # frozen parameters owned, apart from numel (UnitSpec.frozen_numel)
    frozen_dtype: Optional[str] = None  # their 16-bit dtype where they have one (UnitSpec.frozen_dtype)
    # a causal LM's head (analytic profiles): of activation_bytes, the logits its loss reads and
    # the loss's input (the final norm's output, in the compute dtype); fused_loss: the runtime's fused
    # head and loss run it (ActivationSettings.fused_loss), so a recomputing head computes its
    # logits again chunk by chunk and no backward holds their whole gradient; else the model's
    # own loss, whose backward holds the logits' gradient beside them. 0: not a causal-LM head
    logits_bytes: int = 0
    loss_input_bytes: int = 0
    # the fused loss's backward beyond the head's weight gradient the buffers count: with 16-bit
    # compute, that gradient summed in fp32 over the chunks (runtime/activations/head.py, Note on
    # exactness): vocabulary x width x 4 bytes, 0.96 GiB at GPT-3 13B
    loss_workspace_bytes: int = 0
    # the fused head's weight (and bias) gradient summed in fp32, which its `grad_in_forward`
    # policy makes in forward and holds until backward (runtime/activations/head.py, Note on
    # gradients in forward): vocabulary x width x 4 bytes whatever the compute dtype
    loss_weight_grad_bytes: int = 0
    fused_loss: bool = True

    def __post_init__(self) -> None:
        for name in ("numel", "forward_flops", "backward_flops", "activation_bytes", "output_bytes", "partial_bytes",
                     "partial_extra_bytes", "frozen_numel", "logits_bytes", "loss_input_bytes",
                     "loss_workspace_bytes", "loss_weight_grad_bytes"):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ModelProfileError(f"unit {self.name!r}: {name} must be an int >= 0, got {v!r}")
        if not isinstance(self.last_piece_share, (int, float)) or not 0 <= self.last_piece_share <= 1:
            raise ModelProfileError(
                f"unit {self.name!r}: last_piece_share must be a share in [0, 1], got {self.last_piece_share!r}"
            )
        for name in ("forward_s", "backward_s"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or v < 0):
                raise ModelProfileError(f"unit {self.name!r}: {name} must be None or seconds >= 0, got {v!r}")
        if self.piece_kept and [sum(k) for k in self.piece_kept] != [p[2] for p in self.pieces]:
            raise ModelProfileError(
                f"unit {self.name!r}: piece_kept must give each piece's kept storages, summing to its "
                f"partial bytes {[p[2] for p in self.pieces]}, got {[list(k) for k in self.piece_kept]}"
            )
        at = self.piece_kept_at
        if at and (
            [len(a) for a in at] != [len(k) for k in self.piece_kept]
            or any(not 0 <= x <= y <= 1 for a in at for x, y in zip((0.0,) + tuple(a), a))
        ):
            raise ModelProfileError(
                f"unit {self.name!r}: piece_kept_at must give, for each of piece_kept's storages, a "
                f"non-decreasing share of its piece's FLOPs in [0, 1], got {[list(a) for a in at]}"
            )

        freed = self.piece_freed
        if freed and (
            len(freed) != len(self.pieces)
            or any(not 0 <= a <= b <= 1 for f in freed for (a, _), (b, _) in zip(((0.0, 0),) + tuple(f), f))
            or any(not isinstance(n, int) or n < 0 for f in freed for _, n in f)
            or any(sum(n for _, n in f) > p[0] for f, p in zip(freed, self.pieces))
        ):
            raise ModelProfileError(
                f"unit {self.name!r}: piece_freed must give, for each piece, (share of its backward, bytes) "
                f"pairs of non-decreasing shares in [0, 1] and at most the piece's saved bytes, got {freed!r}"
            )

    def spec(self) -> UnitSpec:
        return UnitSpec(self.name, self.numel, tuple(self.borrows), self.backward_needs_weights,
                        frozen_numel=self.frozen_numel, frozen_dtype=self.frozen_dtype)  # fmt: skip


@dataclass(frozen=True)
class ModelProfile:
    model: str  # a name for humans (preset, HF model type, path)
    micro_batch: int
    seq_len: int
    compute_dtype: str
    units: tuple[UnitProfile, ...]  # forward order
    source: str = "analytic"  # "analytic" | "measured"
    measured_device: Optional[str] = None  # "cpu" | "cuda": where forward_s/backward_s were taken
    torch_threads: Optional[int] = None
    gemms: tuple[tuple[int, int, int], ...] = ()  # (m, k, n) of the model's matmuls, for `offloadpp profile`
    # a vertical window's profile (planner/vertical.py window_profile): its sizes are this many
    # micro-batches' of micro_batch / window sequences each, which each visit runs one at a time
    window: int = 1

    def __post_init__(self) -> None:
        if self.compute_dtype not in DTYPE_BYTES:
            raise ModelProfileError(
                f"ModelProfile.compute_dtype must be one of {tuple(DTYPE_BYTES)}, got {self.compute_dtype!r}"
            )
        if self.micro_batch < 1 or self.seq_len < 1:
            raise ModelProfileError(
                f"ModelProfile.micro_batch and seq_len must be >= 1, got {self.micro_batch}, {self.seq_len}"
            )
        if not self.units:
            raise ModelProfileError("ModelProfile.units is empty: the model has no parameters")
        if self.source not in ("analytic", "measured"):
            raise ModelProfileError(
                f"ModelProfile.source must be 'analytic' or 'measured', got {self.source!r}"
            )
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ModelProfileError(f"ModelProfile.units has duplicate names: {names}")

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def unit_specs(self) -> tuple[UnitSpec, ...]:
        return tuple(u.spec() for u in self.units)

    def with_frozen_split(self, units) -> ModelProfile:
        """This (analytic) profile's units as a model with frozen parameters has them (a peft
        model: its blocks under a prefix, the adapters trainable, the base frozen; docs/frozen.md):
        the same units in the same order take the model's names and trainable/frozen split and keep
        the analytic FLOPs and activations of the base (the adapters' are small; a frozen weight's
        backward computes no weight gradient, which the analytic FLOPs still count). Otherwise
        the profile as it is."""
        if len(self.units) != len(units) or not any(u.frozen_numel for u in units):
            return self
        if not all(u.name == p.name or u.name.endswith("." + p.name) for p, u in zip(self.units, units)):
            return self
        return replace(self, units=tuple(
            replace(p, name=u.name, numel=u.numel, frozen_numel=u.frozen_numel, frozen_dtype=u.frozen_dtype,
                    borrows=tuple(u.borrows), backward_needs_weights=u.backward_needs_weights)
            for p, u in zip(self.units, units)
        ))  # fmt: skip

    def with_fused_loss(self, fused: bool) -> ModelProfile:
        """This profile with its head's loss fused or not (ActivationSettings.fused_loss)."""
        if all(u.fused_loss == fused for u in self.units):
            return self
        return replace(self, units=tuple(replace(u, fused_loss=fused) for u in self.units))

    def unit(self, name: str) -> UnitProfile:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit named {name!r} in the model profile")

    def has_times(self, device: str) -> bool:
        return self.measured_device == device and all(
            u.forward_s is not None and u.backward_s is not None for u in self.units
        )

    def without_times(self) -> ModelProfile:
        return replace(self, units=tuple(replace(u, forward_s=None, backward_s=None) for u in self.units),
                       measured_device=None)  # fmt: skip

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["units"] = [asdict(u) for u in self.units]
        for u in d["units"]:
            u["borrows"] = list(u["borrows"])
        d["gemms"] = [list(g) for g in self.gemms]
        return d

    def to_json(self, path: Optional[str] = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ModelProfileError(f"model profile has unknown field(s) {unknown}")
        kw = dict(d)
        kw["units"] = tuple(
            UnitProfile(**{**u, "borrows": tuple(u.get("borrows", ())),
                           "pieces": tuple(tuple(int(x) for x in p) for p in u.get("pieces", ())),
                           "piece_kept": tuple(tuple(int(x) for x in p) for p in u.get("piece_kept", ())),
                           "piece_kept_at": tuple(tuple(float(x) for x in p) for p in u.get("piece_kept_at", ())),
                           "piece_freed": tuple(tuple((float(a), int(n)) for a, n in p)
                                                for p in u.get("piece_freed", ()))})
            for u in d["units"]
        )  # fmt: skip
        kw["gemms"] = tuple(tuple(int(x) for x in g) for g in d.get("gemms", ()))
        return cls(**kw)

    @classmethod
    def from_json(cls, path_or_text: str) -> ModelProfile:
        text = path_or_text
        if not path_or_text.lstrip().startswith("{"):
            if not os.path.isfile(path_or_text):
                raise ModelProfileError(f"model profile {path_or_text!r} does not exist")
            with open(path_or_text) as f:
                text = f.read()
        return cls.from_dict(json.loads(text))

    def describe(self) -> str:
        lines = [
            f"model: {self.model} ({self.numel:,} params, {len(self.units)} units), micro-batch "
            f"{self.micro_batch}x{self.seq_len}, {self.compute_dtype}, {self.source}"
            + (f" on {self.measured_device}" if self.measured_device else ""),
            f"  {'unit':<24} {'params':>12} {'fwd GFLOP':>10} {'bwd GFLOP':>10} {'act MiB':>8} {'fwd ms':>8} {'bwd ms':>8}",
        ]
        for u in self.units:
            fs = f"{u.forward_s * 1e3:.1f}" if u.forward_s is not None else "-"
            bs = f"{u.backward_s * 1e3:.1f}" if u.backward_s is not None else "-"
            lines.append(
                f"  {u.name:<24} {u.numel:>12,} {u.forward_flops / 1e9:>10.2f} {u.backward_flops / 1e9:>10.2f} "
                f"{u.activation_bytes / 2**20:>8.1f} {fs:>8} {bs:>8}"
            )
        return "\n".join(lines)


# ---- the analytic path ----------------------------------------------------------------------
# A GPT-2 MLP's tensors saved at the inner width, from c_fc's output to c_proj's input, by the
# config's `activation_function` (Hugging Face's ACT2FN names). The tanh-form formulas
# (`gelu_new`, GPT-2's default; `gelu_fast`; `gelu_python_tanh`) save four such tensors under
# plain autograd, but the runtime replaces them by a Function saving only its input
# (offloadpp/runtime/activations/gelu.py), and torch's own GELUs save only their input: c_fc's
# output (the activation's input) and c_proj's input (its output). Any other function: its
# formula's count unknown here, the tanh form's plain count as a bound (profile the model).
MLP_SAVED = {name: 2 for name in ("gelu_new", "gelu_fast", "gelu_python_tanh", "gelu", "gelu_pytorch_tanh")}
MLP_SAVED_OTHER = 5
# A Llama-family MLP's (down(act(gate(x)) * up(x))) tensors saved at the inner width: gate's and
# up's outputs, whatever its act_fn (offloadpp/runtime/activations/swiglu.py)
GATED_MLP_SAVED = 2


def _get(cfg: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    if default is not None:
        return default
    raise ModelProfileError(f"model config lacks {names[0]!r} (also looked for {list(names[1:])})")


def _loss_bytes(tokens: int, width: int, vocab: int, eb: int) -> dict[str, int]:
    """A causal-LM head's loss fields (UnitProfile.logits_bytes and friends)."""
    return {"logits_bytes": tokens * vocab * eb, "loss_input_bytes": tokens * width * eb,
            "loss_workspace_bytes": vocab * width * 4 if eb < 4 else 0,
            "loss_weight_grad_bytes": vocab * width * 4}  # fmt: skip


def analytic_profile(
    config: Mapping[str, Any], *, micro_batch: int, seq_len: int, compute_dtype: str = "fp32", name: str = ""
) -> ModelProfile:
    """A profile from a Hugging Face config dict (config.json), no weights: GPT-2 and the
    Llama family (llama, qwen2, mistral). Parameter counts are exact; FLOPs count the matmuls
    (2 per multiply-add, backward twice forward); activation bytes count what autograd saves in
    eager mode with SDPA attention (inputs of each linear, norm and activation function, q/k/v,
    the attention output and its statistics, the logits for the loss), checked against measured
    GPT-2 and Llama profiles (tests/test_profiling.py)."""
    mtype = str(config.get("model_type", "")).lower()
    b, s = micro_batch, seq_len
    t = b * s
    eb = DTYPE_BYTES[compute_dtype]
    if mtype == "gpt2":
        d = int(_get(config, "n_embd", "hidden_size"))
        n_layer = int(_get(config, "n_layer", "num_hidden_layers"))
        vocab = int(_get(config, "vocab_size"))
        npos = int(_get(config, "n_positions", "max_position_embeddings"))
        inner = int(config.get("n_inner") or 4 * d)
        tied = bool(config.get("tie_word_embeddings", True))
        block_numel = 4 * d + 3 * d * d + 3 * d + d * d + d + 2 * d * inner + inner + d
        lin = 3 * d * d + d * d + 2 * d * inner
        # saved: ln_1 in and out, q/k/v, attention out and its log-sum-exp, ln_2 in and out, c_fc
        # in, the cache's copies of k and v; at the inner width what the activation function
        # saves (MLP_SAVED). With use_cache (GPT-2's default, in training too) the block appends
        # its keys and values to a cache by torch.cat: the attention saves those copies, not
        # views of c_attn's output.
        wide = MLP_SAVED.get(str(config.get("activation_function") or "gelu_new"), MLP_SAVED_OTHER)
        cache = 2 if config.get("use_cache", True) else 0
        heads = int(_get(config, "n_head", "num_attention_heads"))
        act_elems = t * ((8 + cache) * d + wide * inner) + 2 * b * s * heads
        units = [UnitProfile("embed", vocab * d + npos * d, 0, 0, 8 * t, t * d * eb, (), False)]
        # partial keeps the matmuls' and the attention's outputs that backward reads: c_attn's
        # (q/k/v), the attention output and its log-sum-exp, c_fc's (saved anyway); not the two
        # projections' (c_proj's), which reach no saved tensor: the recompute is handed zeros in
        # their place (runtime/activations/partial.py, Note on outputs backward never reads),
        # which hold no bytes, and they are never moved
        # pieces: ln_1 (its input), attn (its input, q/k/v, the attention output and statistics:
        # recomputed without the cache, so no copies of k and v; keeps q/k/v and the output),
        # ln_2, mlp (its input, c_fc's output and what the activation function saves at the inner
        # width; keeps c_fc's output). The attention's and the MLP's inputs are the norms'
        # outputs: no checkpoint of their own, the norm runs again from its own
        # (runtime/activations/recompute.py, Note on derived checkpoints)
        lse, x = 2 * b * s * heads * eb, t * d * eb
        norm = (x, x, 0, 0)
        pieces = (norm, (5 * x + lse, 0, 4 * x + lse, 0), norm,
                  (x + wide * t * inner * eb, 0, t * inner * eb, 0))  # fmt: skip
        # (the kept storages in save order: c_attn's q/k/v, the attention's output and statistics,
        # each a record once the attention's node saves it; c_fc's)
        kept = ((), (3 * x, x, lse), (), (t * inner * eb,))
        qkv, core, proj = 6 * t * d * d, 4 * b * s * s * d, 2 * t * d * d  # (the attention's FLOPs)
        a1 = (qkv + core) / (qkv + core + proj)
        kept_at = ((), (a1, a1, a1), (), (0.5,))  # (c_fc and c_proj: as many FLOPs)
        units += [
            UnitProfile(f"transformer.h.{i}", block_numel, 2 * t * lin + 4 * b * s * s * d,
                        2 * (2 * t * lin + 4 * b * s * s * d), act_elems * eb, t * d * eb,
                        partial_bytes=sum(p[2] for p in pieces), partial_extra_bytes=sum(p[3] for p in pieces),
                        pieces=pieces, piece_kept=kept, piece_kept_at=kept_at,
                        last_piece_share=4 * t * d * inner / (2 * t * lin + 4 * b * s * s * d))
            for i in range(n_layer)
        ]  # fmt: skip
        head_numel = 2 * d + (0 if tied else vocab * d)
        # saved: ln_f's input, its output (the loss's input) and the logits (runtime/activations/loss.py)
        units.append(UnitProfile("head", head_numel, 2 * t * d * vocab, 4 * t * d * vocab,
                                 (2 * t * d + t * vocab) * eb, t * vocab * eb, ("embed",) if tied else (),
                                 **_loss_bytes(t, d, vocab, eb)))  # fmt: skip
        gemms = ((t, d, 3 * d), (t, d, d), (t, d, inner), (t, inner, d), (t, d, vocab))
    elif mtype in ("llama", "qwen2", "mistral"):
        d = int(_get(config, "hidden_size"))
        n_layer = int(_get(config, "num_hidden_layers"))
        vocab = int(_get(config, "vocab_size"))
        ff = int(_get(config, "intermediate_size"))
        heads = int(_get(config, "num_attention_heads"))
        kv = int(config.get("num_key_value_heads") or heads)
        hd = int(config.get("head_dim") or d // heads)
        tied = bool(config.get("tie_word_embeddings", False))
        qkv_bias = mtype == "qwen2" or bool(config.get("attention_bias", False))
        attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d + ((heads + 2 * kv) * hd if qkv_bias else 0)
        block_numel = attn + 3 * d * ff + 2 * d
        lin = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * ff
        attn_flops = 4 * b * s * s * heads * hd
        # at the inner width the MLP saves gate's and up's outputs only: the runtime makes the
        # activation's output and the product again in backward (runtime/activations/swiglu.py),
        # where plain autograd saves them too (4; peft's LoRA on down_proj: profile the model)
        act_elems = t * (6 * d + 2 * heads * hd + 2 * kv * hd + GATED_MLP_SAVED * ff) + 2 * b * s * heads
        units = [UnitProfile("embed", vocab * d, 0, 0, 8 * t, t * d * eb, (), False)]
        # partial keeps q/k/v, the attention output and statistics, gate and up (saved anyway); not
        # o_proj's and down's outputs, which reach no saved tensor (zeros in their place, as for
        # GPT-2: runtime/activations/partial.py, Note on outputs backward never reads)
        # pieces: the two norms (2 x width each), self_attn (its input, rotated q/k, v, the output
        # and statistics; keeps q/k/v's projections and the output: q/k's projections are not
        # saved otherwise, the rotated q/k made from them are), mlp (its input, gate and up: their
        # activation and product are made again in backward; keeps gate and up); the
        # attention's and the MLP's inputs are the norms' outputs, derived again (as for GPT-2)
        x, q, k, f = t * d * eb, t * heads * hd * eb, t * kv * hd * eb, t * ff * eb
        lse = 2 * b * s * heads * eb
        norm = (2 * x, x, 0, 0)
        pieces = (norm, (x + 2 * q + 2 * k + lse, 0, 2 * q + 2 * k + lse, q + k), norm,
                  (x + GATED_MLP_SAVED * f, 0, 2 * f, 0))  # fmt: skip
        kept = (
            (),
            (q, k, k, q, lse),
            (),
            (f, f),
        )  # (q/k/v's and the attention's, each a record once the attention's node saves what is made
        # from it; gate, up)
        fl = (q, k, k, attn_flops * eb / (2 * d), 0, q)  # (the FLOPs that make each, over 2 x width / eb)
        at = sum(fl[:4]) / sum(fl)
        kept_at = ((), (at,) * 5, (), (2 / 3, 2 / 3))  # (gate once swiglu.py saves it beside up)
        # what each piece's backward is done with before it ends (see UnitProfile.piece_freed): a
        # norm's output once its first node (the weight's product) ran; the attention's rotated
        # q/k, v, output and statistics once o_proj's and the attention's backward ran (its input,
        # read by q/k/v's projections, to the end); the MLP's gate and up once down's backward ran
        # (swiglu.py: one node), its input to the end. Each op's backward is twice its forward.
        o_at = (2 * t * heads * hd * d + attn_flops) / (2 * t * (lin - 3 * d * ff) + attn_flops)
        freed = (((0.0, x),), ((o_at, 2 * q + 2 * k + lse),), ((0.0, x),), ((1 / 3, GATED_MLP_SAVED * f),))
        units += [
            UnitProfile(f"model.layers.{i}", block_numel, 2 * t * lin + attn_flops, 2 * (2 * t * lin + attn_flops),
                        act_elems * eb, t * d * eb, partial_bytes=sum(p[2] for p in pieces),
                        partial_extra_bytes=sum(p[3] for p in pieces), pieces=pieces, piece_kept=kept,
                        piece_kept_at=kept_at, piece_freed=freed,
                        last_piece_share=6 * t * d * ff / (2 * t * lin + attn_flops))
            for i in range(n_layer)
        ]  # fmt: skip
        units.append(UnitProfile("head", d + (0 if tied else vocab * d), 2 * t * d * vocab, 4 * t * d * vocab,
                                 (3 * t * d + t * vocab) * eb, t * vocab * eb, ("embed",) if tied else (),
                                 **_loss_bytes(t, d, vocab, eb)))  # fmt: skip
        gemms = ((t, d, heads * hd), (t, d, kv * hd), (t, d, ff), (t, ff, d), (t, d, vocab))
    else:
        raise ModelProfileError(
            f"config.model_type {mtype!r}: the analytic profile knows 'gpt2', 'llama', 'qwen2' and 'mistral'; "
            "profile the model instead (offloadpp.profiling.profile_model)"
        )
    return ModelProfile(name or mtype, b, s, compute_dtype, tuple(units), "analytic", gemms=gemms)
