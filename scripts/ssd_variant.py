"""Derive a hardware profile whose SSDs are N times slower than another's: every SSD rate (the
aggregate read/write and mixed rates, each drive's own) divided by N, nothing else changed.

    python scripts/ssd_variant.py docs/paper/rtx4090-12ssd.hardware.json 12 docs/paper/rtx4090-1ssd.hardware.json

made docs/paper/rtx4090-1ssd.hardware.json: the paper's machine as a consumer machine with the
SSD bandwidth of one of its twelve drives' share (docs/performance.md, "Vertical accumulation").
"""

from __future__ import annotations

import json
import sys

RATES = ("ssd_read_gbps", "ssd_write_gbps", "ssd_mixed_gbps", "ssd_mixed_busy_gbps")


def slower(profile: dict, n: float, source: str) -> dict:
    out = dict(profile)
    for k in RATES:
        if k in out:
            out[k] = out[k] / n
    out["ssds"] = [
        dict(d, read_gbps=d["read_gbps"] / n, write_gbps=d["write_gbps"] / n) for d in out.get("ssds", [])
    ]
    out["notes"] = list(out.get("notes", [])) + [
        f"derived from {source} by scripts/ssd_variant.py: every SSD rate divided by {n:g}, nothing else changed"
    ]
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, n, dst = argv[0], float(argv[1]), argv[2]
    if n <= 0:
        print(f"ssd_variant: the divisor must be > 0, got {n:g}", file=sys.stderr)
        return 2
    with open(src) as f:
        profile = json.load(f)
    with open(dst, "w") as f:
        json.dump(slower(profile, n, src), f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
