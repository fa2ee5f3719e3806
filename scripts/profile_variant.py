"""Derive a hardware profile from another by setting some of its fields, nothing else changed.

    python scripts/profile_variant.py SRC DST FIELD=VALUE [FIELD=VALUE ...]

VALUE is JSON. `ssds.read_gbps=X` / `ssds.write_gbps=X` set every drive's own rate. Made
docs/paper/rtx4090-datasheet.hardware.json (issue 36: the paper's machine at its parts' data-sheet
rates, twelve drives as one RAID0):

    python scripts/profile_variant.py docs/paper/rtx4090-12ssd.hardware.json \\
        docs/paper/rtx4090-datasheet.hardware.json ssd_read_gbps=78 ssd_write_gbps=40.8 \\
        ssds.read_gbps=6.5 ssds.write_gbps=3.4 memcpy_gbps=50 cpu_cores=52 \\
        'adam_params_per_s={"1": 0.4e9, "8": 2.5e9, "52": 10e9}' \\
        'device_name="NVIDIA GeForce RTX 4090 (hand-written: the Fuyou paper machine at data-sheet rates)"'

(scripts/ssd_variant.py divides every SSD rate by one factor instead.)
"""

from __future__ import annotations

import json
import sys

from offloadpp.planner.hardware import HardwareProfile


def variant(profile: dict, sets: list[tuple[str, object]], source: str) -> dict:
    out = dict(profile)
    for key, value in sets:
        if key.startswith("ssds."):
            field = key.split(".", 1)[1]
            out["ssds"] = [dict(d, **{field: value}) for d in out.get("ssds", [])]
        elif key not in out and key not in HardwareProfile.__dataclass_fields__:
            raise ValueError(f"profile_variant: {key!r} is no field of a hardware profile")
        else:
            out[key] = value
    said = ", ".join(f"{k}={json.dumps(v)}" for k, v in sets)
    out["notes"] = list(out.get("notes", [])) + [
        f"derived from {source} by scripts/profile_variant.py: {said}; nothing else changed"
    ]
    HardwareProfile.from_dict(out)  # refuses a profile the planner could not read
    return out


def _parse(arg: str) -> tuple[str, object]:
    key, sep, text = arg.partition("=")
    if not sep or not key:
        raise ValueError(f"profile_variant: expected FIELD=VALUE, got {arg!r}")
    try:
        return key, json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"profile_variant: the value of {key!r} is not JSON ({text!r}): {e}") from None


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = argv[0], argv[1]
    try:
        sets = [_parse(a) for a in argv[2:]]
        with open(src) as f:
            out = variant(json.load(f), sets, src)
    except (ValueError, OSError) as e:
        print(e, file=sys.stderr)
        return 2
    with open(dst, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
