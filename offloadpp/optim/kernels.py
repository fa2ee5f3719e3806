"""Flat-buffer entry points of the fused CPU Adam kernel (csrc/adam/), for the out-of-core
optimizer and for CPUAdam.

Tensors are checked here (device, dtype, contiguity, sizes; ``ValueError`` naming the argument),
then only addresses and sizes go to ``offloadpp._C``, which runs without the GIL. One call
covers a whole shard, or many tensors at once: no Python loop per tensor in the hot path.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

import offloadpp._C as _C
from offloadpp.optim.hyper import AdamHyper

# dtype codes understood by offloadpp._C (csrc/adam/adam_kernel.h, enum DType)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NO_DTYPE = 3
HALF_DTYPES = (torch.bfloat16, torch.float16)
# An extension built before sum_parts_ existed (a tree whose _C was copied before it): callers
# sum with torch instead (runtime/window_grads.py), the same bits, slower, until it is rebuilt.
HAVE_SUM_PARTS = hasattr(_C, "adam_sum")

__all__ = [
    "StateCrcs",
    "adam_step_flat",
    "adam_step_pieces",
    "squared_norm",
    "all_finite",
    "convert_",
    "sum_parts_",
    "default_num_threads",
    "kernel_isa",
    "bandwidth_floor",
    "simd_levels",
]


def default_num_threads() -> int:
    """Threads a kernel call uses when none is given: every core this process may run on."""
    return int(_C.adam_default_threads())


def kernel_isa() -> str:
    """The kernel variant calls use now: "avx512", "avx2" or "scalar" (after OFFLOADPP_SIMD)."""
    return str(_C.adam_isa())


def simd_levels() -> dict:
    """The SIMD level the CPU supports ("detected") and the one the kernels run ("active")."""
    return {"detected": _C.detected_simd_level(), "active": _C.simd_level()}


def _threads(num_threads: Optional[int], name: str = "num_threads") -> int:
    if num_threads is None:
        return 0  # the native side picks default_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, numbers.Integral) or num_threads < 1:
        raise ValueError(f"{name} must be a positive int or None, got {num_threads!r}")
    return int(num_threads)


def check_tensor(t, name: str, dtypes: Sequence[torch.dtype], numel: Optional[int] = None) -> torch.Tensor:
    """Checks a tensor the kernel will read or write; returns it. ``ValueError`` names ``name``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got device {t.device}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}")
    if t.layout is not torch.strided or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous (strided) tensor")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (as params)")
    return t


def _scalar(x, name: str, *, positive: bool = False) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {x!r}") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be finite and {'> 0' if positive else '>= 0'}, got {x!r}")
    return v


def _step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step being taken, 1 for the first), got {step!r}")
    return int(step)


@dataclass(frozen=True)
class AdamStep:
    """One Adam step as the kernels take it, besides the buffers: the step being taken (1 for the
    first), the hyper-parameters, how the grads are scaled (``grad * clip_coef / grad_scale``),
    and the threads it runs on (None: all cores). Checked by the kernel call."""

    step: int
    hyper: AdamHyper
    grad_scale: float = 1.0
    clip_coef: float = 1.0
    num_threads: Optional[int] = None


# The streams the fused Adam can checksum as it goes (csrc/adam/adam_kernel.h, the CRC Note):
# bit k of the kernel's mask is CRC_STREAMS[k]; each names (buffer, as read or as written).
CRC_STREAMS = ("exp_avg_in", "exp_avg_sq_in", "master_out", "exp_avg_out", "exp_avg_sq_out")


