"""Mutation check of the runtime's ordering on the stand-in accelerator (runtime/accel/standin.py).

Every event wait, stream wait and stream-ordered free of the runtime names its site
(`site="weights.bind"`); this script finds them in the source (offloadpp/, outside runtime/accel/),
then for each one runs a fixed, fast subset of the stand-in tests (SUBSET; DP_SUBSET for the
sites only two ranks reach) with OFFLOADPP_STANDIN_SKIP set
to it (the stand-in then skips that one wait or free) and prints which test caught its removal:

    .venv/bin/python scripts/standin_mutations.py            # every site
    .venv/bin/python scripts/standin_mutations.py weights.bind act.in_use

A site whose removal no test catches prints NOT CAUGHT (exit status 1); one the subset never
reaches prints NOT REACHED (the stand-in reports how often it skipped it). The subset first runs
once unmutated and must pass.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "offloadpp"
ACCEL = PKG / "runtime" / "accel"

# the stand-in cases of exactness tests (parametrized over cpu and standin), fastest first; the
# data-parallel sites (dp.*, gathered.*) are reached only by two ranks: DP_SUBSET alone
SUBSET = [
    "tests/test_activations.py::test_on_the_standin_a_swap_in_released_in_flight_keeps_its_memory_for_the_copy",
    "tests/test_activations.py::test_on_the_standin_a_swap_out_cancelled_in_flight_gives_its_host_buffer_back_after_the_copy",
    "tests/test_runtime.py::test_all_state_on_ssd_trains_like_adamw[standin]",
    "tests/test_runtime.py::test_accumulation_and_clipping_train_like_adamw[standin]",
    "tests/test_runtime_device.py::test_fp32_trains_like_adamw[tiny_gpt2-standin]",
    "tests/test_runtime_device.py::test_bf16_compute_with_fp32_masters_matches_mixed_precision_adamw[tiny_gpt2-standin]",
    "tests/test_activations.py::test_gradients_equal_the_run_without_swapping[standin-host]",
    "tests/test_activations.py::test_gradients_equal_the_run_without_swapping[standin-ssd]",
    "tests/test_activations.py::test_gradients_equal_the_run_without_swapping[standin-recompute_host]",
    "tests/test_activations_engine.py::test_swapped_checkpoints_train_like_torch_adamw[partial_host-gpt2-standin]",
    "tests/test_activations_engine.py::test_fused_head_trains_like_torch_adamw[host-gpt2-standin]",
    "tests/test_speculation.py::test_on_the_standin_speculative_updates_equal_deferred_ones_and_torch[clipping]",
    "tests/test_checkpoint.py::test_resume_is_bit_identical[standin]",
    "tests/test_runtime_device.py::test_on_the_standin_weights_resident_on_the_device_train_like_adamw",
]
DP_SUBSET = [
    "tests/test_distributed.py::test_two_ranks_train_like_one_process_and_keep_half_the_state_each[standin]",
    "tests/test_distributed.py::test_16bit_compute_over_two_ranks[standin]",  # weights resident: regathered
]
DP_SITES = ("dp.", "gathered.")


def sites() -> dict[str, list[str]]:
    """site -> where it is named ("path:line"), from every call with a literal site= keyword."""
    out: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        if ACCEL in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if (
                        kw.arg is not None
                        and kw.arg.endswith("site")
                        and isinstance(kw.value, ast.Constant)
                        and isinstance(kw.value.value, str)
                    ):
                        out.setdefault(kw.value.value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def run(skip: str | None, tests: list[str]) -> tuple[int, str, float, bool]:
    """(exit status, output, seconds, whether the stand-in skipped `skip` at least once)."""
    with tempfile.NamedTemporaryFile("r", suffix=".skips") as log:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OFFLOADPP_STANDIN_SKIP=skip or "",
                   OFFLOADPP_STANDIN_SKIP_LOG=log.name)  # fmt: skip
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0, bool(log.read().strip())


def main(argv: list[str]) -> int:
    found = sites()
    chosen = argv or sorted(found)
    unknown = [s for s in chosen if s not in found]
    if unknown:
        raise SystemExit(f"no such site: {unknown}; the sites are {sorted(found)}")
    for tests in (SUBSET, DP_SUBSET):
        rc, out, secs, _ = run(None, tests)
        if rc != 0:
            print(out[-4000:])
            raise SystemExit(f"the stand-in subset fails unmutated (exit {rc}); fix that first")
        print(f"unmutated: {len(tests)} tests passed in {secs:.0f} s")
    print(f"{'site':28} {'named at':42} caught by")
    missed = 0
    for site in chosen:
        rc, out, secs, skipped = run(site, DP_SUBSET if site.startswith(DP_SITES) else SUBSET)
        failed = re.search(r"^FAILED (\S+?)(?: - |$)", out, re.M)
        if failed:
            verdict = f"{failed.group(1).removeprefix('tests/')} ({secs:.0f} s)"
        elif rc != 0:
            verdict = f"exit {rc} ({secs:.0f} s)"
        else:
            missed += 1
            verdict = "NOT CAUGHT" if skipped else "NOT REACHED"
        print(f"{site:28} {found[site][0].removeprefix('offloadpp/runtime/'):42} {verdict}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
