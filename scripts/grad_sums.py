"""A vertical window's gradient sums, side by side: the ways of summing G micro-batches' 16-bit
gradients of one parameter in fp32 and rounding the sum once (runtime/window_grads.py).

    python scripts/grad_sums.py [--numel 50000000] [--g 8] [--dtype bf16] [--rounds 5]

- adds: each gradient added into an fp32 sum as it arrives (`to(float32)`, then `add_`), the sum
  rounded at the end: what the window did before the kernel (about 10 bytes of memory traffic
  per element per micro-batch);
- stack: torch.stack of the G gradients, `sum(0, dtype=float32)`, rounded (torch alone in one
  call; its summation order is torch's reduction's, not the arrival order);
- kernel: offloadpp.optim.sum_parts_ (csrc/adam, the active SIMD level): the G gradients read
  once, added in order in fp32, the sum written rounded (2G + 2 bytes an element).

Rounds alternate the three, so they see the same load; prints each one's median seconds, ns per
element per micro-batch and whether its bits equal the adds'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from offloadpp.optim import kernel_isa, sum_parts_

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--g", type=int, default=8, help="micro-batches (gradients per parameter)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    dt, n = DTYPES[a.dtype], a.numel
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=gen).to(dt) for _ in range(a.g)]

    def adds() -> torch.Tensor:
        s = parts[0].to(torch.float32, copy=True)
        for g in parts[1:]:
            s.add_(g)
        return s.to(dt)

    def stack() -> torch.Tensor:
        return torch.stack(parts).sum(0, dtype=torch.float32).to(dt)

    def kernel() -> torch.Tensor:
        out = torch.empty(n, dtype=dt)
        sum_parts_([(out, parts)])
        return out

    ways = {"adds": adds, "stack": stack, "kernel": kernel}
    times: dict[str, list[float]] = {k: [] for k in ways}
    ref = adds()
    same = {}
    for _ in range(a.rounds):
        for name, f in ways.items():
            t = time.perf_counter()
            out = f()
            times[name].append(time.perf_counter() - t)
            same[name] = torch.equal(out.view(torch.int16), ref.view(torch.int16))
            del out
    print(f"{n:,} elements x {a.g} micro-batches, {a.dtype}, torch threads {torch.get_num_threads()}, "
          f"kernel {kernel_isa()}, medians of {a.rounds}")  # fmt: skip
    base = statistics.median(times["adds"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:6s} {m:8.3f} s  {m / (n * a.g) * 1e9:6.3f} ns/element/micro-batch  "
              f"{base / m:5.2f}x the adds  bits equal to the adds: {same[name]}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