class StateCrcs:
    """The CRC-32C of flat master and moment buffers as the fused Adam reads and writes them.

    Handed to adam_step_flat / adam_step_pieces (`crcs=`), which take the CRCs of the streams
    named here in their own pass and record them by element range (found from the segments'
    addresses). whole() joins them over the whole buffer; elements no Adam call covered (a
    parameter without a gradient, padding) are unchanged by the update, so their bytes,
    checksummed there, are the same as read and as written."""

    def __init__(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, streams):
        self.buffers = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        self.mask = 0
        for name in streams:
            self.mask |= 1 << CRC_STREAMS.index(name)
        self._pieces: list[tuple[int, int, list[int]]] = []  # (start, end, CRCs by stream)

    def _add(self, seg: list, crcs: list) -> None:
        base, size = self.buffers["master"].data_ptr(), self.buffers["master"].element_size()
        for i in range(len(seg) // 6):
            start = (seg[6 * i] - base) // size
            self._pieces.append((start, start + seg[6 * i + 5], crcs[5 * i : 5 * i + 5]))

    def whole(self, stream: str) -> int:
        k = CRC_STREAMS.index(stream)
        if not self.mask & (1 << k):
            raise ValueError(f"{stream} was not asked for (streams: {self.mask:#x})")
        buf = self.buffers[stream.rsplit("_", 1)[0]]
        size, ptr = buf.element_size(), buf.data_ptr()
        crc, at = 0, 0

        def join(c: int, n: int) -> int:
            return c if at == 0 else _C.crc32c_combine(crc, c, n * size)

        for a, b, crcs in sorted(self._pieces):
            if a < at:
                raise ValueError(f"the Adam calls' ranges overlap at element {a}")
            if a > at:  # not updated: the same bytes before and after
                crc, at = join(_C.crc32c(ptr + at * size, (a - at) * size), a - at), a
            if b > a:
                crc, at = join(crcs[k], b - a), b
        if buf.numel() > at:
            crc = join(_C.crc32c(ptr + at * size, (buf.numel() - at) * size), buf.numel() - at)
        return crc


def _run_crc(seg: list, codes: tuple, how_args: tuple, crcs: StateCrcs, with_norm: bool) -> float:
    sq, got = _C.adam_step_crc(seg, *codes, *how_args, -1, crcs.mask, with_norm)
    crcs._add(seg, got)
    return float(sq)


def _checked(how: AdamStep) -> tuple[int, float, int]:
    """(step, clip_coef / grad_scale, threads) of `how`, each checked."""
    if not isinstance(how, AdamStep):
        raise ValueError(f"expected an AdamStep, got {type(how).__name__}")
    if not isinstance(how.hyper, AdamHyper):
        raise ValueError(f"hyper must be an AdamHyper, got {type(how.hyper).__name__}")
    step = _step(how.step)
    grad_scale = _scalar(how.grad_scale, "grad_scale", positive=True)
    clip_coef = _scalar(how.clip_coef, "clip_coef")
    return step, clip_coef / grad_scale, _threads(how.num_threads)


def adam_step_flat(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    how: AdamStep,
    *,
    half_out: Optional[torch.Tensor] = None,
    check_finite: bool = False,
    crcs: Optional[StateCrcs] = None,
) -> bool:
    """One fused Adam step, in place, over flat buffers (e.g. one shard of many parameters).

    params fp32/bf16/fp16; grads fp32/bf16/fp16; exp_avg and exp_avg_sq fp32 (or, with 16-bit
    params, the params' own dtype); all contiguous CPU tensors with the same number of elements.
    Grads are used as ``grad * clip_coef / grad_scale`` (`how`). ``half_out`` (bf16/fp16) receives a
    copy of the updated params in the same pass. With ``check_finite``, the grads are scanned first
    (one extra read of them) and, if any is inf/nan, nothing is written and False is returned.
    Runs on ``how.num_threads`` threads (default: all cores) without the GIL. ``crcs``: the
    pass also takes the CRC-32Cs it names (params must be a range of its master: StateCrcs).
    """
    step, coef, threads = _checked(how)
    check_tensor(params, "params", tuple(DTYPE_CODES))
    n = params.numel()
    check_tensor(grads, "grads", tuple(DTYPE_CODES), n)
    state_dtypes = (torch.float32, params.dtype) if params.dtype in HALF_DTYPES else (torch.float32,)
    check_tensor(exp_avg, "exp_avg", state_dtypes, n)
    check_tensor(exp_avg_sq, "exp_avg_sq", (exp_avg.dtype,), n)
    out_code, out_ptr = NO_DTYPE, 0
    if half_out is not None:
        check_tensor(half_out, "half_out", HALF_DTYPES, n)
        if exp_avg.dtype != torch.float32:
            raise ValueError("half_out needs fp32 exp_avg/exp_avg_sq")
        out_code, out_ptr = DTYPE_CODES[half_out.dtype], half_out.data_ptr()
    seg = [params.data_ptr(), grads.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), out_ptr, n]
    codes = (DTYPE_CODES[params.dtype], DTYPE_CODES[grads.dtype], DTYPE_CODES[exp_avg.dtype], out_code)
    if crcs is not None:
        if check_finite:
            raise ValueError("crcs and check_finite together are not supported")
        _run_crc(seg, codes, (*how.hyper.kernel_args(), step, coef, threads), crcs, False)
        return True
    return bool(
        _C.adam_step(
            seg,
            DTYPE_CODES[params.dtype],
            DTYPE_CODES[grads.dtype],
            DTYPE_CODES[exp_avg.dtype],
            out_code,
            *how.hyper.kernel_args(),
            step,
            coef,
            bool(check_finite),
            threads,
            -1,
        )
    )


