"""`offloadpp doctor`: what this machine can do for offloadpp, and what is missing.

Exit status 0 when at least one I/O backend does a real O_DIRECT write and read-back on every
directory given; 1 otherwise, with a plain message saying what failed and how to fix it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dir",
        action="append",
        dest="dirs",
        metavar="DIR",
        help="directory that will hold swap files (repeatable; default: ./runs/nvme)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the findings as JSON")


def _versions() -> dict:
    out = {"python": platform.python_version()}
    try:
        import torch

        out["torch"] = torch.__version__
        from offloadpp.runtime.accel.cuda import available, device_names

        out["cuda_available"] = available()
        out["cuda_devices"] = device_names()
    except ImportError:
        out["torch"] = None
        out["cuda_available"] = False
    try:
        from importlib.metadata import version

        out["deepspeed"] = version("deepspeed")
    except Exception:  # not installed: the integration falls back to a clear error at initialize()
        out["deepspeed"] = None
    return out


def collect(dirs: list[str]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("offloadpp")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ours = "unknown (not installed)"
    from offloadpp.io import build_info, probe_backends
    from offloadpp.optim import simd_levels

    build = build_info()

    report = {
        "offloadpp": ours,
        "extension": build["extension"],
        "simd": simd_levels(),
        "cpus": os.cpu_count(),
        "build": build,
        **_versions(),
        "dirs": {},
    }
    for d in dirs:
        report["dirs"][d] = [
            {"backend": p.name, "built": p.available, "works": p.works, "detail": p.detail}
            for p in probe_backends(d)
        ]
    return report


def run(args: argparse.Namespace) -> int:
    dirs = args.dirs or [os.path.join("runs", "nvme")]
    for d in dirs:
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            print(f"cannot use {d!r} for swap files: {e.strerror} (errno {e.errno})")
            return 1
    report = collect(dirs)
    print(f"offloadpp {report['offloadpp']}  ({report['extension']})")
    ds = report["deepspeed"] or "not installed"
    print(f"python {report['python']}  torch {report['torch']}  deepspeed {ds}")
    print(f"cpus {report['cpus']}  simd {report['simd']['active']} (detected {report['simd']['detected']})")
    cuda = ", ".join(report.get("cuda_devices") or []) or "none"
    print(f"cuda available: {report['cuda_available']}  devices: {cuda}")
    print(f"built backends: {', '.join(k for k, v in report['build'].get('backends', {}).items() if v)}")
    print("auto picks the first that works, in the order listed below")
    ok_everywhere = True
    for d, probes in report["dirs"].items():
        print(f"\n{d}:")
        for p in probes:
            state = "ok" if p["works"] else ("not built" if not p["built"] else "FAILS")
            print(f"  {p['backend']:<11} {state:<9} {p['detail']}")
        if not any(p["works"] for p in probes):
            ok_everywhere = False
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if not ok_everywhere:
        print(
            "\nno I/O backend works on at least one directory: check that it exists, is writable, has free "
            "space and a filesystem that supports O_DIRECT (each probe's detail above names the errno); "
            "install libaio-dev for the default backend"
        )
        return 1
    return 0
