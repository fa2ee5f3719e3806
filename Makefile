# The habits. Every target that runs code first makes sure the environment is set up.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# DeepSpeed's JIT-built ops go into this clone's venv, not the ~/.cache every clone shares
# (a build killed there leaves a lock that hangs the next one; see tests/conftest.py).
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions

.PHONY: setup build test lint format demo doctor bench-io bench-adam bench-step bench-ab gpu-check clean

setup:
	@bash scripts/bootstrap.sh

build: setup

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check offloadpp tests scripts examples
	$(PY) -m ruff format --check offloadpp tests scripts examples

format: setup
	$(PY) -m ruff format offloadpp tests scripts examples
	$(PY) -m ruff check --fix offloadpp tests scripts examples

# The main job: fine-tune with all training state on disk, then a short A/B against ZeRO-Infinity.
demo: setup
	@bash scripts/demo.sh

# On a CUDA machine: build, the runtime's correctness on the GPU, the A/B against ZeRO-Infinity (TFLOPS).
gpu-check:
	@bash scripts/gpu_check.sh

doctor: setup
	$(PY) -m offloadpp doctor --dir runs/nvme

bench: bench-io bench-adam bench-step bench-ab

bench-io: setup
	$(PY) -m offloadpp io --dir runs/nvme --size-mb 1024

bench-adam: setup
	$(PY) -m offloadpp adam --params 100M

bench-step: setup
	$(PY) -m offloadpp step

bench-ab: setup
	$(PY) -m offloadpp ab --config ds_configs/gpt2_45m.offloadpp.json --steps 10 --out runs/ab

clean:
	rm -rf build *.egg-info offloadpp/_C*.so runs
