#!/usr/bin/env bash
# The one command that checks offloadpp on a CUDA machine:
#   1. builds the native extension against the CUDA torch of this environment;
#   2. the runtime's correctness on the GPU: bf16 compute with fp32 master weights against torch's
#      mixed-precision AdamW, and fp32 against torch AdamW, every array on SSD
#      (tests/test_runtime_device.py, the `cuda` cases), and the exactness tests the CPU device and
#      the stand-in run (tests/conftest.py's `on_device`, whose `cuda` case sets
#      OFFLOADPP_DEVICE=cuda): `pytest -m cuda` over their files; a failure there is reported and
#      the A/B still runs;
#   3. the A/B against ZeRO-Infinity on GPT-2 1.3B (ds_configs/gpt2_1.3b.*.json: bf16, batch 4 x
#      1024, weights and optimizer state on NVMe) with each side's device memory capped to 24 GiB,
#      printing step time, tokens/s and TFLOP/s (6NT) side by side.
#
#   bash scripts/gpu_check.sh
#   PY=/path/to/python NVME=/nvme0/swap STEPS=6 CAP_GIB=24 bash scripts/gpu_check.sh
#
# PY: a python whose torch has CUDA (default: .venv/bin/python; `make setup` builds one with
# OFFLOADPP_TORCH_SPEC naming a CUDA torch, e.g. "torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cu128"). NVME: where the A/B's swap files go (an SSD; the two
# sides run one after the other, each needs about 25 GB there). The first run JIT-builds
# DeepSpeed's async_io and cpu_adam ops for the ZeRO side.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
OUT=${OUT:-runs/gpu_check}
NVME=${NVME:-$OUT/nvme}
STEPS=${STEPS:-6}
CAP_GIB=${CAP_GIB:-24}
SEQ=${SEQ:-1024}
mkdir -p "$OUT" "$NVME"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(dirname "$(dirname "$PY")")/torch_extensions}

"$PY" - <<'PYCHECK'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device; run this on a GPU machine with a CUDA "
             "build of torch (PY=..., or make setup with OFFLOADPP_TORCH_SPEC naming one)")
p = torch.cuda.get_device_properties(0)
print(f"gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {p.name}, {p.total_memory / 2**30:.0f} GiB")
PYCHECK

echo "== 1/3 build"
OFFLOADPP_REQUIRE_LIBAIO=1 "$PY" setup.py -q build_ext --inplace 2>&1 | grep -vE "^(running|copying)" || true
"$PY" -c "import offloadpp._C"
"$PY" -m offloadpp doctor --dir "$NVME"

echo "== 2/3 correctness on the GPU (bf16 compute, fp32 masters, against torch AdamW; the on_device tests)"
# the files holding `cuda`-marked tests: test_runtime_device's own, and every on_device test's
TESTS=$(grep -lE "on_device|mark\.cuda" tests/test_*.py | tr '\n' ' ')
status=0
"$PY" -m pytest -q -m cuda $TESTS || status=$?

echo "== 3/3 A/B against ZeRO-Infinity: GPT-2 1.3B, bf16, ${CAP_GIB} GiB of device memory each"
"$PY" -m offloadpp bench ab --config ds_configs/gpt2_1.3b.offloadpp.json --model gpt2-1.3b --steps "$STEPS" \
  --seq-len "$SEQ" --device-memory-gib "$CAP_GIB" --no-interleave --nvme-dir "$NVME" --out "$OUT/ab"
"$PY" - "$OUT/ab/ab.json" <<'PYTFLOPS'
import json, sys
ab = json.load(open(sys.argv[1]))
sides = {k: v for k, v in ab.get("summary", {}).items() if isinstance(v, dict) and "tflops" in v}
for name, side in sides.items():
    print(f"gpu_check: {name}: {side['tflops']:.2f} TFLOP/s (6NT), step {side.get('step_s', float('nan')):.3f} s")
if not sides:
    print(f"gpu_check: no TFLOP/s in {sys.argv[1]}: see the table above")
PYTFLOPS
echo "gpu_check done: $OUT/ab/ab.json (tests exit status $status)"
exit $status
