#!/usr/bin/env bash
# Sets up a GPU machine that reaches no package registry, before scripts/gpu_check.sh, from files
# prepared on a machine that does (source this file from the repo root):
#
#   mkdir -p .whl .deb      # both ignored by git
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 hjson==3.1.0 \
#       transformers==5.24.0 annotated-types typing-inspection typing-extensions
#   DS_BUILD_OPS=0 .venv/bin/python -m pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
#   (cd .deb && apt-get download libaio1 libaio-dev liburing2 liburing-dev)
#
# (the GPU machine's own python3 brings torch with CUDA; what it lacks of requirements.txt comes as
# wheels.) Wheels go to /tmp/site (PYTHONPATH), libaio's and liburing's headers and libraries to
# /usr/local (not the whole packages into /), then offloadpp._C is built in place. Used on the lent
# H200 of 2026-12-04 (docs/performance.md, "First run on a GPU"). Then: PY=python3 bash scripts/gpu_check.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/deb && for f in .deb/*.deb; do dpkg -x "$f" /tmp/deb; done
cp -a /tmp/deb/usr/include/*.h /usr/local/include/ 2>/dev/null || true
cp -a /tmp/deb/usr/include/liburing /usr/local/include/ 2>/dev/null || true
cp -a /tmp/deb/usr/lib/x86_64-linux-gnu/libaio* /tmp/deb/usr/lib/x86_64-linux-gnu/liburing* /usr/local/lib/ 2>/dev/null || true
ldconfig
python3 -c "import torch, deepspeed, transformers, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0), 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" || return 1
OFFLOADPP_REQUIRE_LIBAIO=1 python3 setup.py -q build_ext --inplace 2>&1 | grep -vE "^(running|copying)" | tail -5 || true
python3 -c "import offloadpp._C" || return 1
