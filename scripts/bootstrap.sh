#!/usr/bin/env bash
# Everything a fresh machine needs, idempotent and quick when already done:
# the system libaio (and liburing, fio for benchmarks), a virtual environment at .venv,
# torch (the CPU build unless one is already there), the pinned requirements, and offloadpp
# with its native extension built ahead of time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${OFFLOADPP_TORCH_SPEC:-torch==2.13.0}

need_pkgs=()
for p in libaio-dev liburing-dev fio; do
  dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "bootstrap: installing system packages: ${need_pkgs[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp="$VENV/.offloadpp-deps"
if [ ! -f "$stamp" ] || [ requirements.txt -nt "$stamp" ]; then
  echo "bootstrap: installing torch and requirements"
  "$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "is ignored: it is neither" || true
  "$PY" -c "import torch" 
  "$PY" -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 | grep -v "is ignored: it is neither" || true
  "$PY" -c "import deepspeed, transformers, pydantic, pybind11" 
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored: it is neither" || true
  touch "$stamp"
fi
# Rebuild the extension in place when a source changed (no-op otherwise).
echo "bootstrap: building offloadpp._C"
OFFLOADPP_REQUIRE_LIBAIO=1 "$PY" setup.py -q build_ext --inplace 2>&1 | grep -vE "^(running|copying)" || true
"$PY" -c "import offloadpp._C"
# DeepSpeed's ops that ZeRO-Infinity's NVMe path JIT-builds on first use (async_io, pin_memory,
# cpu_adam: minutes the first time, seconds after), built once here so that no test waits on one;
# into the folder the Makefile and tests/conftest.py name (op_locks.py, "building ahead of time").
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(cd "$VENV" && pwd)/torch_extensions}
echo "bootstrap: DeepSpeed's ops in $TORCH_EXTENSIONS_DIR"
"$PY" -m offloadpp.integrations.deepspeed.op_locks --build
echo "bootstrap: ready ($VENV)"