def adam_step_pieces(
    params: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    pieces: Sequence[tuple[int, int, torch.Tensor]],
    how: AdamStep,
    *,
    half_out: Optional[torch.Tensor] = None,
    crcs: Optional[StateCrcs] = None,
) -> float:
    """One fused Adam step over the pieces ``(start, end, grad)`` of flat fp32 params and moments
    (``grad`` holds ``end - start`` elements, fp32/bf16/fp16, all of one dtype; the pieces need not
    touch), returning the sum of squares of the raw grads taken in the same pass.

    The sum is bit for bit ``squared_norm([g for _, _, g in pieces])`` (the same chunks and
    partial sums), and each updated element is bit for bit what ``adam_step_flat`` gives: a
    caller may take a norm one way and update the other. Grads are used as ``grad * clip_coef /
    grad_scale`` (`how`); ``half_out`` (bf16/fp16, as long as params) receives the updated values;
    ``crcs``: the pass also takes the CRC-32Cs it names (StateCrcs over these params and moments)."""
    step, coef, threads = _checked(how)
    check_tensor(params, "params", (torch.float32,))
    n = params.numel()
    check_tensor(exp_avg, "exp_avg", (torch.float32,), n)
    check_tensor(exp_avg_sq, "exp_avg_sq", (torch.float32,), n)
    out_code = NO_DTYPE
    if half_out is not None:
        check_tensor(half_out, "half_out", HALF_DTYPES, n)
        out_code = DTYPE_CODES[half_out.dtype]
    if not pieces:
        return 0.0
    gdt = pieces[0][2].dtype
    seg: list = []
    sizes = (params.element_size(), half_out.element_size() if half_out is not None else 0)
    for i, (a, b, g) in enumerate(pieces):
        if not (0 <= a <= b <= n):
            raise ValueError(f"pieces[{i}] = ({a}, {b}) is not within the {n} params")
        check_tensor(g, f"pieces[{i}] grad", (gdt,), b - a)
        out = half_out.data_ptr() + a * sizes[1] if half_out is not None else 0
        off = a * sizes[0]
        seg += [
            params.data_ptr() + off,
            g.data_ptr(),
            exp_avg.data_ptr() + off,
            exp_avg_sq.data_ptr() + off,
            out,
            b - a,
        ]
    if crcs is not None:
        codes = (DTYPE_CODES[torch.float32], DTYPE_CODES[gdt], DTYPE_CODES[torch.float32], out_code)
        return _run_crc(seg, codes, (*how.hyper.kernel_args(), step, coef, threads), crcs, True)
    return float(
        _C.adam_step_norm(
            seg,
            DTYPE_CODES[torch.float32],
            DTYPE_CODES[gdt],
            DTYPE_CODES[torch.float32],
            out_code,
            *how.hyper.kernel_args(),
            step,
            coef,
            threads,
            -1,
        )
    )


def _buffers(tensors, name: str) -> list:
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    flat = []
    for i, t in enumerate(tensors):
        check_tensor(t, f"{name}[{i}]" if len(tensors) > 1 else name, tuple(DTYPE_CODES))
        flat += (t.data_ptr(), t.numel(), DTYPE_CODES[t.dtype])
    return flat


def squared_norm(
    tensors: Union[torch.Tensor, Sequence[torch.Tensor]], *, num_threads: Optional[int] = None
) -> float:
    """Sum of squares of a tensor (or of several, together), accumulated in fp64; inf and nan
    propagate, so ``math.isfinite(result)`` is the overflow check. fp32/bf16/fp16, contiguous."""
    return float(_C.adam_squared_norm(_buffers(tensors, "tensor"), _threads(num_threads)))


def all_finite(
    tensors: Union[torch.Tensor, Sequence[torch.Tensor]],
    *,
    mult: float = 1.0,
    num_threads: Optional[int] = None,
) -> bool:
    """True if every element (times ``mult``) of the tensors is finite; stops at the first inf/nan."""
    mult = float(mult)
    if not math.isfinite(mult):
        raise ValueError(f"mult must be finite, got {mult!r}")
    return bool(_C.adam_all_finite(_buffers(tensors, "tensor"), mult, _threads(num_threads)))


def convert_(dst: torch.Tensor, src: torch.Tensor, *, num_threads: Optional[int] = None) -> torch.Tensor:
    """``dst.copy_(src)`` between fp32/bf16/fp16 (round to nearest even) with the SIMD kernels."""
    check_tensor(src, "src", tuple(DTYPE_CODES))
    check_tensor(dst, "dst", tuple(DTYPE_CODES), src.numel())
    _C.adam_convert(
        src.data_ptr(),
        DTYPE_CODES[src.dtype],
        dst.data_ptr(),
        DTYPE_CODES[dst.dtype],
        src.numel(),
        _threads(num_threads),
    )
    return dst


def sum_parts_(
    pairs: Sequence[tuple[torch.Tensor, Sequence[torch.Tensor]]], *, num_threads: Optional[int] = None
) -> None:
    """For each (dst, parts): dst = parts[0] + parts[1] + ... added in fp32 in that order and
    rounded once to dst's dtype, in one pass over every pair (the SIMD kernels, threads over all
    pairs' elements together). All parts of one call share a dtype, all dsts another."""
    flat: list[int] = []
    src_dt = dst_dt = None
    for i, (dst, parts) in enumerate(pairs):
        check_tensor(dst, f"dst[{i}]", tuple(DTYPE_CODES))
        if not parts:
            raise ValueError(f"parts[{i}] is empty")
        dst_dt = dst.dtype if dst_dt is None else dst_dt
        if dst.dtype != dst_dt:
            raise ValueError(f"dst[{i}] has dtype {dst.dtype}, dst[0] {dst_dt}")
        flat += (dst.data_ptr(), dst.numel(), len(parts))
        for j, t in enumerate(parts):
            check_tensor(t, f"parts[{i}][{j}]", tuple(DTYPE_CODES), dst.numel())
            src_dt = t.dtype if src_dt is None else src_dt
            if t.dtype != src_dt:
                raise ValueError(f"parts[{i}][{j}] has dtype {t.dtype}, parts[0][0] {src_dt}")
            flat.append(t.data_ptr())
    if flat:
        _C.adam_sum(flat, DTYPE_CODES[src_dt], DTYPE_CODES[dst_dt], _threads(num_threads))


def bandwidth_floor(
    params: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    half_out: Optional[torch.Tensor] = None,
    num_threads: Optional[int] = None,
) -> None:
    """Adam's memory traffic on fp32 buffers (read p, g, m, v; write p, m, v; optionally a bf16
    copy) without its arithmetic: the floor a memory-bound step cannot beat. Values are kept."""
    check_tensor(params, "params", (torch.float32,))
    n = params.numel()
    for name, t in (("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_tensor(t, name, (torch.float32,), n)
    out_ptr = 0
    if half_out is not None:
        out_ptr = check_tensor(half_out, "half_out", (torch.bfloat16,), n).data_ptr()
    seg = [params.data_ptr(), grads.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), out_ptr, n]
    _C.adam_bandwidth_floor(seg, -1, _threads(num_threads))
